"""Borrowing device tensors: the CUDA array interface and DLPack headers are read, wrong inputs refused."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_compiler.runtime.device_array import DeviceArrayError, device_array


class CAI:
    def __init__(self, typestr: str, shape: tuple[int, ...], strides=None) -> None:
        self.__cuda_array_interface__ = {
            "data": (0xABC000, False),
            "shape": shape,
            "typestr": typestr,
            "strides": strides,
            "version": 3,
        }


def test_cuda_array_interface_is_read():
    a = device_array(CAI("<f4", (3, 4)))
    assert (a.pointer, a.shape, a.dtype) == (0xABC000, (3, 4), "float32")
    a.check("w", (3, 4), "float32")
    with pytest.raises(DeviceArrayError, match=r"w: found float32\[3, 4\] on the device, expected bfloat16\[3, 4\]"):
        a.check("w", (3, 4), "bfloat16")


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (CAI("<c8", (2,)), "typestr '<c8' is not supported"),
        (CAI("<f4", (2, 2), strides=(4, 8)), "contiguous"),
        (object(), "expected a CUDA tensor exposing __dlpack__"),
    ],
)
def test_unusable_objects_are_refused(obj, message):
    with pytest.raises(DeviceArrayError, match=message):
        device_array(obj)


def test_dlpack_header_of_a_host_array_is_read_and_refused_as_not_cuda():
    with pytest.raises(DeviceArrayError, match=r"DLPack device type 1, not CUDA \(2\)"):
        device_array(np.zeros((2, 3), np.float32))
