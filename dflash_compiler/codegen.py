"""Build: scheduled TVM IRModule → CUDA C + kernel table → cubin (NVRTC), on a machine without a GPU.

Four parts, each usable alone:

* `lower_to_cuda` runs TVM's pipeline and CUDA codegen and reads the IR right after
  `tirx.SplitHostDevice`: there every host function is a list of `call_ffi_kernel` calls that name the
  kernels in launch order, pass their arguments in the kernel's ABI order and give the launch extents.
  The kernel table is taken from that IR, never written by hand (TVM reorders kernel parameters: pointers
  first, sorted by name, then scalars; CSE adds derived scalars such as `(m + 3) // 4`).
* `compile_cubin` calls NVRTC through cuda-python with the CUDA headers found by cuda.pathfinder, so no
  toolkit, no environment variable and no TVM callback is involved; fast-math is off unless asked.
* `cubin_arch` reads the SM a cubin was built for from its ELF header (and `.nv.compat` for the `a`
  variant), so tests check what was built rather than what was asked for.
* `evaluate` / `compile_expression` evaluate the table's expression strings (grid, block, shared memory,
  scalar arguments) with an AST whitelist, never `eval`: the runtime reads them from a manifest file.

TVM and cuda-python are imported inside the functions that need them: the models, `cubin_arch` and the
evaluator are used on the deploy side, which has neither TVM nor NVRTC.
"""

from __future__ import annotations

import ast
import hashlib
import operator
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from dflash_compiler.errors import DFlashError

# ------------------------------------------------------------------------------------------------ errors


class CodegenError(DFlashError):
    """Lowering, NVRTC or a cubin check failed; the message says what was expected and how to fix it."""


class UnsafeExpressionError(DFlashError):
    """A kernel-table expression uses something outside the evaluator's whitelist."""


# ------------------------------------------------------------------------------------------ kernel table


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class KernelParam(_Frozen):
    """One kernel parameter in ABI order and where its value comes from.

    `source` is the host buffer whose device pointer is passed (`kind == "ptr"`: a parameter of the
    PrimFunc or a workspace), or an integer expression over the symbolic variables (`kind == "scalar"`).
    """

    name: str
    kind: Literal["ptr", "scalar"]
    dtype: str
    source: str


class KernelLaunch(_Frozen):
    """One `cuLaunchKernel` of a host function: name, parameters and launch extents as expressions."""

    name: str
    params: tuple[KernelParam, ...]
    launch_tags: tuple[str, ...]
    grid: tuple[str, str, str]
    block: tuple[str, str, str]
    dynamic_smem: str

    def launch_dims(self, env: Mapping[str, int]) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
        """(grid, block, dynamic shared-memory bytes) for the given symbolic values, e.g. `{"m": 7}`."""
        grid = (evaluate(self.grid[0], env), evaluate(self.grid[1], env), evaluate(self.grid[2], env))
        block = (evaluate(self.block[0], env), evaluate(self.block[1], env), evaluate(self.block[2], env))
        return grid, block, evaluate(self.dynamic_smem, env)


class FuncParam(_Frozen):
    """A parameter of the host function (the PrimFunc): a buffer with its shape, or a scalar."""

    name: str
    kind: Literal["buffer", "scalar"]
    dtype: str
    shape: tuple[str, ...] = ()


class Workspace(_Frozen):
    """A buffer TVM allocates on the host side between two kernels; the runtime must provide it."""

    name: str
    dtype: str
    shape: tuple[str, ...]


class HostFunction(_Frozen):
    """One PrimFunc of the module: its parameters, kernels in launch order and workspaces.

    `variables` are the free names the expressions use: symbolic shape variables and scalar parameters.
    """

    name: str
    params: tuple[FuncParam, ...]
    kernels: tuple[KernelLaunch, ...]
    workspaces: tuple[Workspace, ...]
    variables: tuple[str, ...]


class CudaModule(_Frozen):
    """The CUDA source of a whole IRModule and its kernel table (one entry per PrimFunc)."""

    source: str
    functions: dict[str, HostFunction]

    @property
    def source_sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    def kernel_names(self) -> list[str]:
        return [k.name for f in self.functions.values() for k in f.kernels]


# --------------------------------------------------------------------------------------- TVM → CUDA C

_SPLIT_PASS = "tirx.SplitHostDevice"
_DYN_SMEM_TAG = "tirx.use_dyn_shared_memory"
_CALL_KERNEL = "tirx.call_ffi_kernel"
_DEVICE_KERNEL_LAUNCH = 2  # CallingConv::kDeviceKernelLaunch


def lower_to_cuda(mod: Any, target: Any) -> CudaModule:
    """CUDA source and kernel table of a scheduled IRModule (`target`: a `Target` record or a TVM target)."""
    return lower_with_ir(mod, target)[0]


def lower_with_ir(mod: Any, target: Any) -> tuple[CudaModule, Any]:
    """`lower_to_cuda`, plus the IRModule right after `tirx.SplitHostDevice` (tests compare the two)."""
    import tvm

    tvm_target = target.tvm_target() if hasattr(target, "tvm_target") else target
    if not isinstance(mod, tvm.IRModule):
        raise CodegenError(f"lower_to_cuda: expected a tvm.IRModule, found {type(mod).__name__}; wrap PrimFuncs in one")
    names = []
    for gv, func in mod.functions.items():
        symbol = func.attrs.get("global_symbol") if func.attrs is not None else None
        if symbol is not None and str(symbol) != gv.name_hint:
            raise CodegenError(
                f"IRModule key {gv.name_hint!r} differs from the PrimFunc's global_symbol {str(symbol)!r}: the "
                "kernel table is keyed by the former and kernels are named after the latter. "
                "Fix: key each PrimFunc by its global_symbol"
            )
        names.append(gv.name_hint)
    capture = _make_capture(tvm)
    try:
        with tvm.transform.PassContext(instruments=[capture]):
            executable = tvm.compile(mod, target=tvm_target)
    except Exception as exc:
        raise CodegenError(
            f"TVM could not lower the module for {tvm_target.attrs.get('arch', '?')}: {exc}\n"
            "Fix: every PrimFunc must be scheduled for CUDA (threads bound, intermediates in local/shared "
            "scope) before codegen; build the unscheduled PrimFunc for llvm only."
        ) from exc
    if capture.mod is None:
        raise CodegenError(f"TVM's pipeline did not run {_SPLIT_PASS}; the kernel table cannot be read")
    imports = executable.mod.imports
    if not imports:
        raise CodegenError("TVM produced no device module: the IRModule holds no kernel")
    source = imports[0].inspect_source()
    functions = _kernel_table(capture.mod)
    missing = [n for n in names if n not in functions]
    if missing:
        raise CodegenError(
            f"no kernel launch found for {', '.join(missing)} after {_SPLIT_PASS}; expected every PrimFunc to "
            "launch at least one CUDA kernel. Fix: bind its loops to blockIdx/threadIdx"
        )
    return CudaModule(source=source, functions=functions), capture.mod


def _make_capture(tvm: Any) -> Any:
    @tvm.ir.instrument.pass_instrument
    class _Capture:
        """Keeps the module as it is after SplitHostDevice (host code calling kernels, launch extents)."""

        def __init__(self) -> None:
            self.mod = None

        def run_after_pass(self, mod: Any, info: Any) -> None:
            if info.name == _SPLIT_PASS:
                self.mod = mod

    return _Capture()


def _kernel_table(split: Any) -> dict[str, HostFunction]:
    import tvm
    import tvm_ffi
    from tvm import tirx

    table: dict[str, HostFunction] = {}
    for gv, func in split.functions.items():
        if int(func.attrs.get("calling_conv", 0)) == _DEVICE_KERNEL_LAUNCH:
            continue
        lets: list[tuple[Any, Any]] = []
        calls: list[Any] = []
        decls: list[tuple[Any, Any]] = []
        allocs: list[Any] = []

        def on_call(call: Any, calls: list[Any] = calls) -> None:
            if isinstance(call.op, tvm.ir.Op) and call.op.name == _CALL_KERNEL:
                calls.append(call)

        tvm_ffi.structural_walk(
            func.body,
            [
                (tirx.Bind, lambda b, lets=lets: lets.append((b.var, b.value))),
                (tirx.DeclBuffer, lambda d, decls=decls: decls.append((d.buffer, d.data))),
                (tirx.AllocBuffer, lambda a, allocs=allocs: allocs.append(a.buffer)),
                (tvm.ir.expr.Call, on_call),
            ],
            order="pre",
        )
        conv = _ExprConverter(lets)
        kernels = tuple(_kernel_launch(split, func, call, conv, decls) for call in calls)
        if not kernels:
            continue
        params = tuple(_func_param(p, conv) for p in func.params)
        workspaces = tuple(
            Workspace(name=b.name, dtype=str(b.dtype), shape=tuple(conv(d) for d in b.shape)) for b in allocs
        )
        exprs = [e for k in kernels for e in (*k.grid, *k.block, k.dynamic_smem)]
        exprs += [p.source for k in kernels for p in k.params if p.kind == "scalar"]
        exprs += [d for p in params for d in p.shape] + [d for w in workspaces for d in w.shape]
        variables = sorted({n for e in exprs for n in expression_names(e)})
        table[gv.name_hint] = HostFunction(
            name=gv.name_hint, params=params, kernels=kernels, workspaces=workspaces, variables=tuple(variables)
        )
    return table


def _func_param(param: Any, conv: _ExprConverter) -> FuncParam:
    from tvm import tirx

    if tirx.is_buffer_var(param):
        return FuncParam(
            name=param.name, kind="buffer", dtype=str(param.dtype), shape=tuple(conv(d) for d in param.shape)
        )
    return FuncParam(name=param.name, kind="scalar", dtype=str(param.ty.dtype))


def _kernel_launch(
    split: Any, func: Any, call: Any, conv: _ExprConverter, decls: list[tuple[Any, Any]]
) -> KernelLaunch:
    import tvm

    name = str(call.args[0].value)
    device = split[name]
    n = len(device.params)
    operands, values = list(call.args[1 : 1 + n]), list(call.args[1 + n :])
    params = []
    for p, arg in zip(device.params, operands, strict=True):
        if isinstance(p.ty, tvm.ir.PointerType):
            params.append(
                KernelParam(name=p.name, kind="ptr", dtype=str(p.ty.element_type.dtype), source=_root(arg, func, decls))
            )
        else:
            params.append(KernelParam(name=p.name, kind="scalar", dtype=str(p.ty.dtype), source=conv(arg)))
    tags = tuple(str(t) for t in call.attrs.launch_params)
    grid, block = ["1", "1", "1"], ["1", "1", "1"]
    it = iter(values)
    for tag in tags:
        if tag == _DYN_SMEM_TAG:
            continue
        value = conv(next(it))
        if tag.startswith("blockIdx."):
            grid["xyz".index(tag[-1])] = value
        elif tag.startswith("threadIdx."):
            block["xyz".index(tag[-1])] = value
        else:
            raise CodegenError(f"kernel {name}: launch parameter {tag!r} is not blockIdx/threadIdx/dynamic smem")
    smem = conv(next(it)) if _DYN_SMEM_TAG in tags else "0"
    return KernelLaunch(
        name=name,
        params=tuple(params),
        launch_tags=tags,
        grid=(grid[0], grid[1], grid[2]),
        block=(block[0], block[1], block[2]),
        dynamic_smem=smem,
    )


def _root(arg: Any, func: Any, decls: list[tuple[Any, Any]]) -> str:
    """The host buffer behind a kernel pointer argument (through `buffer_data` and DeclBuffer views)."""
    import tvm

    node = arg
    for _ in range(32):
        if isinstance(node, tvm.ir.expr.Call) and node.op.name == "tirx.buffer_data":
            node = node.args[0]
        if any(node.same_as(p) for p in func.params):
            return str(node.name)
        nxt = next((data for buf, data in decls if buf.same_as(node)), None)
        if nxt is None:
            return str(node.name)  # a host workspace (AllocBuffer) or a plain pointer var
        node = nxt
    raise CodegenError(f"could not trace kernel argument {arg} to a buffer (view chain deeper than 32)")


class _ExprConverter:
    """TIR integer expression → a string in the evaluator's language (let-bound vars substituted)."""

    def __init__(self, lets: Sequence[tuple[Any, Any]]) -> None:
        self.lets = list(lets)

    def __call__(self, e: Any) -> str:
        return self.conv(e)

    def conv(self, e: Any) -> str:
        from tvm.ir.prim import expr as E

        if isinstance(e, bool | int):
            return str(int(e))
        if isinstance(e, E.IntImm):
            return str(int(e.value))
        if isinstance(e, E.Var):
            for var, value in self.lets:
                if var.same_as(e):
                    return f"({self.conv(value)})"
            return str(e.name)
        binary = _BINARY.get(type(e).__name__)
        if binary is not None:
            return f"({self.conv(e.a)} {binary} {self.conv(e.b)})"
        if isinstance(e, E.Min | E.Max):
            return f"{type(e).__name__.lower()}({self.conv(e.a)}, {self.conv(e.b)})"
        if isinstance(e, E.Div | E.Mod):  # C truncation; written with floor ops so negative values stay exact
            a, b = self.conv(e.a), self.conv(e.b)
            trunc_div = f"({a} // {b} if {a} * {b} >= 0 else -(-{a} // {b}))"
            return trunc_div if isinstance(e, E.Div) else f"({a} - {b} * {trunc_div})"
        if isinstance(e, E.Not):
            return f"(not {self.conv(e.a)})"
        if isinstance(e, E.Select):
            return f"({self.conv(e.true_value)} if {self.conv(e.condition)} else {self.conv(e.false_value)})"
        if isinstance(e, E.Cast):
            src, dst = str(e.value.dtype), str(e.dtype)
            if dst.startswith(("int", "uint")) and src.startswith(("int", "uint")):
                return self.conv(e.value)
            if dst.startswith(("int", "uint")) and src == "bool":
                return f"(1 if {self.conv(e.value)} else 0)"
        raise CodegenError(
            f"cannot express {type(e).__name__} `{e}` in the kernel table (integer + - * // % min max, "
            "comparisons and conditionals only). Fix: keep launch extents and scalar arguments integer "
            "expressions of the symbolic dims"
        )


_BINARY = {
    "Add": "+",
    "Sub": "-",
    "Mul": "*",
    "FloorDiv": "//",
    "FloorMod": "%",
    "LT": "<",
    "LE": "<=",
    "GT": ">",
    "GE": ">=",
    "EQ": "==",
    "NE": "!=",
    "And": "and",
    "Or": "or",
}

# ------------------------------------------------------------------------------------ CUDA C → cubin

# What TVM's own nvcc/NVRTC call sets besides fast-math: TVM's headers use bf16/half operators.
_NVRTC_BASE_OPTIONS = (
    "-default-device",
    "-std=c++17",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
)


def cuda_include_dirs() -> list[str]:
    """CCCL (`cuda/std/cstdint`) and cudart (`cuda_bf16.h`, `cuda_fp8.h`) header folders for NVRTC.

    cuda.pathfinder finds them in the nvidia-cuda-cccl / nvidia-cuda-runtime wheels or a CUDA toolkit.
    """
    import cuda.pathfinder as pf

    dirs = []
    for lib, wheel in (("cccl", "nvidia-cuda-cccl"), ("cudart", "nvidia-cuda-runtime")):
        found = pf.find_nvidia_header_directory(lib)
        if found is None:
            raise CodegenError(
                f"NVRTC needs the {lib} headers and cuda.pathfinder found none. "
                f"Fix: pip install {wheel} (the 'compile' extra) or install a CUDA toolkit"
            )
        dirs.append(str(found))
    return dirs


def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    _check_nvrtc(err, "nvrtcVersion")
    return int(major), int(minor)


def nvrtc_supported_archs() -> list[int]:
    """SM numbers this NVRTC can build for, e.g. [75, 80, ..., 120, 121]."""
    from cuda.bindings import nvrtc

    err, archs = nvrtc.nvrtcGetSupportedArchs()
    _check_nvrtc(err, "nvrtcGetSupportedArchs")
    return [int(a) for a in archs]


def compile_cubin(
    source: str,
    arch: str,
    *,
    fast_math: bool = False,
    extra_options: Iterable[str] = (),
    name: str = "kernels.cu",
) -> bytes:
    """Compile CUDA C `source` to a cubin for `arch` (e.g. "sm_90a") with NVRTC.

    No GPU is needed. Fast-math is off by default (TVM's own path turns it on), so numerics match the
    CPU oracle as closely as the kernels' own arithmetic allows.
    """
    from cuda.bindings import nvrtc

    number = _arch_number(arch)
    supported = nvrtc_supported_archs()
    if number not in supported:
        raise CodegenError(
            f"NVRTC {'.'.join(map(str, nvrtc_version()))} cannot build {arch}: it supports sm_"
            f"{', sm_'.join(map(str, supported))}. Fix: install a newer nvidia-cuda-nvrtc"
        )
    options = [f"--gpu-architecture={arch}", *_NVRTC_BASE_OPTIONS]
    options += [f"-I{d}" for d in cuda_include_dirs()]
    if fast_math:
        options.append("--use_fast_math")
    options += list(extra_options)
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    _check_nvrtc(err, "nvrtcCreateProgram")
    try:
        encoded = [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)
        if int(err) != int(nvrtc.nvrtcResult.NVRTC_SUCCESS):
            log = _program_log(nvrtc, prog)
            raise CodegenError(
                f"NVRTC failed to compile {name} for {arch} ({err!r}). Options: {' '.join(options)}\n"
                f"NVRTC log (errors first):\n{_errors_first(log)}"
            )
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check_nvrtc(err, "nvrtcGetCUBINSize")
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check_nvrtc(err, "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    found = cubin_arch(cubin)
    if found != arch:
        raise CodegenError(f"NVRTC was asked for {arch} but the cubin's ELF header says {found}")
    return cubin


def _arch_number(arch: str) -> int:
    body = arch.removeprefix("sm_")
    digits = body.removesuffix("a")
    if not arch.startswith("sm_") or not digits.isdigit():
        raise CodegenError(f"cubin arch {arch!r}: expected 'sm_<number>' or 'sm_<number>a', e.g. 'sm_90a'")
    return int(digits)


def _program_log(nvrtc: Any, prog: Any) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if int(err) != 0 or size <= 1:
        return ""
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    return log.rstrip(b"\0").decode(errors="replace")


def _errors_first(log: str, limit: int = 12000) -> str:
    """The log with its `error` lines first: TVM's source gives NVRTC hundreds of deprecation warnings."""
    lines = log.splitlines()
    errors = [ln for ln in lines if " error" in ln or ln.startswith("error")]
    text = "\n".join([*errors, "--- full log ---", *lines]) if errors else log
    return text if len(text) <= limit else text[:limit] + "\n[... log truncated ...]"


def _check_nvrtc(err: Any, what: str) -> None:
    if int(err) != 0:
        raise CodegenError(f"{what} failed: {err!r}")


# ------------------------------------------------------------------------------------- cubin ELF check

_EM_CUDA = 190
_ELFABIVERSION_CUDA_V1 = 7  # SM in e_flags bits 0-7, `a` variant = EF_CUDA_ACCELERATORS_V1 (0x800)
_ELFABIVERSION_CUDA_V2 = 8  # CUDA 12.8+: SM in bits 8-15; `a` is recorded in .nv.compat
_EF_CUDA_ACCELERATORS_V1 = 0x800
_EF_CUDA_ACCELERATORS_V2 = 0x8
_NV_COMPAT_ARCH_SPECIFIC = 0x09  # .nv.compat attribute whose value 1 marks sm_XXa (what cuobjdump reads)


def cubin_arch(cubin: bytes) -> str:
    """The SM a cubin holds code for, e.g. "sm_90a", read from its ELF header.

    The SM number is in `e_flags` (its position depends on the CUDA ELF ABI version in `e_ident`). With
    ABI version 8 (CUDA 12.8 and later) the arch-specific `a` is not in `e_flags`; it is attribute 0x09 of
    the `.nv.compat` section, which is what `cuobjdump --list-elf` reads (patching that byte flips its
    answer). Family variants (`sm_120f`) read as the plain SM, as cuobjdump prints them.
    """
    data = bytes(cubin)
    if len(data) < 64 or data[:4] != b"\x7fELF":
        raise CodegenError(f"not a cubin: expected an ELF file (\\x7fELF), found {data[:4]!r} ({len(data)} bytes)")
    if data[4] != 2 or data[5] != 1:
        raise CodegenError(f"not a cubin: expected a 64-bit little-endian ELF, found class {data[4]} data {data[5]}")
    (machine,) = struct.unpack_from("<H", data, 18)
    if machine != _EM_CUDA:
        raise CodegenError(f"not a cubin: ELF e_machine is {machine}, expected {_EM_CUDA} (EM_CUDA)")
    (flags,) = struct.unpack_from("<I", data, 48)
    abi = data[8]
    if abi == _ELFABIVERSION_CUDA_V1:
        sm, arch_specific = flags & 0xFF, bool(flags & _EF_CUDA_ACCELERATORS_V1)
    elif abi == _ELFABIVERSION_CUDA_V2:
        sm = (flags >> 8) & 0xFF
        arch_specific = bool(flags & _EF_CUDA_ACCELERATORS_V2) or _nv_compat(data).get(_NV_COMPAT_ARCH_SPECIFIC) == 1
    else:
        raise CodegenError(
            f"cubin has CUDA ELF ABI version {abi}; expected {_ELFABIVERSION_CUDA_V1} or {_ELFABIVERSION_CUDA_V2}"
        )
    return f"sm_{sm}{'a' if arch_specific else ''}"


def _sections(data: bytes) -> dict[str, bytes]:
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff == 0 or shnum == 0 or shoff + shnum * shentsize > len(data):
        return {}
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_off = headers[shstrndx][4]
    out = {}
    for name_idx, sh_type, _flags, _addr, offset, size in headers:
        start = names_off + name_idx
        name = data[start : data.index(b"\0", start)].decode(errors="replace")
        out[name] = data[offset : offset + size] if sh_type != 8 else b""  # SHT_NOBITS holds no bytes
    return out


def _nv_compat(data: bytes) -> dict[int, int]:
    """Attributes of `.nv.compat`: 4-byte records (format, attribute, 16-bit value or size [+ payload])."""
    blob = _sections(data).get(".nv.compat", b"")
    attrs: dict[int, int] = {}
    pos = 0
    while pos + 4 <= len(blob):
        fmt, attr, value = blob[pos], blob[pos + 1], struct.unpack_from("<H", blob, pos + 2)[0]
        pos += 4
        if fmt == 4:  # EIFMT_SVAL: `value` bytes of payload follow
            pos += value
        elif fmt in (2, 3):  # EIFMT_BVAL / EIFMT_HVAL
            attrs[attr] = value
    return attrs


# ------------------------------------------------------------------------------------ safe evaluator

_BINOPS: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_CMPOPS: dict[type[ast.cmpop], Callable[[int, int], bool]] = {
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
}
_FUNCS: dict[str, Callable[..., int]] = {"min": min, "max": max}
_MAX_EXPRESSION_CHARS = 4096


def _validate(node: ast.AST, text: str) -> None:
    """Reject anything outside: ints, names, + - * // %, unary -, min/max calls, comparisons, and/or/not, if-else."""

    def bad(what: str) -> UnsafeExpressionError:
        return UnsafeExpressionError(
            f"kernel-table expression {text!r}: {what} is not allowed; expected integers, names, + - * // %, "
            "min(...)/max(...), comparisons, and/or/not and `a if c else b`. Fix: regenerate the kernel table"
        )

    for sub in ast.walk(node):
        if isinstance(sub, ast.Expression | ast.Load | ast.operator | ast.cmpop | ast.boolop | ast.unaryop):
            if isinstance(sub, ast.operator) and type(sub) not in _BINOPS:
                raise bad(f"operator {type(sub).__name__}")
            if isinstance(sub, ast.unaryop) and not isinstance(sub, ast.USub | ast.UAdd | ast.Not):
                raise bad(f"operator {type(sub).__name__}")
            continue
        if isinstance(sub, ast.Constant):
            if type(sub.value) is not int and type(sub.value) is not bool:
                raise bad(f"constant {sub.value!r}")
        elif isinstance(sub, ast.Call):
            if not isinstance(sub.func, ast.Name) or sub.func.id not in _FUNCS or sub.keywords or len(sub.args) < 2:
                raise bad("a call other than min(a, b, ...)/max(a, b, ...)")
        elif not isinstance(sub, ast.Name | ast.BinOp | ast.UnaryOp | ast.Compare | ast.BoolOp | ast.IfExp):
            raise bad(type(sub).__name__)


def _eval(node: ast.AST, env: Mapping[str, int], text: str) -> int:
    if isinstance(node, ast.Constant):
        return int(node.value)
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise UnsafeExpressionError(
                f"kernel-table expression {text!r} needs {node.id!r}, which was not given; "
                f"given: {', '.join(sorted(env)) or 'nothing'}. "
                "Fix: pass every symbolic value (see HostFunction.variables)"
            )
        value = env[node.id]
        if type(value) is not int and not hasattr(value, "__index__"):
            raise UnsafeExpressionError(f"{node.id}={value!r} for {text!r}: expected an integer")
        return operator.index(value)
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, env, text), _eval(node.right, env, text)
        if isinstance(node.op, ast.FloorDiv | ast.Mod) and right == 0:
            raise UnsafeExpressionError(f"kernel-table expression {text!r} divides by zero with {dict(env)}")
        return _BINOPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp):
        value = _eval(node.operand, env, text)
        if isinstance(node.op, ast.Not):
            return int(not value)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Compare):
        left = _eval(node.left, env, text)
        for op, comparator in zip(node.ops, node.comparators, strict=True):
            right = _eval(comparator, env, text)
            if not _CMPOPS[type(op)](left, right):
                return 0
            left = right
        return 1
    if isinstance(node, ast.BoolOp):
        if isinstance(node.op, ast.And):
            result = 1
            for v in node.values:
                result = _eval(v, env, text)
                if not result:
                    return result
            return result
        result = 0
        for v in node.values:
            result = _eval(v, env, text)
            if result:
                return result
        return result
    if isinstance(node, ast.IfExp):
        branch = node.body if _eval(node.test, env, text) else node.orelse
        return _eval(branch, env, text)
    if isinstance(node, ast.Call):
        assert isinstance(node.func, ast.Name)
        return _FUNCS[node.func.id](*(_eval(a, env, text) for a in node.args))
    raise UnsafeExpressionError(f"kernel-table expression {text!r}: {type(node).__name__} is not allowed")


def _parse(text: str) -> ast.Expression:
    if not isinstance(text, str):
        raise UnsafeExpressionError(f"kernel-table expression: expected a string, found {type(text).__name__}")
    if len(text) > _MAX_EXPRESSION_CHARS:
        raise UnsafeExpressionError(
            f"kernel-table expression of {len(text)} characters: expected at most {_MAX_EXPRESSION_CHARS}"
        )
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, RecursionError, ValueError) as exc:
        raise UnsafeExpressionError(f"kernel-table expression {text!r} does not parse: {exc}") from None
    _validate(tree, text)
    return tree


def compile_expression(text: str) -> Callable[[Mapping[str, int]], int]:
    """Validate `text` once; the returned function evaluates it for given symbolic values."""
    body = _parse(text).body

    def run(env: Mapping[str, int]) -> int:
        try:
            return _eval(body, env, text)
        except RecursionError:
            raise UnsafeExpressionError(f"kernel-table expression {text[:80]!r}...: nested too deeply") from None

    return run


def evaluate(text: str, env: Mapping[str, int] | None = None) -> int:
    """The integer value of a kernel-table expression such as "((m + 3) // 4)" for `env` (e.g. {"m": 5})."""
    return compile_expression(text)(env or {})


def expression_names(text: str) -> set[str]:
    """Free variable names an expression reads (min/max excluded)."""
    tree = _parse(text)
    calls = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in calls}
