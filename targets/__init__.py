"""Build targets: one frozen capability record per GPU generation, and the registry that names them.

Schedules read a target's capabilities (SM count, shared memory, threads, MMA support), never its name.
"""

from .base import STATIC_SHARED_MEMORY_LIMIT, Target, TargetError
from .registry import (
    AUTO,
    DEFAULT_TARGET,
    TARGETS,
    device_compute_capability,
    get_target,
    known_targets,
    target_for_compute_capability,
)
from .sm90 import SM90
from .sm120 import SM120
from .sm121 import SM121

__all__ = [
    "AUTO",
    "DEFAULT_TARGET",
    "SM90",
    "SM120",
    "SM121",
    "STATIC_SHARED_MEMORY_LIMIT",
    "TARGETS",
    "Target",
    "TargetError",
    "device_compute_capability",
    "get_target",
    "known_targets",
    "target_for_compute_capability",
]
