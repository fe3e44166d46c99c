"""Look targets up by name, or read the present device (`auto`).

Only exact names are accepted; an unknown one is refused with the list of known names rather than
mapped to the nearest record, because a wrong target builds cubins that do not load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from dflash_compiler.errors import Problem

from .base import Target, TargetError
from .sm90 import SM90
from .sm120 import SM120
from .sm121 import SM121

AUTO = "auto"
# Where no GPU is present the design's default build target is the GB10 (DESIGN.md, Targets).
DEFAULT_TARGET = "sm_121"

TARGETS: Mapping[str, Target] = MappingProxyType({t.name: t for t in (SM90, SM120, SM121)})

ComputeCapabilityProbe = Callable[[], tuple[int, int]]


def known_targets() -> tuple[str, ...]:
    """Names `get_target` accepts, `auto` last."""
    return (*TARGETS, AUTO)


def get_target(name: str, probe: ComputeCapabilityProbe | None = None) -> Target:
    """The target record called `name`; `auto` reads the present device's compute capability.

    `probe` replaces the device query (tests use it); by default it is `device_compute_capability`.
    """
    if name == AUTO:
        return target_for_compute_capability((probe or device_compute_capability)())
    try:
        return TARGETS[name]
    except KeyError:
        raise TargetError(
            "--target",
            [Problem("--target", repr(name), f"one of {', '.join(known_targets())}", "pass one of those names")],
        ) from None


def target_for_compute_capability(cc: tuple[int, int]) -> Target:
    """The record whose compute capability is `cc`; an error naming the supported ones otherwise."""
    for target in TARGETS.values():
        if target.compute_capability == tuple(cc):
            return target
    supported = ", ".join(f"{t.compute_capability[0]}.{t.compute_capability[1]} ({t.name})" for t in TARGETS.values())
    raise TargetError(
        "--target auto",
        [
            Problem(
                "device 0",
                f"compute capability {cc[0]}.{cc[1]}",
                f"one of {supported}",
                "build on a supported GPU, or pass an explicit --target for the GPU that will run the artifact",
            )
        ],
    )


def device_compute_capability(device: int = 0) -> tuple[int, int]:
    """(major, minor) of CUDA device `device`, read through the driver API (cuda-python).

    Every way this can fail on a build box (no cuda-python, no driver library, no device) ends in a
    TargetError telling the user to name the target instead.
    """
    fix = f"pass an explicit --target ({', '.join(TARGETS)}); 'auto' needs an NVIDIA GPU and its driver"

    def fail(found: str) -> TargetError:
        return TargetError("--target auto", [Problem("--target auto", found, "a visible CUDA device", fix)])

    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise fail(f"cuda-python is not installed ({exc})") from None
    try:
        (err,) = driver.cuInit(0)
        if int(err) != 0:
            raise fail(f"cuInit failed: {err!r}")
        err, count = driver.cuDeviceGetCount()
        if int(err) != 0 or count <= device:
            raise fail(f"{count if int(err) == 0 else 0} CUDA device(s), wanted device {device}")
        err, dev = driver.cuDeviceGet(device)
        if int(err) != 0:
            raise fail(f"cuDeviceGet({device}) failed: {err!r}")
        attr = driver.CUdevice_attribute
        err1, major = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        err2, minor = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        if int(err1) != 0 or int(err2) != 0:
            raise fail(f"reading the compute capability failed: {err1!r}, {err2!r}")
    except TargetError:
        raise
    except Exception as exc:  # the driver library is missing: cuda.pathfinder raises DynamicLibNotFoundError
        raise fail(f"no usable NVIDIA driver ({type(exc).__name__}: {exc})") from None
    return int(major), int(minor)
