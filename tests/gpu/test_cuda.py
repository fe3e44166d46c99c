"""The driver wrappers benchmarks time with: work behind a `HostGate` waits for the host, and a hold the host
cannot end (a synchronisation inside it) is reported, not left stalled."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture
def stream():
    from dflash_compiler.runtime.cuda import Device, Stream

    Device(0)
    return Stream()


def _done(event) -> bool:
    from cuda.bindings import driver as cu

    err = cu.cuEventQuery(event)[0]
    assert err in (cu.CUresult.CUDA_SUCCESS, cu.CUresult.CUDA_ERROR_NOT_READY), err
    return err == cu.CUresult.CUDA_SUCCESS


def test_work_behind_the_gate_waits_for_the_host(stream):
    from cuda.bindings import driver as cu

    from dflash_compiler.runtime.cuda import Device, HostGate, check

    device = Device(0)
    src = np.arange(1 << 20, dtype=np.float32)
    a, b = device.upload(src), device.alloc(src.nbytes)
    event = check(cu.cuEventCreate(0), "cuEventCreate")
    with HostGate() as gate:
        for _ in range(2):  # the second hold takes the next round of the same word
            device.zero(b, src.nbytes)
            device.synchronize()  # the memset is on the legacy stream, which a non-blocking one does not wait for
            with gate.held(stream.handle):
                device.copy(b, a, src.nbytes, stream.handle)
                check(cu.cuEventRecord(event, stream.handle), "cuEventRecord")
                time.sleep(0.05)
                assert not _done(event)
            stream.synchronize()
            assert _done(event)
            np.testing.assert_array_equal(device.download(b, src.shape, src.dtype), src)
    check(cu.cuEventDestroy(event), "cuEventDestroy")
    device.free(a)
    device.free(b)


def test_a_hold_the_host_cannot_end_is_reported(stream):
    from dflash_compiler.runtime.cuda import CudaError, HostGate

    with HostGate(watchdog_s=0.2) as gate:
        with pytest.raises(CudaError, match="watchdog"), gate.held(stream.handle):
            stream.synchronize()  # would wait for the gate forever without its watchdog
        with gate.held(stream.handle):  # the gate still works after the watchdog opened it
            pass
        stream.synchronize()
