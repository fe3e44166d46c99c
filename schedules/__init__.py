"""Schedule rules, one kernel family per file: `rule.apply(node_or_func, target, knobs) -> Kernel | None`.

Importing this package does not import TVM; a rule imports it when it builds a kernel.
"""

from .base import Kernel, Rule, ScheduleError, apply_rules
from .rmsnorm import RMSNormRule, RMSNormSpec, rmsnorm_func, schedule_rmsnorm

# Tried in order by `apply_rules`; grows one family at a time (a generic fallback goes last).
RULES: tuple[Rule, ...] = (RMSNormRule(),)

__all__ = [
    "RULES",
    "Kernel",
    "RMSNormRule",
    "RMSNormSpec",
    "Rule",
    "ScheduleError",
    "apply_rules",
    "rmsnorm_func",
    "schedule_rmsnorm",
]
