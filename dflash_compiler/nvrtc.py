"""CUDA C → cubin through NVRTC (cuda-python), with the CUDA headers found by cuda.pathfinder.

No toolkit, no environment variable and no TVM callback: the build box needs only the NVRTC and header
wheels. Fast-math is off unless asked, so kernels keep IEEE division and transcendental accuracy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dflash_compiler.codegen import CodegenError
from dflash_compiler.cubin import cubin_arch

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
        _check_wgmma_pipeline(_program_log(nvrtc, prog), name, arch)
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


# ptxas's notes that it serialised warpgroup MMAs or waited for them where the kernel did not: the code is
# still correct, but the wgmma pipeline the kernel was written for is gone (C7510-C7519)
_WGMMA_SERIALISED = ("wgmma.mma_async instructions are serialized", "wgmma.wait_group is injected")


def _check_wgmma_pipeline(log: str, name: str, arch: str) -> None:
    """Refuse a cubin whose warpgroup MMAs ptxas serialised: a silent slowdown of every GEMM that uses them."""
    notes = [ln.strip() for ln in log.splitlines() if any(text in ln for text in _WGMMA_SERIALISED)]
    if notes:
        raise CodegenError(
            f"ptxas serialised the warpgroup MMAs of {name} for {arch}:\n" + "\n".join(notes[:8]) + "\n"
            "Expected every wgmma.mma_async to stay asynchronous up to its wgmma.wait_group. Fix: touch the "
            "accumulators only after the wait that retires them, and keep them in registers (dflash_compiler/wgmma.py)"
        )


def _check_nvrtc(err: Any, what: str) -> None:
    if int(err) != 0:
        raise CodegenError(f"{what} failed: {err!r}")
