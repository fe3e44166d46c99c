"""Borrow a device tensor another library owns: its address, shape and dtype, with no copy.

Serving engines hold the target's embed_tokens / lm_head and the tapped hidden states on the GPU already.
Two protocols cover them: DLPack (`__dlpack__`, which torch, JAX and CuPy export, bf16 included) and
`__cuda_array_interface__` (CuPy, Numba; torch exports it for the dtypes it can name, not bf16). The
caller keeps the object alive while the address is in use.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from dflash_compiler.errors import DFlashError


class DeviceArrayError(DFlashError):
    """The object is not a contiguous CUDA tensor of a supported dtype."""


@dataclass(frozen=True)
class DeviceArray:
    pointer: int
    shape: tuple[int, ...]
    dtype: str  # "bfloat16", "float32", "int32", "float8_e4m3fn", ...

    def check(self, what: str, shape: tuple[int, ...], dtype: str) -> None:
        if self.shape != tuple(shape) or self.dtype != dtype:
            raise DeviceArrayError(
                f"{what}: found {self.dtype}{list(self.shape)} on the device, expected {dtype}{list(shape)}"
            )


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_KDL_CUDA = 2
_DL_CODES = {
    (0, 32): "int32",
    (0, 64): "int64",
    (2, 32): "float32",
    (2, 16): "float16",
    (4, 16): "bfloat16",
    (1, 8): "uint8",
    (6, 8): "float8_e4m3fn",
}  # 6: kDLFloat8_e4m3fn (DLPack 1.1)
_CAI_TYPES = {"<i4": "int32", "<i8": "int64", "<f4": "float32", "<f2": "float16", "|u1": "uint8"}


def device_array(obj: Any) -> DeviceArray:
    """The device tensor behind `obj` (DLPack preferred, then `__cuda_array_interface__`)."""
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj)
    iface = getattr(obj, "__cuda_array_interface__", None)
    if iface is not None:
        return _from_cai(iface)
    raise DeviceArrayError(
        f"expected a CUDA tensor exposing __dlpack__ or __cuda_array_interface__, found {type(obj).__name__}"
    )


def _from_cai(iface: dict[str, Any]) -> DeviceArray:
    dtype = _CAI_TYPES.get(iface["typestr"])
    if dtype is None:
        raise DeviceArrayError(f"__cuda_array_interface__ typestr {iface['typestr']!r} is not supported")
    if iface.get("strides") not in (None, ()):
        raise DeviceArrayError("the device tensor must be contiguous (row-major)")
    return DeviceArray(int(iface["data"][0]), tuple(int(d) for d in iface["shape"]), dtype)


def _from_dlpack(obj: Any) -> DeviceArray:
    capsule = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    address = get(capsule, b"dltensor")  # borrowed: the capsule (and its deleter) stay with `capsule`
    tensor = ctypes.cast(address, ctypes.POINTER(_DLTensor)).contents  # DLManagedTensor starts with its DLTensor
    if tensor.device.device_type != _KDL_CUDA:
        raise DeviceArrayError(f"the tensor lives on DLPack device type {tensor.device.device_type}, not CUDA (2)")
    shape = tuple(int(tensor.shape[i]) for i in range(tensor.ndim))
    if tensor.strides:
        expected, stride = [], 1
        for extent in reversed(shape):
            expected.append(stride)
            stride *= extent
        strides = tuple(int(tensor.strides[i]) for i in range(tensor.ndim))
        if any(s != e for s, e, n in zip(strides, reversed(expected), shape, strict=True) if n > 1):
            raise DeviceArrayError(f"the device tensor must be contiguous (row-major); strides {strides}")
    key = (tensor.dtype.code, tensor.dtype.bits)
    if key not in _DL_CODES or tensor.dtype.lanes != 1:
        raise DeviceArrayError(f"DLPack dtype code {key[0]} bits {key[1]} lanes {tensor.dtype.lanes} is not supported")
    return DeviceArray(int(tensor.data or 0) + int(tensor.byte_offset), shape, _DL_CODES[key])
