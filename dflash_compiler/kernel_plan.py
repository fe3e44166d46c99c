"""Schedule an optimized graph: one kernel call per compute node, kernels shared between equal specs.

`schedule_graph(graph, target)` walks the graph in topological order, gives every compute node to the
rule list (`schedules.RULES`), and records a `KernelCall`: which kernel, which graph value (or sub-tensor of
one) feeds each kernel parameter, and which graph dim each kernel size variable equals. Equal specs (the
same layer shape in every layer) share one kernel, so a 36-layer model builds a handful of kernels.

The binding is derived, not declared: a parameter's shape is unified with the graph value's type, dim by
dim. A kernel int must equal the graph's int; a kernel variable takes the graph dim (an int or an
expression over the phase dims such as ``nb*(blk-1)``); one variable bound to two different dims, or a
kernel specialised to an int where the graph is symbolic, is an error that names the node.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from dflash_compiler.errors import DFlashError
from dflash_compiler.ir.graph import Graph, Ref, TensorType
from dflash_compiler.ir.ops import Op
from dflash_compiler.schedules import RULES
from dflash_compiler.schedules.base import Kernel, KernelSpec, OpInstance, Rule, no_rule_error
from dflash_compiler.targets import Target

# Graph-boundary ops need no kernel: inputs, weights and state are buffers, an output names a value.
_BOUNDARY = frozenset({Op.INPUT, Op.WEIGHT, Op.STATE, Op.OUTPUT})


class KernelPlanError(DFlashError):
    """A scheduled kernel does not fit the node it was chosen for."""


@dataclass(frozen=True)
class BufferView:
    """A graph value (`node` or `node:port`), or the sub-tensor `value[index...]` of it."""

    value: str
    index: tuple[int, ...] = ()

    def render(self) -> str:
        return self.value + (f"[{', '.join(map(str, self.index))}]" if self.index else "")


@dataclass(frozen=True)
class KernelCall:
    """One node's kernel: parameter → buffer, and size variable → graph dim (as text)."""

    node: str
    kernel: str
    buffers: tuple[tuple[str, BufferView], ...]
    sizes: tuple[tuple[str, str], ...]

    def render(self) -> str:
        args = ", ".join(f"{p}={v.render()}" for p, v in self.buffers)
        sizes = ", ".join(f"{k}={d}" for k, d in self.sizes)
        return f"{self.node}: {self.kernel}({args}) [{sizes}]"


@dataclass(frozen=True)
class KernelPlan:
    """The calls of one phase in launch order and the distinct kernels they use (by global symbol)."""

    phase: str
    calls: tuple[KernelCall, ...]
    kernels: Mapping[str, Kernel]

    def render(self) -> str:
        lines = [f"kernel plan {self.phase}: {len(self.calls)} calls, {len(self.kernels)} kernels"]
        lines += [f"  {call.render()}" for call in self.calls]
        return "\n".join(lines)


def op_instance(graph: Graph, name: str) -> OpInstance:
    """The node `name` with the types of its inputs, as rules see it."""
    return OpInstance(name, graph.node(name), tuple(graph.type_of(ref) for ref in graph.inputs(name)))


def schedule_graph(
    graph: Graph,
    target: Target,
    rules: Sequence[Rule] = RULES,
    knobs: Mapping[str, Mapping[str, int]] | None = None,
    kernels: dict[str, Kernel] | None = None,
) -> KernelPlan:
    """Choose and schedule a kernel for every compute node of `graph`.

    `knobs` maps a rule name to knob overrides (a tuning database's choice). `kernels` is shared between
    calls to reuse kernels across phases: a kernel already there under the same spec is not scheduled again.
    """
    known = kernels if kernels is not None else {}
    by_name = {rule.name: rule for rule in rules}
    calls = []
    for name in graph.topo():
        node = graph.node(name)
        if node.op in _BOUNDARY:
            continue
        op = op_instance(graph, name)
        kernel = _kernel_for(op, target, rules, knobs or {}, known)
        assert kernel.spec is not None
        views = by_name[kernel.rule].views(op)
        calls.append(_bind(graph, name, op, kernel.spec, views))
    used = {call.kernel: known[call.kernel] for call in calls}
    return KernelPlan(graph.name, tuple(calls), MappingProxyType(used))


def check_knob_rules(
    knobs: Mapping[str, Mapping[str, int]], rules: Sequence[Rule], used: Iterable[Kernel] | None = None
) -> None:
    """Knob overrides name rules of `rules`, and, given the kernels a build `used`, rules that made one of
    them: an override nothing reads would leave a build that silently ignores it. (Each rule refuses knob
    names it does not have when it applies them.)"""
    known = [rule.name for rule in rules]
    unknown = sorted(set(knobs) - set(known))
    if unknown:
        raise KernelPlanError(
            f"knob overrides for unknown rule(s) {', '.join(unknown)}; expected rules among {', '.join(known)}. "
            "Fix: correct the rule names (the manifest's `kernels` lists each kernel's rule and knobs)"
        )
    if used is None:
        return
    ran = {kernel.rule for kernel in used}
    idle = sorted(set(knobs) - ran)
    if idle:
        raise KernelPlanError(
            f"knob overrides for rule(s) {', '.join(idle)}, which made no kernel of this build (its kernels come "
            f"from {', '.join(sorted(ran))}). Fix: drop those overrides, or build for a target or precision where "
            "the rule applies"
        )


def _kernel_for(
    op: OpInstance,
    target: Target,
    rules: Sequence[Rule],
    knobs: Mapping[str, Mapping[str, int]],
    known: dict[str, Kernel],
) -> Kernel:
    for rule in rules:
        spec = rule.spec_of(op)
        if spec is None:
            continue
        if spec.name in known and known[spec.name].spec == spec:
            return known[spec.name]  # the same kernel another node already has
        kernel = rule.apply(spec, target, knobs.get(rule.name))
        if kernel is not None:  # None: the rule declines this shape and leaves it to a later, more general one
            break
    else:
        raise no_rule_error(rules, op, target)
    if kernel.spec is None:
        raise KernelPlanError(f"{op.name}: rule {kernel.rule} returned a kernel without its spec")
    previous = known.get(kernel.name)
    if previous is not None and previous.spec != kernel.spec:
        raise KernelPlanError(
            f"{op.name}: kernel name {kernel.name!r} is used by two different specs ({previous.spec} and "
            f"{kernel.spec}). Fix: the spec's name must encode every field that changes the kernel"
        )
    known.setdefault(kernel.name, kernel)
    return known[kernel.name]


def _bind(
    graph: Graph, name: str, op: OpInstance, spec: KernelSpec, views: Mapping[str, tuple[int, ...]]
) -> KernelCall:
    """Pair the spec's parameters with the node's values and unify their shapes."""
    params = spec.params()
    inputs = graph.inputs(name)
    inouts = [p for p in params if p.role == "inout"]
    n_out = len(op.outputs)
    expected = len(inputs) + n_out - len(inouts)
    if len(params) != expected:
        raise KernelPlanError(
            f"{name}: kernel {spec.name} has {len(params)} parameters; the node has {len(inputs)} inputs and "
            f"{n_out} outputs ({len(inouts)} updated in place), so {expected} were expected. "
            "Fix: the spec's params() must follow the convention of schedules/base.py"
        )
    sources: list[tuple[Ref, TensorType]] = [(ref, graph.type_of(ref)) for ref in inputs]
    outputs = [(Ref(name, port), t) for port, t in enumerate(op.outputs)][len(inouts) :]
    sources += outputs
    buffers: list[tuple[str, BufferView]] = []
    sizes: dict[str, str] = {}
    for param, (ref, ttype) in zip(params, sources, strict=True):
        if param.role == "in" and ref.node == name:
            raise KernelPlanError(f"{name}: kernel {spec.name} parameter {param.name} is an input but binds an output")
        index = tuple(views.get(param.name, ()))
        if param.dtype != ttype.dtype:
            raise KernelPlanError(
                f"{name}: kernel {spec.name} parameter {param.name} is {param.dtype}, the graph value "
                f"{ref.render()} is {ttype.dtype}"
            )
        shape = ttype.shape[len(index) :]
        if len(shape) != len(param.shape):
            raise KernelPlanError(
                f"{name}: kernel {spec.name} parameter {param.name} has shape {param.shape}; the graph value "
                f"{ref.render()}{list(index) if index else ''} has {shape}"
            )
        for kdim, gdim in zip(param.shape, shape, strict=True):
            if isinstance(kdim, int):
                if kdim != gdim:
                    raise KernelPlanError(
                        f"{name}: kernel {spec.name} parameter {param.name} fixes a dim to {kdim}; the graph value "
                        f"{ref.render()} has {gdim} there. Fix: make that dim a size variable in the spec"
                    )
                continue
            text = str(gdim)
            if sizes.setdefault(kdim, text) != text:
                raise KernelPlanError(
                    f"{name}: kernel {spec.name} size {kdim!r} is both {sizes[kdim]} and {text} "
                    f"(parameter {param.name})"
                )
        buffers.append((param.name, BufferView(ref.render(), index)))
    missing = [v for v in spec.variables() if v not in sizes]
    if missing:
        raise KernelPlanError(f"{name}: kernel {spec.name} sizes {missing} are not determined by any parameter")
    return KernelCall(name, spec.name, tuple(buffers), tuple(sizes.items()))
