"""cluster.py: the kernels that call dflash_cluster_dims get that compile-time cluster shape, declaration and
definition alike; others are untouched; an ambiguous or oversized shape is refused."""

from __future__ import annotations

import pytest

from dflash_compiler.cluster import (
    DIMS,
    MAX_CLUSTER,
    MAX_PORTABLE,
    ClusterError,
    add_cluster_dims,
    cluster_dims,
    non_portable,
)

SOURCE = f"""\
extern "C" __global__ void __launch_bounds__(256) a_kernel(float* __restrict__ y_ptr, int m);
extern "C" __global__ void b_kernel(float* __restrict__ y_ptr);
extern "C" __global__ void __launch_bounds__(256) a_kernel(float* __restrict__ y_ptr, int m) {{
  {DIMS}(1, 1, 4);
  y_ptr[0] = 1.0f;
}}

extern "C" __global__ void b_kernel(float* __restrict__ y_ptr) {{
  y_ptr[1] = 2.0f;
}}
"""


def test_the_marked_kernel_gets_its_cluster_shape_in_both_signatures():
    clusters = cluster_dims(SOURCE)
    assert clusters == {"a_kernel": (1, 1, 4)}
    out = add_cluster_dims(SOURCE, clusters)
    marked = 'extern "C" __global__ void __launch_bounds__(256) __cluster_dims__(1, 1, 4) a_kernel('
    assert out.count(marked) == 2  # the forward declaration and the definition
    assert out.count("__cluster_dims__") == 2
    assert out.replace("__cluster_dims__(1, 1, 4) ", "") == SOURCE  # nothing else changes


def test_a_kernel_without_launch_bounds_takes_the_shape_too():
    source = SOURCE.replace(f"  {DIMS}(1, 1, 4);\n", "").replace("y_ptr[1] = 2.0f;", f"{DIMS}(2, 1, 1);")
    out = add_cluster_dims(source, cluster_dims(source))
    assert 'extern "C" __global__ void __cluster_dims__(2, 1, 1) b_kernel(' in out
    assert "__launch_bounds__(256) __cluster_dims__" not in out


def test_two_shapes_or_too_many_blocks_are_refused():
    twice = SOURCE.replace("y_ptr[0] = 1.0f;", f"{DIMS}(1, 1, 2);")
    with pytest.raises(ClusterError, match="expected one shape"):
        cluster_dims(twice)
    big = SOURCE.replace(f"{DIMS}(1, 1, 4)", f"{DIMS}(1, 1, {MAX_CLUSTER + 1})")
    with pytest.raises(ClusterError, match="expected 1 to 16 blocks"):
        cluster_dims(big)


def test_clusters_past_portable_are_sm90s_opt_in():
    """Up to 8 blocks are portable; 9 to 16 build and need the runtime's opt-in (non_portable), more are refused."""
    wide = SOURCE.replace(f"{DIMS}(1, 1, 4)", f"{DIMS}({MAX_CLUSTER}, 1, 1)")
    assert cluster_dims(wide) == {"a_kernel": (MAX_CLUSTER, 1, 1)}
    assert non_portable((MAX_CLUSTER, 1, 1)) and non_portable((1, 3, 3))
    assert not non_portable((MAX_PORTABLE, 1, 1)) and not non_portable((1, 1, 1))


def test_a_launch_without_a_cluster_serializes_as_before_the_field():
    """Artifacts built before the field existed keep their manifest digest; a clustered launch round-trips."""
    import json

    from dflash_compiler.codegen import KernelLaunch

    fields = {"name": "k", "params": (), "launch_tags": (), "grid": ("1", "1", "4"), "block": ("128", "1", "1")}
    plain = KernelLaunch(dynamic_smem="0", **fields)
    assert "cluster" not in plain.model_dump(mode="json")
    assert KernelLaunch.model_validate_json(json.dumps(plain.model_dump(mode="json"))) == plain
    clustered = plain.model_copy(update={"cluster": (1, 1, 4)})
    dumped = clustered.model_dump(mode="json")
    assert dumped["cluster"] == [1, 1, 4]
    assert KernelLaunch.model_validate_json(json.dumps(dumped)).cluster == (1, 1, 4)
