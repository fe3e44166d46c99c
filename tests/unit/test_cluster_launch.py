"""The runtime's launches of clustered kernels (runtime/cuda.py, against a recording stand-in for the driver):
a kernel of clusters past portable is opted in to them once, before its first launch; a portable one is not;
and a dependent launch of a clustered grid keeps its shared memory, where a plain grid of one wave or less is
spread over the SMs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from dflash_compiler.codegen import KernelLaunch
from dflash_compiler.runtime import cuda

OK = 0
NON_PORTABLE, MAX_DYNAMIC, STATIC_SHARED = "non_portable", "max_dynamic", "static_shared"


class Recorder:
    """The driver calls Module makes, answered as an H100 would (132 SMs, two 112 KiB blocks per SM)."""

    def __init__(self) -> None:
        self.attributes: list[tuple[str, str, int]] = []
        self.launches: list[tuple[str, int]] = []
        self.CUfunction_attribute = SimpleNamespace(
            CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED=NON_PORTABLE,
            CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=MAX_DYNAMIC,
            CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES=STATIC_SHARED,
        )
        self.CUdevice_attribute = SimpleNamespace(
            CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT=132,
            CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR=233472,
            CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK=1024,
            CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN=232448,
        )
        self.CUlaunchAttributeID = SimpleNamespace(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION=1)

    def CUlaunchAttribute(self) -> Any:
        return SimpleNamespace(value=SimpleNamespace())

    def CUlaunchConfig(self) -> Any:
        return SimpleNamespace()

    def cuModuleLoadData(self, image: int) -> tuple[int, str]:
        return OK, "module"

    def cuModuleGetFunction(self, module: str, name: bytes) -> tuple[int, str]:
        return OK, name.decode()

    def cuFuncSetAttribute(self, func: str, attr: str, value: int) -> tuple[int]:
        self.attributes.append((func, attr, value))
        return (OK,)

    def cuFuncGetAttribute(self, attr: str, func: str) -> tuple[int, int]:
        return OK, 0

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, func: str, threads: int, smem: int) -> tuple[int, int]:
        return OK, max(1, 233472 // (smem + 1024))

    def cuCtxGetDevice(self) -> tuple[int, int]:
        return OK, 0

    def cuDeviceGetAttribute(self, which: int, device: int) -> tuple[int, int]:
        return OK, which

    def cuLaunchKernelEx(self, config: Any, func: str, argv: int, extra: int) -> tuple[int]:
        self.launches.append((func, config.sharedMemBytes))
        return (OK,)


def _launch(name: str, cluster: tuple[int, int, int], blocks: int) -> KernelLaunch:
    return KernelLaunch(
        name=name,
        params=(),
        launch_tags=(),
        grid=(str(blocks), "8", "1"),
        block=("32", "4", "1"),
        dynamic_smem=str(112 * 1024),
        cluster=cluster,
    )


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setattr(cuda, "_driver", lambda: recorder)
    return recorder


def test_a_cluster_past_portable_is_opted_in_once_and_keeps_its_shared_memory(driver: Recorder) -> None:
    module = cuda.Module(b"cubin", dependent_launch=True)
    wide, portable, single = (
        _launch("wide", (16, 1, 1), 16),
        _launch("eight", (8, 1, 1), 8),
        _launch("one", (1, 1, 1), 8),
    )
    for launch in (wide, wide, portable, single):
        module.launch(launch, {}, {})
    assert [a for a in driver.attributes if a[1] == NON_PORTABLE] == [("wide", NON_PORTABLE, 1)]
    # 128 and 64 blocks are one wave: the plain grid is spread (more shared memory, one block per SM), the
    # clustered ones keep 112 KiB so that two blocks of a cluster may share an SM
    smem = dict(driver.launches)
    assert smem["wide"] == smem["eight"] == 112 * 1024
    assert smem["one"] > 112 * 1024
