"""Build side of the kernel table: scheduled TVM IRModule → CUDA C + kernel table, on a machine without a GPU.

`lower_to_cuda` runs TVM's pipeline and CUDA codegen and reads the IR right after `tirx.SplitHostDevice`:
there every host function is a list of `call_ffi_kernel` calls that name the kernels in launch order, pass
their arguments in the kernel's ABI order and give the launch extents. The kernel table is taken from that
IR, never written by hand (TVM reorders kernel parameters: pointers first, sorted by name, then scalars;
CSE adds derived scalars such as `(m + 3) // 4`).

The rest of the build lives beside it: NVRTC in ``nvrtc.py``, the cubin ELF check in ``cubin.py``, and the
evaluator of the table's expression strings in ``runtime/expr.py`` (shared with the runtime). TVM is
imported inside the functions that need it: the table's models are read on the deploy side, which has no TVM.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

from dflash_compiler.cluster import PRELUDE as CLUSTER_PRELUDE
from dflash_compiler.cluster import add_cluster_dims, cluster_dims
from dflash_compiler.dependent_launch import add_dependent_launch
from dflash_compiler.errors import DFlashError
from dflash_compiler.fast_exp2 import PRELUDE as EXP2_PRELUDE
from dflash_compiler.fp8_convert import PRELUDE as FP8_PRELUDE
from dflash_compiler.mbarrier import PRELUDE as MBARRIER_PRELUDE
from dflash_compiler.runtime.expr import evaluate, expression_names
from dflash_compiler.wgmma import PRELUDE as WGMMA_PRELUDE
from dflash_compiler.wgmma import needed_prelude as wgmma_functions

# ------------------------------------------------------------------------------------------------ errors


class CodegenError(DFlashError):
    """Lowering, NVRTC or a cubin check failed; the message says what was expected and how to fix it."""


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


NO_CLUSTER = (1, 1, 1)


class KernelLaunch(_Frozen):
    """One `cuLaunchKernel` of a host function: name, parameters and launch extents as expressions.

    `when` is the host code's condition around the launch (e.g. `(m <= 32)` where a PrimFunc picks one of
    two kernels by its row count), "1" for a launch that always runs.
    """

    name: str
    params: tuple[KernelParam, ...]
    launch_tags: tuple[str, ...]
    grid: tuple[str, str, str]
    block: tuple[str, str, str]
    dynamic_smem: str
    when: str = "1"
    cluster: tuple[int, int, int] = NO_CLUSTER  # compile-time cluster shape (dflash_compiler.cluster)

    @model_serializer(mode="wrap")
    def _leave_out_no_cluster(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # a launch without a cluster serializes as before the field existed: the manifests (and digests) of
        # artifacts built earlier still verify, and builds without clusters are byte-identical
        data = handler(self)
        if tuple(self.cluster) == NO_CLUSTER:
            data.pop("cluster", None)
        return data

    def runs(self, env: Mapping[str, int]) -> bool:
        """Whether the host function launches this kernel for the given symbolic values."""
        return bool(evaluate(self.when, env))

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
    """A buffer TVM allocates on the host side between two kernels; the runtime must provide it, zero-filled
    when allocated (a kernel may keep counts there that it returns to zero itself)."""

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

    def launches(self, env: Mapping[str, int]) -> list[KernelLaunch]:
        """The kernels a call with these symbolic values launches, in order (those whose `when` holds)."""
        return [k for k in self.kernels if k.runs(env)]


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
    kernels = add_dependent_launch(imports[0].inspect_source())
    clusters = cluster_dims(kernels)
    kernels = add_cluster_dims(kernels, clusters)
    preludes = FP8_PRELUDE + EXP2_PRELUDE + WGMMA_PRELUDE + MBARRIER_PRELUDE + (CLUSTER_PRELUDE if clusters else "")
    source = preludes + wgmma_functions(kernels) + kernels
    functions = {name: _with_clusters(f, clusters) for name, f in _kernel_table(capture.mod).items()}
    missing = [n for n in names if n not in functions]
    if missing:
        raise CodegenError(
            f"no kernel launch found for {', '.join(missing)} after {_SPLIT_PASS}; expected every PrimFunc to "
            "launch at least one CUDA kernel. Fix: bind its loops to blockIdx/threadIdx"
        )
    return CudaModule(source=source, functions=functions), capture.mod


def _with_clusters(function: HostFunction, clusters: Mapping[str, tuple[int, int, int]]) -> HostFunction:
    """`function` with each kernel's compile-time cluster shape (`cluster.cluster_dims` of the source)."""
    kernels = tuple(k.model_copy(update={"cluster": clusters.get(k.name, k.cluster)}) for k in function.kernels)
    return function.model_copy(update={"kernels": kernels})


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


def _workspace(buffer: Any, conv: _ExprConverter) -> Workspace:
    """A host-side allocation as the runtime makes it: in scalar elements. TVM's storage rewrite retypes an
    allocation whose every access is one vector type (float32x4 where both kernels move 16 bytes at a time)
    and divides its extent by the lanes; the lanes go back into the last dimension."""
    shape = [conv(d) for d in buffer.shape]
    lanes = buffer.dtype.lanes
    if lanes > 1:
        shape[-1] = f"({shape[-1]} * {lanes})"
    return Workspace(name=buffer.name, dtype=str(buffer.dtype.with_lanes(1)), shape=tuple(shape))


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
        conditions = _launch_conditions(func.body, calls, conv)
        kernels = tuple(
            _kernel_launch(split, func, call, conv, decls, cond) for call, cond in zip(calls, conditions, strict=True)
        )
        if not kernels:
            continue
        params = tuple(_func_param(p, conv) for p in func.params)
        workspaces = tuple(_workspace(b, conv) for b in allocs)
        exprs = [e for k in kernels for e in (*k.grid, *k.block, k.dynamic_smem, k.when)]
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


def _launch_conditions(body: Any, calls: list[Any], conv: _ExprConverter) -> list[str]:
    """Per kernel call (in `calls` order) the conjunction of the host `if` branches it sits in, "1" for none."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    if not calls:
        return []
    branches: list[tuple[Any, Any]] = []  # (condition as seen from the branch, branch body)

    def on_if(node: Any) -> None:
        branches.append((node.condition, node.then_case))
        if node.else_case is not None:
            branches.append((tirx.Not(node.condition), node.else_case))

    tvm_ffi.structural_walk(body, [(tirx.IfThenElse, on_if)], order="pre")
    inside: list[list[str]] = [[] for _ in calls]
    for condition, branch in branches:
        found: list[Any] = []
        tvm_ffi.structural_walk(
            branch,
            [(tvm.ir.expr.Call, lambda c, found=found: found.append(c) if c.op.same_as(calls[0].op) else None)],
            order="pre",
        )
        for i, call in enumerate(calls):
            if any(call.same_as(f) for f in found):
                inside[i].append(conv(condition))
    return [" and ".join(f"({c})" for c in conds) if conds else "1" for conds in inside]


def _kernel_launch(
    split: Any, func: Any, call: Any, conv: _ExprConverter, decls: list[tuple[Any, Any]], when: str = "1"
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
        when=when,
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
            src, dst = str(e.value.ty), str(e.ty)
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
