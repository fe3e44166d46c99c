"""Linears over tiled weights (weight_tiles.py, ir_passes/tile_weights.py): the spec a tiled node gives, the
CPU oracle against numpy, and every kernel of the family lowered and built for sm_90 and sm_120 with its
weight copies through the layout. The scheduled kernels' numbers on the GPU: tests/gpu with the Qwen3-8B
kernel bundles (their linears are tiled) and the tiny artifacts.
"""

from __future__ import annotations

import numpy as np
import pytest

from dflash_compiler.ir.graph import Node, TensorType
from dflash_compiler.ir.ops import Op
from dflash_compiler.runtime.expr import evaluate
from dflash_compiler.schedules.base import OpInstance, ScheduleError
from dflash_compiler.schedules.linear import BF16, FP8, LinearSpec, spec_of
from dflash_compiler.schedules.linear_rules import LinearArgmaxRule, LinearMmaRule, LinearSiluRule
from dflash_compiler.targets import SM90, SM120

tvm = pytest.importorskip("tvm")

from kernel_harness import assert_nvrtc_builds, assert_spec_matches_numpy, kernel_bodies, weight_reads  # noqa: E402

from dflash_compiler.codegen import lower_to_cuda  # noqa: E402 - needs TVM


def _by_hand(w: np.ndarray) -> np.ndarray:
    """Tile (i, j) = rows 64 i .., columns 64 j .., row-major inside; the tiles of a row block in turn."""
    n, k = w.shape
    return np.concatenate(
        [w[i : i + 64, j : j + 64].reshape(-1) for i in range(0, n, 64) for j in range(0, k, 64)]
    ).reshape(n, k)


@pytest.mark.parametrize(
    ("spec", "rows"),
    [
        (LinearSpec("matmul", 128, 192, tiles=64), 5),
        (LinearSpec("matmul_fp8", 64, 128, FP8, tiles=64), 3),
        (LinearSpec("matmul_silu", 128, 64, tiles=64), 4),
        (LinearSpec("lm_head_argmax", 256, 64, FP8, tiles=64), 6),
    ],
    ids=lambda v: v.name if isinstance(v, LinearSpec) else str(v),
)
def test_tiled_spec_matches_numpy(spec, rows):
    assert_spec_matches_numpy(spec, {"m": rows}, seed=spec.n + rows)


def test_sample_stores_the_weight_tiled():
    for plain in (LinearSpec("matmul", 128, 192), LinearSpec("lm_head_argmax", 256, 64, FP8)):
        tiled = LinearSpec(plain.op, plain.n, plain.k, plain.weight_dtype, tiles=64)
        a, b = (s.sample(np.random.default_rng(3), {"m": 4}) for s in (plain, tiled))
        np.testing.assert_array_equal(b["w"].view(np.uint8), _by_hand(a["w"]).view(np.uint8))


def test_a_tiled_node_gives_a_tiled_spec_and_shapes_are_checked():
    node = Node.make(Op.MATMUL, [TensorType(BF16, ("m", 4096))], weight_tiles=64)
    subject = OpInstance("l0.o", node, (TensorType(BF16, ("m", 4096)), TensorType(BF16, (4096, 4096))))
    spec = spec_of(subject)
    assert spec == LinearSpec("matmul", 4096, 4096, tiles=64) and spec.name == "matmul_n4096_k4096_t64"
    assert spec.node().attr("weight_tiles") == 64
    for kwargs in ({"n": 96, "k": 64, "tiles": 64}, {"n": 64, "k": 64, "tiles": 32}):
        with pytest.raises(ScheduleError, match="weight layout tiles="):
            LinearSpec("matmul", **kwargs)


@pytest.mark.parametrize("target", [SM90, SM120], ids=lambda t: t.name)
@pytest.mark.parametrize(
    ("rule", "spec"),
    [
        (LinearMmaRule(), LinearSpec("matmul", 6144, 4096, tiles=64)),
        (LinearMmaRule(), LinearSpec("matmul_fp8", 4096, 12288, FP8, tiles=64)),
        (LinearSiluRule(), LinearSpec("matmul_silu", 24576, 4096, tiles=64)),
        (LinearArgmaxRule(), LinearSpec("lm_head_argmax", 151936, 4096, FP8, tiles=64)),
    ],
    ids=lambda v: v.name if isinstance(v, LinearSpec) else "",
)
def test_every_kernel_reads_the_tiled_place_of_each_element(rule, spec, target):
    """Every kernel of the tiled module reads, at every weight access, the tiled place (tile_offset, by hand
    below) of the element the row-major module's kernel reads there: the addresses of the generated CUDA are
    evaluated for thread, block and loop indices drawn inside their ranges, where the enclosing conditions
    hold. The module also builds."""
    plain = LinearSpec(spec.op, spec.n, spec.k, spec.weight_dtype)
    modules = [lower_to_cuda(tvm.IRModule({s.name: rule.apply(s, target).func}), target) for s in (plain, spec)]
    launches = {launch.name: launch for f in modules[0].functions.values() for launch in f.kernels}
    rows, tiled = (kernel_bodies(m.source) for m in modules)
    assert [name.replace(plain.name, spec.name) for name in rows] == list(tiled)
    rng = np.random.default_rng(0)
    checked = 0
    for name, body in rows.items():
        launch = launches[name]
        axes = (("t", launch.block), ("b", launch.grid))
        extents = {
            f"{axis}{d}": int(evaluate(e, {"m": 128})) for axis, dims in axes for d, e in zip("xyz", dims, strict=True)
        }
        pairs = list(zip(weight_reads(body), weight_reads(tiled[name.replace(plain.name, spec.name)]), strict=True))
        for (address, loops, conditions), (tiled_address, _, _) in pairs:
            for _ in range(64):
                env = {v: int(rng.integers(n)) for v, n in {**extents, **loops}.items()} | {"m": 128}
                if not all(c(env) for c in conditions):
                    continue
                element = address(env)
                row, col = divmod(element, spec.k)
                want = ((row // 64) * (spec.k // 64) + col // 64) * 4096 + row % 64 * 64 + col % 64
                assert tiled_address(env) == want, (name, env)
                checked += 1
    assert checked > 100 * len(rows)
    assert_nvrtc_builds(modules[1], target.arch)
