"""Build path: TVM lowering → kernel table, NVRTC cubins for every target arch, ELF check, safe evaluator.

The module is lowered once and each arch compiled once (module-scoped fixtures): NVRTC spends 1.5–5 s
per source per arch on this 2-core machine, mostly parsing TVM's headers.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dflash_compiler.codegen import CodegenError, CudaModule
from dflash_compiler.cubin import CubinError, cubin_arch
from dflash_compiler.runtime.expr import UnsafeExpressionError, compile_expression, evaluate, expression_names
from dflash_compiler.targets import SM90, TARGETS

# ------------------------------------------------------------------------------ evaluator (no TVM needed)


@pytest.mark.parametrize(
    ("text", "env", "value"),
    [
        ("((m + 3) // 4)", {"m": 5}, 2),
        ("(m * 16)", {"m": 33}, 528),
        ("-7 // 2", {}, -4),  # floor division, as TIR's FloorDiv
        ("-7 % 3", {}, 2),
        ("min(m, 4) * 4096 * 2", {"m": 3}, 24576),
        ("max(a, b, 2)", {"a": 1, "b": -1}, 2),
        ("(1 if m < 8 else 2)", {"m": 9}, 2),
        ("(m < 8) + (m >= 8)", {"m": 9}, 1),
        ("0 < m <= 16", {"m": 16}, 1),
        ("(m > 1 and m < 4)", {"m": 5}, 0),
        ("(not m) or 7", {"m": 1}, 7),
        ("True + 1", {}, 2),
        ("  m  ", {"m": 3}, 3),
    ],
)
def test_evaluate(text, env, value):
    assert evaluate(text, env) == value


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",
        "m.__class__",
        "x[0]",
        "(lambda: 1)()",
        "2 ** 10",
        "1.5",
        "'text'",
        "open('f')",
        "min(m)",
        "min(m, key=abs)",
        "f(1, 2)",
        "[1, 2]",
        "m / 2",
        "m << 2",
        "~m",
        "(m := 3)",
        "int(m)",
        "1; 2",
        "",
        "(" * 1500 + "1" + ")" * 1500,  # deeper than the parser allows
        "1+" * 1500 + "1",  # deeper than Python's recursion limit
        "1+" * 3000 + "1",  # longer than any kernel-table expression
    ],
)
def test_evaluator_rejects_unsafe_expressions(text):
    with pytest.raises(UnsafeExpressionError):
        evaluate(text, {"m": 1, "x": 1})


def test_evaluator_errors_say_what_is_missing():
    with pytest.raises(UnsafeExpressionError, match=r"needs 'n'.*given: m"):
        evaluate("m + n", {"m": 1})
    with pytest.raises(UnsafeExpressionError, match="divides by zero"):
        evaluate("m // (m - 1)", {"m": 1})
    with pytest.raises(UnsafeExpressionError, match="expected an integer"):
        evaluate("m + 1", {"m": 1.5})  # type: ignore[dict-item]


def test_compiled_expression_is_reusable():
    grid = compile_expression("((m + 3) // 4)")
    assert [grid({"m": m}) for m in (1, 4, 5, 16)] == [1, 1, 2, 4]
    assert expression_names("max(m, n) // 4 + min(k, 2)") == {"m", "n", "k"}


# ------------------------------------------------------------------------------------- cubin ELF reader


def test_cubin_arch_rejects_non_cubins():
    with pytest.raises(CubinError, match="expected an ELF"):
        cubin_arch(b"not an elf file at all, certainly not a cubin" * 2)
    x86 = bytearray(64)
    x86[:6] = b"\x7fELF\x02\x01"
    x86[18] = 62  # EM_X86_64
    with pytest.raises(CubinError, match="EM_CUDA"):
        cubin_arch(bytes(x86))


def test_cubin_arch_reads_legacy_abi_flags():
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    header[8] = 7  # CUDA ELF ABI v1: SM in the low byte, 0x800 = arch-specific
    header[18] = 190
    header[48:52] = (0x5A | 0x400 | 0x800).to_bytes(4, "little")
    assert cubin_arch(bytes(header)) == "sm_90a"
    header[48:52] = (0x50 | 0x400).to_bytes(4, "little")
    assert cubin_arch(bytes(header)) == "sm_80"


# -------------------------------------------------------------------------------- lowering (needs TVM)

ROWS = (1, 33)
ARCHS = tuple(t.arch for t in TARGETS.values())


def _two_stage():
    """rmsnorm with the sum of squares and the scale pass in two kernels: a host workspace + dyn smem."""
    from tvm import s_tir

    from dflash_compiler.schedules import RMSNormSpec, rmsnorm_func

    sch = s_tir.Schedule(rmsnorm_func(RMSNormSpec(hidden=4096, eps=1e-6, name="two_stage")))
    ss, y = sch.get_sblock("ss"), sch.get_sblock("y")
    i, k = sch.get_loops(ss)
    sch.bind(i, "blockIdx.x")
    sch.bind(sch.split(k, [None, 128])[1], "threadIdx.x")
    outer, inner = sch.split(sch.fuse(*sch.get_loops(y)), [None, 256])
    sch.bind(outer, "blockIdx.x")
    sch.bind(inner, "threadIdx.x")
    w_cache = sch.cache_read(y, [r.source.name for r in sch.get(y).reads].index("w"), "shared.dyn")
    sch.compute_at(w_cache, outer)
    sch.bind(sch.split(sch.get_loops(w_cache)[-1], [None, 256])[1], "threadIdx.x")
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


@pytest.fixture(scope="module")
def lowered():
    """(CudaModule, IR after SplitHostDevice) of one module: 4 rmsnorm kernels + the two-stage func."""
    tvm = pytest.importorskip("tvm")
    from dflash_compiler.codegen import lower_with_ir
    from dflash_compiler.schedules import RMSNormRule, RMSNormSpec

    rule = RMSNormRule()
    specs = [RMSNormSpec(hidden=h, eps=1e-6, residual=r) for h, r in ((64, False), (4096, False), (4096, True))]
    specs.append(RMSNormSpec(hidden=1001, eps=1e-5, residual=True))
    funcs = {k.name: k.func for k in (rule.apply(s, SM90) for s in specs)}
    funcs["two_stage"] = _two_stage()
    return lower_with_ir(tvm.IRModule(funcs), SM90)


@pytest.fixture(scope="module")
def cubins(lowered):
    from dflash_compiler.nvrtc import compile_cubin

    return {arch: compile_cubin(lowered[0].source, arch) for arch in ARCHS}


def _device_launch_extents(device_func) -> dict[str, object]:
    import tvm_ffi
    from tvm import tirx

    extents: dict[str, object] = {}

    def on_attr(attr) -> None:
        if attr.attr_key == "thread_extent":
            extents[str(attr.node.thread_tag)] = attr.value

    tvm_ffi.structural_walk(device_func.body, [(tirx.AttrStmt, on_attr)], order="pre")
    return extents


def _source_signatures(source: str) -> dict[str, tuple[int, list[str]]]:
    """kernel name -> (__launch_bounds__, parameter names) from the definitions in the CUDA source."""
    found = {}
    pattern = r'extern "C" __global__ void __launch_bounds__\((\d+)\) (\w+)\(([^)]*)\) \{'
    for bounds, name, params in re.findall(pattern, source):
        found[name] = (int(bounds), [p.split()[-1].lstrip("*") for p in params.split(",")])
    return found


def test_kernel_table_names_and_order(lowered):
    cuda, _ = lowered
    assert set(cuda.functions) == {
        "rmsnorm_h64",
        "rmsnorm_h4096",
        "rmsnorm_residual_h4096",
        "rmsnorm_residual_h1001",
        "two_stage",
    }
    for name, func in cuda.functions.items():
        expected = [f"{name}_kernel"] + [f"{name}_kernel_{i}" for i in range(1, len(func.kernels))]
        assert [k.name for k in func.kernels] == expected
        assert func.variables == ("m",)
    assert len(cuda.functions["two_stage"].kernels) == 2
    assert len(cuda.source_sha256) == 64


def test_params_follow_the_device_abi_and_the_source(lowered):
    cuda, split = lowered
    signatures = _source_signatures(cuda.source)
    for func in cuda.functions.values():
        buffers = {p.name for p in func.params} | {w.name for w in func.workspaces}
        for kernel in func.kernels:
            names = [p.name for p in kernel.params]
            assert names == [p.name for p in split[kernel.name].params]  # TVM's order, not the PrimFunc's
            assert names == signatures[kernel.name][1]
            for p in kernel.params:
                if p.kind == "ptr":
                    assert p.source in buffers
                else:
                    assert expression_names(p.source) <= set(func.variables)
    plain = cuda.functions["rmsnorm_h4096"]
    assert [(p.name, p.kind, p.dtype, p.source) for p in plain.kernels[0].params] == [
        ("w_ptr", "ptr", "bfloat16", "w"),
        ("x_ptr", "ptr", "bfloat16", "x"),
        ("y_ptr", "ptr", "bfloat16", "y"),
        ("m", "scalar", "int32", "m"),
    ]
    assert [(p.name, p.kind, p.shape) for p in plain.params] == [
        ("x", "buffer", ("m", "4096")),
        ("w", "buffer", ("4096",)),
        ("y", "buffer", ("m", "4096")),
    ]


@pytest.mark.parametrize("rows", ROWS)
def test_launch_dims_match_tvm_launch_threads(lowered, rows):
    """Grid/block from the host call site, evaluated, equal the device kernel's own launch_thread extents."""
    from dflash_compiler.codegen import _ExprConverter

    cuda, split = lowered
    signatures = _source_signatures(cuda.source)
    env = {"m": rows}
    for func in cuda.functions.values():
        for kernel in func.kernels:
            grid, block, smem = kernel.launch_dims(env)
            device_env = {p.name: evaluate(p.source, env) for p in kernel.params if p.kind == "scalar"}
            extents = _device_launch_extents(split[kernel.name])
            for tag, value in extents.items():
                dims = grid if tag.startswith("blockIdx") else block
                assert dims["xyz".index(tag[-1])] == evaluate(_ExprConverter([])(value), device_env), tag
            launched = {f"blockIdx.{a}" for a, g in zip("xyz", grid, strict=True) if g != 1}
            launched |= {f"threadIdx.{a}" for a, b in zip("xyz", block, strict=True) if b != 1}
            assert launched <= set(extents)
            assert block[0] * block[1] * block[2] == signatures[kernel.name][0]  # __launch_bounds__
            assert smem >= 0
    grid, block, _ = cuda.functions["rmsnorm_h4096"].kernels[0].launch_dims(env)
    assert grid == (rows, 1, 1) and block == (512, 1, 1)


def test_workspaces_and_dynamic_shared_memory(lowered):
    cuda, _ = lowered
    two = cuda.functions["two_stage"]
    assert [(w.name, w.dtype, w.shape) for w in two.workspaces] == [("ss", "float32", ("m",))]
    first, second = two.kernels
    assert "ss" in {p.source for p in first.params} and "ss" in {p.source for p in second.params}
    assert second.launch_tags[-1] == "tirx.use_dyn_shared_memory"
    assert second.launch_dims({"m": 33}) == ((33 * 16, 1, 1), (256, 1, 1), 4096 * 2 // 16)
    assert first.dynamic_smem == "0"


def test_kernel_table_round_trips_through_json(lowered):
    cuda, _ = lowered
    assert CudaModule.model_validate_json(cuda.model_dump_json()) == cuda


def test_unscheduled_func_is_refused_with_a_hint():
    tvm = pytest.importorskip("tvm")
    from dflash_compiler.codegen import lower_to_cuda
    from dflash_compiler.schedules import RMSNormSpec, rmsnorm_func

    func = rmsnorm_func(RMSNormSpec(hidden=64, eps=1e-6))
    with pytest.raises(CodegenError, match="must be scheduled for CUDA"):
        lower_to_cuda(tvm.IRModule({"rmsnorm_h64": func}), SM90)
    with pytest.raises(CodegenError, match=r"expected a tvm\.IRModule"):
        lower_to_cuda(func, SM90)


def test_module_keys_must_be_global_symbols():
    tvm = pytest.importorskip("tvm")
    from dflash_compiler.codegen import lower_to_cuda
    from dflash_compiler.schedules import RMSNormRule, RMSNormSpec

    kernel = RMSNormRule().apply(RMSNormSpec(hidden=64, eps=1e-6), SM90)
    with pytest.raises(CodegenError, match="key each PrimFunc by its global_symbol"):
        lower_to_cuda(tvm.IRModule({"other_name": kernel.func}), SM90)


def test_truncating_division_is_exact_for_negative_values():
    pytest.importorskip("tvm")
    from tvm import tirx

    from dflash_compiler.codegen import _ExprConverter

    a, b = tirx.Var("a", "int32"), tirx.Var("b", "int32")
    div, mod = _ExprConverter([])(tirx.truncdiv(a, b)), _ExprConverter([])(tirx.truncmod(a, b))
    for x, y in [(7, 2), (-7, 2), (7, -2), (-7, -2), (0, 3), (6, 3), (-6, 3)]:
        q = abs(x) // abs(y) * (1 if (x >= 0) == (y > 0) else -1)
        assert evaluate(div, {"a": x, "b": y}) == q
        assert evaluate(mod, {"a": x, "b": y}) == x - y * q


def test_integer_and_bool_casts_convert():
    pytest.importorskip("tvm")
    from tvm import tirx

    from dflash_compiler.codegen import CodegenError, _ExprConverter

    m = tirx.Var("m", "int32")
    conv = _ExprConverter([])
    widened = conv(tirx.Cast("int64", m * 3))
    flag = conv(tirx.Cast("int32", m < 5) + 1)
    for value in (0, 4, 5, 9):
        assert evaluate(widened, {"m": value}) == value * 3
        assert evaluate(flag, {"m": value}) == (2 if value < 5 else 1)
    with pytest.raises(CodegenError, match="cannot express Cast"):
        conv(tirx.Cast("float32", m))


# ------------------------------------------------------------------------------------ NVRTC (needs TVM)


@pytest.mark.parametrize("arch", ARCHS)
def test_cubin_holds_code_for_its_arch(lowered, cubins, arch):
    cubin = cubins[arch]
    assert cubin_arch(cubin) == arch
    for name in lowered[0].kernel_names():
        assert name.encode() + b"\0" in cubin


def _cuobjdump() -> str | None:
    try:
        import cuda.pathfinder as pf
    except ImportError:
        return shutil.which("cuobjdump")
    return pf.find_nvidia_binary_utility("cuobjdump") or shutil.which("cuobjdump")


def _list_elf(tool: str, cubin: bytes, path: Path) -> str:
    path.write_bytes(cubin)
    out = subprocess.run([tool, "--list-elf", str(path)], capture_output=True, text=True, check=True).stdout
    (arch,) = re.findall(r"ELF file\s+1: .*\.(sm_\w+)\.cubin", out)
    return arch


def test_elf_reading_agrees_with_cuobjdump(cubins, tmp_path):
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    for arch, cubin in cubins.items():
        assert _list_elf(tool, cubin, tmp_path / "k.cubin") == cubin_arch(cubin) == arch
    # The `a` of sm_XXa lives in .nv.compat (attribute 0x09): clearing it must flip both readers.
    patched = bytearray(cubins["sm_120a"])
    at = patched.index(bytes.fromhex("02090100"))
    patched[at + 2] = 0
    assert _list_elf(tool, bytes(patched), tmp_path / "p.cubin") == cubin_arch(bytes(patched)) == "sm_120"


def test_nvrtc_errors_carry_the_log():
    pytest.importorskip("cuda.bindings.nvrtc")
    from dflash_compiler.nvrtc import compile_cubin

    source = 'extern "C" __global__ void broken(float* x) { x[0] = undefined_symbol_42; }'
    with pytest.raises(CodegenError, match="undefined_symbol_42") as err:
        compile_cubin(source, "sm_90a")
    assert "--gpu-architecture=sm_90a" in str(err.value)
    assert "--use_fast_math" not in str(err.value)
    with pytest.raises(CodegenError, match="cannot build sm_30"):
        compile_cubin(source, "sm_30")
    with pytest.raises(CodegenError, match="expected 'sm_<number>'"):
        compile_cubin(source, "compute_90a")


def test_serialised_warpgroup_mmas_are_refused():
    """ptxas keeps a wgmma that the kernel reads before its wait correct by serialising the pipeline, which
    would silently slow every GEMM on it: the build refuses such a cubin and says why."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from dflash_compiler.nvrtc import compile_cubin
    from dflash_compiler.wgmma import COMMIT, FENCE, PRELUDE, mma_function, mma_name, wait_name

    def kernel(touch_in_flight: str) -> str:
        return (
            PRELUDE
            + mma_function(64)
            + f"""
extern "C" __global__ void __launch_bounds__(128) k(float* out) {{
  extern __shared__ __align__(1024) unsigned char tiles[];
  float acc[32];
  for (int i = 0; i < 32; ++i) acc[i] = 0.f;
  for (int step = 0; step < 4; ++step) {{
    {FENCE}();
    {mma_name(64)}(acc, tiles, tiles + 8192);
    {COMMIT}();
    {touch_in_flight}
  }}
  {wait_name(64)}(acc);
  for (int i = 0; i < 32; ++i) out[threadIdx.x * 32 + i] = acc[i];
}}
"""
        )

    assert compile_cubin(kernel(""), "sm_90a")
    with pytest.raises(CodegenError, match="serialised the warpgroup MMAs") as err:
        compile_cubin(kernel("acc[step] += 1.0f;"), "sm_90a")
    assert "wgmma" in str(err.value) and "Fix: touch the accumulators only" in str(err.value)


def test_fast_math_is_opt_in():
    pytest.importorskip("cuda.bindings.nvrtc")
    from dflash_compiler.nvrtc import compile_cubin

    source = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] = expf(x[threadIdx.x]); }'
    with pytest.raises(CodegenError, match="--use_fast_math"):
        compile_cubin(source + "\n#error stop\n", "sm_121a", fast_math=True)
    assert cubin_arch(compile_cubin(source, "sm_121a", fast_math=True)) == "sm_121a"
