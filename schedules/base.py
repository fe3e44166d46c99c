"""The schedule-rule interface: `Rule.apply(subject, target, knobs) -> Kernel | None`.

A kernel family has two halves:

* a **spec** (`KernelSpec`): a frozen, hashable record of what one kernel computes (static sizes, eps,
  scale, ...). It states the kernel's parameters, builds the unscheduled TVM computation (the CPU oracle,
  built for `llvm` in tests), and carries a numpy reference and an input sampler. Specs import neither TVM
  at module level nor anything the deploy box lacks, so the GPU check of a cubin runs from the spec alone.
* a **rule** (`Rule`): recognises its work (a graph node seen through `OpInstance`, or its own spec) and
  schedules the spec for a target. `None` means "not mine", so callers try rules in order and the list
  ends with a correct generic rule. Knobs (threads per block, vector width, tiles, split-K) have
  per-target defaults computed from the target's capabilities, never its name; a tuning database may
  override them, and an unknown or invalid knob is an error rather than ignored.

Parameter convention (the launch plan relies on it): a kernel's parameters are the node's inputs in
order, then the node's outputs in order, except an output that updates an input in place (the KV cache),
which is that input's parameter with role `inout`. Every buffer dim is an int or one int32 variable name.
Dynamic values (positions, page tables, lengths) are buffers, never scalar parameters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from dflash_compiler.errors import DFlashError
from dflash_compiler.ir.graph import Node, TensorType
from dflash_compiler.ir.ops import Op
from dflash_compiler.targets import Target

if TYPE_CHECKING:
    import numpy as np


class ScheduleError(DFlashError):
    """No rule applies, or the knobs given do not fit the workload or the target."""


# ------------------------------------------------------------------------------------------- the work


@dataclass(frozen=True)
class OpInstance:
    """A graph node as a rule sees it: the node record plus the types of its inputs, in argument order."""

    name: str
    node: Node
    inputs: tuple[TensorType, ...]

    @property
    def op(self) -> Op:
        return self.node.op

    @property
    def outputs(self) -> tuple[TensorType, ...]:
        return self.node.outputs

    def attr(self, key: str, *default: Any) -> Any:
        return self.node.attr(key, *default)


@dataclass(frozen=True)
class Param:
    """One kernel parameter: a buffer with a dtype and a shape of ints and int32 variable names."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]
    role: Literal["in", "out", "inout"] = "in"

    @property
    def written(self) -> bool:
        return self.role != "in"


@dataclass(frozen=True)
class Tolerance:
    """How close a float output must be: |got - ref| <= rtol * |ref| + atol * rms(ref)."""

    rtol: float = 8e-3
    atol: float = 8e-3


EXACT = Tolerance(0.0, 0.0)


class KernelSpec(ABC):
    """What one kernel computes. Subclasses are frozen dataclasses (hashable: equal specs share a kernel)."""

    @property
    @abstractmethod
    def name(self) -> str:
        """The PrimFunc's global symbol; unique per distinct spec (encode the static sizes in it)."""

    @abstractmethod
    def params(self) -> tuple[Param, ...]:
        """Parameters in PrimFunc order (see the module docstring for the convention)."""

    @abstractmethod
    def prim_func(self) -> Any:
        """The unscheduled TVM PrimFunc with `params()` as its parameters: the CPU oracle and schedule input."""

    @abstractmethod
    def reference(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """numpy: the value of every written parameter, given every parameter's value before the call."""

    @abstractmethod
    def sample(self, rng: np.random.Generator, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        """Valid random values of every parameter (outputs too, as garbage) for the given variable sizes."""

    def tolerance(self, param: str) -> Tolerance:
        """The accuracy the numpy reference holds this output to (integer outputs are always exact)."""
        return Tolerance()

    def error_scale(self, param: str, inputs: Mapping[str, Any] | None) -> Any:
        """What `Tolerance.atol` multiplies for output `param`, per element, given the arrays the kernel ran
        on; None (the default) for the rms of the reference output. A kernel whose output sums terms that
        are each rounded on the way (so its error follows the terms' size, not the sum's) returns that size."""
        return None

    def variables(self) -> tuple[str, ...]:
        """The int32 variables the parameter shapes use, in first-use order."""
        seen: dict[str, None] = {}
        for p in self.params():
            for d in p.shape:
                if isinstance(d, str):
                    seen.setdefault(d)
        return tuple(seen)


@dataclass(frozen=True)
class Kernel:
    """A scheduled kernel family instance.

    `func` is the CUDA-scheduled PrimFunc (its `global_symbol` is `name`, the kernels TVM emits are
    `<name>_kernel[_N]`); `reference` is the same computation unscheduled, which builds for `llvm` and is
    the CPU oracle in tests. `knobs` are the values actually used (defaults merged with overrides).
    """

    name: str
    func: Any
    reference: Any
    rule: str
    knobs: Mapping[str, int] = field(default_factory=dict)
    spec: KernelSpec | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "knobs", MappingProxyType(dict(self.knobs)))


# ------------------------------------------------------------------------------------------- the rules


class Rule(ABC):
    """One kernel family's schedule. Subclasses set `name` and `knob_names` and implement the hooks."""

    name: ClassVar[str]
    knob_names: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def default_knobs(self, target: Target) -> dict[str, int]:
        """Knob values for `target`, derived from its capabilities."""

    @abstractmethod
    def spec_of(self, subject: Any) -> KernelSpec | None:
        """The spec `subject` (an OpInstance, or a spec of this family) describes; None when not this family."""

    @abstractmethod
    def apply(self, subject: Any, target: Target, knobs: Mapping[str, int] | None = None) -> Kernel | None:
        """Schedule `subject` (an OpInstance or a spec) for `target`, or None when this rule does not apply."""

    def views(self, op: OpInstance) -> dict[str, tuple[int, ...]]:
        """Parameters bound to a sub-tensor of the node's value: param name → leading indices.

        E.g. a kv_write kernel takes one layer's K pages, `{"cache": (layer, 0)}` of the
        `[layers, 2, pages, 16, heads, dim]` cache, so one kernel serves every layer. Default: none.
        """
        return {}

    def resolve_knobs(self, target: Target, knobs: Mapping[str, int] | None) -> dict[str, int]:
        """The target's defaults with `knobs` applied on top; unknown names are refused."""
        merged = self.default_knobs(target)
        unknown = sorted(set(knobs or {}) - set(self.knob_names))
        if unknown:
            raise ScheduleError(
                f"rule {self.name}: unknown knob(s) {', '.join(unknown)}; expected some of "
                f"{', '.join(self.knob_names) or 'none'}. Fix: correct the knob names (tuning database or overrides)"
            )
        for key, value in (knobs or {}).items():
            if type(value) is not int:
                raise ScheduleError(f"rule {self.name}: knob {key}={value!r} must be an int")
            merged[key] = value
        return merged


class FamilyRule(Rule):
    """A rule built from a spec: `spec_of` recognises the work, `schedule` writes the CUDA schedule."""

    @abstractmethod
    def schedule(self, spec: Any, target: Target, knobs: Mapping[str, int]) -> Any:
        """The CUDA-scheduled PrimFunc of `spec` (attr `tirx.is_scheduled` set); may raise ScheduleError."""

    def apply(self, subject: Any, target: Target, knobs: Mapping[str, int] | None = None) -> Kernel | None:
        spec = self.spec_of(subject)
        if spec is None:
            return None
        chosen = self.resolve_knobs(target, knobs)
        func = self.schedule(spec, target, chosen)
        return Kernel(name=spec.name, func=func, reference=spec.prim_func(), rule=self.name, knobs=chosen, spec=spec)


def apply_rules(rules: Sequence[Rule], subject: Any, target: Target, knobs: Mapping[str, int] | None = None) -> Kernel:
    """The first rule's kernel that applies; an error naming the rules tried when none does."""
    for rule in rules:
        kernel = rule.apply(subject, target, knobs)
        if kernel is not None:
            return kernel
    raise no_rule_error(rules, subject, target)


def no_rule_error(rules: Sequence[Rule], subject: Any, target: Target) -> ScheduleError:
    """The error for work no rule takes, naming the rules tried."""
    what = getattr(getattr(subject, "op", None), "value", None) or type(subject).__name__
    return ScheduleError(
        f"no schedule rule applies to {what} on {target.name}; tried {', '.join(r.name for r in rules) or 'none'}. "
        "Fix: add a rule for this op (schedules/) or end the rule list with a generic fallback"
    )
