"""The launch-plan executor on a recording fake device: buffers, views, aliases and sizes, without a GPU."""

from __future__ import annotations

import math

import pytest

from dflash_compiler.ir.graph import eval_dim
from dflash_compiler.plans import dtype_bytes
from dflash_compiler.runtime.executor import PhaseExecutor

pytest.importorskip("tvm")


class FakeDevice:
    """Hands out disjoint address ranges and records uploads."""

    def __init__(self) -> None:
        self.next = 1 << 32
        self.sizes: dict[int, int] = {}
        self.requested: dict[int, int] = {}
        self.zeroed: dict[int, int] = {}

    def alloc(self, nbytes: int) -> int:
        pointer = self.next
        self.sizes[pointer] = max(int(nbytes), 1)
        self.requested[pointer] = int(nbytes)
        self.next += (max(int(nbytes), 1) + 255) // 256 * 256
        return pointer

    def free(self, pointer: int) -> None:
        del self.sizes[pointer]

    def zero(self, pointer: int, nbytes: int) -> None:
        assert nbytes <= self.sizes[pointer]
        self.zeroed[pointer] = nbytes


class FakeModule:
    def __init__(self) -> None:
        self.launches: list[tuple[str, dict[str, int], dict[str, int]]] = []

    def launch(self, launch, pointers, env, stream=0) -> None:
        self.launches.append((launch.name, dict(pointers), dict(env)))


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    from dflash_compiler.config import load_drafter_config
    from dflash_compiler.options import BuildOptions
    from dflash_compiler.pipeline import compile_drafter
    from dflash_compiler.targets import SM90

    cfg = load_drafter_config("examples/tiny-dflash")
    options = BuildOptions(max_batch=4, max_seq_len=256, max_ctx_rows=64)
    return compile_drafter(cfg, options, SM90, tmp_path_factory.mktemp("a") / "tiny")[1]


def _executor(manifest, phase: str):
    device, module = FakeDevice(), FakeModule()
    weights = {name: device.alloc(math.prod(w.shape) * dtype_bytes(w.dtype)) for name, w in manifest.weights.items()}
    kv = device.alloc(manifest.kv_cache.total_bytes)
    ex = PhaseExecutor(device, module, manifest.phases[phase], manifest.kernels, {**weights, "kv_cache": kv})
    return ex, module, weights, kv


def test_kv_writes_go_to_their_layer_and_half(manifest):
    """fuse_kv_writes leaves one call that takes the whole cache; its targets (in the kernel's name) are every
    layer's K then V."""
    ex, module, _, kv = _executor(manifest, "append_context")
    dims = {"ctx": 5, "pages": manifest.kv_cache.num_pages}
    ex.run(dims)
    plan = manifest.phases["append_context"]
    layers = int(plan.values["kv_cache"].shape[0])
    (call,) = [c for c in plan.calls if c.kernel.startswith("kv_write")]
    targets = "_".join(f"{layer}{half}" for layer in range(layers) for half in "kv")
    assert call.kernel.startswith("kv_writes_") and call.kernel.endswith(f"_{targets}")
    (binding,) = [b for b in call.buffers if b.param == "cache"]
    assert binding.index == () and ex.address(binding, dims) == kv
    assert [x for x in module.launches if x[0].startswith(call.kernel)]


@pytest.mark.parametrize("phase", ["propose", "append_context"])
def test_workspaces_are_zero_filled_when_allocated(manifest, phase):
    """A kernel may keep counts in its workspace that it returns to zero itself (the warpgroup GEMM's last-block
    k-split sum): each workspace is zero-filled once, whole, when the executor allocates it."""
    ex, _, _, _ = _executor(manifest, phase)
    assert ex.workspaces
    for pointer in ex.workspaces.values():
        assert ex.device.zeroed[pointer] == ex.device.requested[pointer]


def test_every_launch_gets_every_pointer_and_its_sizes(manifest):
    ex, module, _, _ = _executor(manifest, "propose")
    dims = {
        "nb": 3,
        "blk": manifest.block_size,
        "pages": manifest.kv_cache.num_pages,
        "maxp": manifest.kv_cache.pages_per_seq,
    }
    ex.run(dims)
    plan = manifest.phases["propose"]
    # a linear holds its kernel for few rows (GEMV mode or the small tiled plan), on sm_90 the 64-row GEMM of
    # the calls up to mid_rows (and, for qkv-like weights, that of the calls up to tall_rows), and the tiled
    # GEMM (each GEMM with its merge kernel where k is split); each call launches what its row count selects:
    # one GEMM and its merge, or the few-rows kernel
    launches = []
    for call in plan.calls:
        env = {var: eval_dim(expr, dims) for var, expr in call.sizes}
        kernels = manifest.kernels[call.kernel].kernels
        chosen = [k for k in kernels if k.runs(env)]
        if call.kernel.startswith("matmul"):
            assert 2 <= len(kernels) <= 7, call.node
            if env["m"] <= 32:
                assert chosen == [kernels[0]], (call.node, env)
            else:
                assert 1 <= len(chosen) <= 2 and kernels[0] not in chosen, (call.node, env)
                assert len({k.when for k in chosen}) == 1, (call.node, env)
        launches += [(call, k) for k in chosen]
    assert len(module.launches) == len(launches) < sum(len(manifest.kernels[c.kernel].kernels) for c in plan.calls)
    for (name, pointers, env), (call, launch) in zip(module.launches, launches, strict=True):
        assert name == launch.name
        for p in launch.params:
            if p.kind == "ptr":  # inside a buffer the executor or the caller allocated
                address = pointers[p.source]
                assert any(base <= address < base + size for base, size in ex.device.sizes.items()), (name, p.name)
        expected_sizes = {"nb*blk": 3 * manifest.block_size, "nb*(blk-1)": 3 * (manifest.block_size - 1), "nb": 3}
        for var, expr in call.sizes:
            if expr in expected_sizes:
                assert env[var] == expected_sizes[expr], (call.node, var)


def test_scratch_values_live_in_the_arena_and_aliases_resolve(manifest):
    ex, _, _, kv = _executor(manifest, "append_context")
    plan = manifest.phases["append_context"]
    for name, slot in plan.values.items():
        owner = plan.resolve(name)
        if slot.kind == "scratch":
            assert ex.base[name] == ex.arena + slot.offset
            assert slot.offset + ex.max_bytes(name) <= plan.arena_bytes
        if name.endswith("write_v") or name == "kv_cache_out":
            assert owner == "kv_cache" and ex.base[owner] == kv
