"""Which SM a cubin was built for, read from its ELF header (and ``.nv.compat`` for the ``a`` variant).

Tests and the loader check what was built rather than what was asked for. Pure Python: runs on the deploy box.
"""

from __future__ import annotations

import struct

from dflash_compiler.errors import DFlashError


class CubinError(DFlashError):
    """The bytes are not a cubin, or not one for the expected SM."""


_EM_CUDA = 190
_ELFABIVERSION_CUDA_V1 = 7  # SM in e_flags bits 0-7, `a` variant = EF_CUDA_ACCELERATORS_V1 (0x800)
_ELFABIVERSION_CUDA_V2 = 8  # CUDA 12.8+: SM in bits 8-15; `a` is recorded in .nv.compat
_EF_CUDA_ACCELERATORS_V1 = 0x800
_EF_CUDA_ACCELERATORS_V2 = 0x8
_NV_COMPAT_ARCH_SPECIFIC = 0x09  # .nv.compat attribute whose value 1 marks sm_XXa (what cuobjdump reads)


def cubin_arch(cubin: bytes) -> str:
    """The SM a cubin holds code for, e.g. "sm_90a", read from its ELF header.

    The SM number is in `e_flags` (its position depends on the CUDA ELF ABI version in `e_ident`). With
    ABI version 8 (CUDA 12.8 and later) the arch-specific `a` is not in `e_flags`; it is attribute 0x09 of
    the `.nv.compat` section, which is what `cuobjdump --list-elf` reads (patching that byte flips its
    answer). Family variants (`sm_120f`) read as the plain SM, as cuobjdump prints them.
    """
    data = bytes(cubin)
    if len(data) < 64 or data[:4] != b"\x7fELF":
        raise CubinError(f"not a cubin: expected an ELF file (\\x7fELF), found {data[:4]!r} ({len(data)} bytes)")
    if data[4] != 2 or data[5] != 1:
        raise CubinError(f"not a cubin: expected a 64-bit little-endian ELF, found class {data[4]} data {data[5]}")
    (machine,) = struct.unpack_from("<H", data, 18)
    if machine != _EM_CUDA:
        raise CubinError(f"not a cubin: ELF e_machine is {machine}, expected {_EM_CUDA} (EM_CUDA)")
    (flags,) = struct.unpack_from("<I", data, 48)
    abi = data[8]
    if abi == _ELFABIVERSION_CUDA_V1:
        sm, arch_specific = flags & 0xFF, bool(flags & _EF_CUDA_ACCELERATORS_V1)
    elif abi == _ELFABIVERSION_CUDA_V2:
        sm = (flags >> 8) & 0xFF
        arch_specific = bool(flags & _EF_CUDA_ACCELERATORS_V2) or _nv_compat(data).get(_NV_COMPAT_ARCH_SPECIFIC) == 1
    else:
        raise CubinError(
            f"cubin has CUDA ELF ABI version {abi}; expected {_ELFABIVERSION_CUDA_V1} or {_ELFABIVERSION_CUDA_V2}"
        )
    return f"sm_{sm}{'a' if arch_specific else ''}"


def static_shared_bytes(cubin: bytes) -> dict[str, int]:
    """Static `__shared__` bytes per kernel: the size of its `.nv.shared.<kernel>` section (NOBITS)."""
    prefix = ".nv.shared."
    return {name[len(prefix) :]: size for name, size in _section_sizes(bytes(cubin)).items() if name.startswith(prefix)}


def kernel_names(cubin: bytes) -> list[str]:
    """The kernels whose code the cubin holds (its `.text.<kernel>` sections)."""
    return [name.removeprefix(".text.") for name, *_ in _section_headers(bytes(cubin)) if name.startswith(".text.")]


def _section_headers(data: bytes) -> list[tuple[str, int, int, int]]:
    """(name, type, offset, size) of every ELF section."""
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff == 0 or shnum == 0 or shoff + shnum * shentsize > len(data):
        return []
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_off = headers[shstrndx][4]
    out = []
    for name_idx, sh_type, _flags, _addr, offset, size in headers:
        start = names_off + name_idx
        out.append((data[start : data.index(b"\0", start)].decode(errors="replace"), sh_type, offset, size))
    return out


def _section_sizes(data: bytes) -> dict[str, int]:
    return {name: size for name, _type, _offset, size in _section_headers(data)}


def _sections(data: bytes) -> dict[str, bytes]:
    return {
        name: data[offset : offset + size] if sh_type != 8 else b""  # SHT_NOBITS holds no bytes
        for name, sh_type, offset, size in _section_headers(data)
    }


def _nv_compat(data: bytes) -> dict[int, int]:
    """Attributes of `.nv.compat`: 4-byte records (format, attribute, 16-bit value or size [+ payload])."""
    blob = _sections(data).get(".nv.compat", b"")
    attrs: dict[int, int] = {}
    pos = 0
    while pos + 4 <= len(blob):
        fmt, attr, value = blob[pos], blob[pos + 1], struct.unpack_from("<H", blob, pos + 2)[0]
        pos += 4
        if fmt == 4:  # EIFMT_SVAL: `value` bytes of payload follow
            pos += value
        elif fmt in (2, 3):  # EIFMT_BVAL / EIFMT_HVAL
            attrs[attr] = value
    return attrs
