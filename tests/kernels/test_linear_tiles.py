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
from dflash_compiler.schedules.base import OpInstance, ScheduleError
from dflash_compiler.schedules.linear import (
    BF16,
    FP8,
    LinearArgmaxRule,
    LinearMmaRule,
    LinearSiluRule,
    LinearSpec,
    spec_of,
)
from dflash_compiler.targets import SM90, SM120

tvm = pytest.importorskip("tvm")

from kernel_harness import assert_nvrtc_builds, assert_spec_matches_numpy  # noqa: E402 - TVM

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
        (LinearMmaRule(), LinearSpec("matmul", 4096, 4096, tiles=64)),
        (LinearMmaRule(), LinearSpec("matmul_fp8", 4096, 12288, FP8, tiles=64)),
        (LinearSiluRule(), LinearSpec("matmul_silu", 24576, 4096, tiles=64)),
        (LinearArgmaxRule(), LinearSpec("lm_head_argmax", 151936, 4096, FP8, tiles=64)),
    ],
    ids=lambda v: v.name if isinstance(v, LinearSpec) else "",
)
def test_every_kernel_reads_the_tiles(rule, spec, target):
    """Each kernel's weight reads differ from the row-major build's (they go through the layout), and the
    module builds. A weight row's 16-byte vectors run along k inside a tile: 64 elements, then the next
    tile 4096 elements on, so no tiled kernel steps a whole row (k elements) from one k step to the next."""
    plain = LinearSpec(spec.op, spec.n, spec.k, spec.weight_dtype)
    sources = {}
    for s in (plain, spec):
        kernel = rule.apply(s, target)
        cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), target)
        sources[s.tiles] = cuda
    tiled, row_major = sources[64], sources[0]
    assert tiled.kernel_names() == [name.replace(plain.name, spec.name) for name in row_major.kernel_names()]
    reads = [line for line in tiled.source.splitlines() if "w_ptr" in line and "__global__" not in line]
    plain_reads = [line for line in row_major.source.splitlines() if "w_ptr" in line and "__global__" not in line]
    assert reads and len(reads) == len(plain_reads) and set(reads).isdisjoint(plain_reads)
    assert_nvrtc_builds(tiled, target.arch)
