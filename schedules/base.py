"""The schedule-rule interface: `Rule.apply(subject, target, knobs) -> Kernel | None`.

A rule recognises one kind of work (a graph node, or a PrimFunc it built itself), writes its TVM
computation and schedules it for CUDA. `None` means "not mine", so callers try rules in order and the
list ends with a correct generic rule. Knobs (threads per block, vector width, tiles, split-K) have
per-target defaults computed from the target's capabilities, never its name; a tuning database may
override them, and an unknown or invalid knob is an error rather than ignored.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

from dflash_compiler.errors import DFlashError
from dflash_compiler.targets import Target


class ScheduleError(DFlashError):
    """No rule applies, or the knobs given do not fit the workload or the target."""


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "knobs", MappingProxyType(dict(self.knobs)))


class Rule(ABC):
    """One kernel family's schedule. Subclasses set `name` and `knob_names` and implement the two hooks."""

    name: ClassVar[str]
    knob_names: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def default_knobs(self, target: Target) -> dict[str, int]:
        """Knob values for `target`, derived from its capabilities."""

    @abstractmethod
    def apply(self, subject: Any, target: Target, knobs: Mapping[str, int] | None = None) -> Kernel | None:
        """Schedule `subject` (a graph node or a PrimFunc) for `target`, or None when this rule does not apply."""

    def resolve_knobs(self, target: Target, knobs: Mapping[str, int] | None) -> dict[str, int]:
        """The target's defaults with `knobs` applied on top; unknown names are refused."""
        merged = self.default_knobs(target)
        unknown = sorted(set(knobs or {}) - set(self.knob_names))
        if unknown:
            raise ScheduleError(
                f"rule {self.name}: unknown knob(s) {', '.join(unknown)}; expected some of "
                f"{', '.join(self.knob_names)}. Fix: correct the knob names (tuning database or overrides)"
            )
        for key, value in (knobs or {}).items():
            if type(value) is not int:
                raise ScheduleError(f"rule {self.name}: knob {key}={value!r} must be an int")
            merged[key] = value
        return merged


def apply_rules(rules: Sequence[Rule], subject: Any, target: Target, knobs: Mapping[str, int] | None = None) -> Kernel:
    """The first rule's kernel that applies; an error naming the rules tried when none does."""
    for rule in rules:
        kernel = rule.apply(subject, target, knobs)
        if kernel is not None:
            return kernel
    what = getattr(getattr(subject, "op", None), "value", None) or type(subject).__name__
    raise ScheduleError(
        f"no schedule rule applies to {what} on {target.name}; tried {', '.join(r.name for r in rules) or 'none'}. "
        "Fix: add a rule for this op (schedules/) or end the rule list with a generic fallback"
    )
