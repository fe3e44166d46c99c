"""What a cubin's machine code does, read with nvdisasm (the `compile` extra's nvidia-cuda-nvdisasm wheel).

The CUDA source says what a kernel asks for; ptxas decides the order the SM issues it in. Checks that are
about that order (a load issued before the dependent-launch wait, dependent_launch.py) read the SASS.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

from dflash_compiler.errors import DFlashError

WAIT = "ACQBULK"  # griddepcontrol.wait
TRIGGER = "PREEXIT"  # griddepcontrol.launch_dependents
# instructions that send a global-memory read or an L2 prefetch on its way
LOADS = ("LDG", "LDGSTS", "CCTL", "UBLKCP", "UTMALDG", "UBLKPF", "UTMAPF")

_SECTION = re.compile(r"^\.text\.(\w+):$", re.MULTILINE)
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(?:\.[A-Z0-9_.]+)?\b")


class SassError(DFlashError):
    """The disassembler is missing or failed."""


def nvdisasm() -> str:
    """The nvdisasm executable, found by cuda.pathfinder in the nvidia-cuda-nvdisasm wheel or a toolkit."""
    import cuda.pathfinder as pf

    found = pf.find_nvidia_binary_utility("nvdisasm")
    if found is None:
        raise SassError(
            "nvdisasm not found. Fix: pip install nvidia-cuda-nvdisasm (the 'compile' extra) or install a CUDA toolkit"
        )
    return str(found)


def kernel_opcodes(cubin: bytes) -> dict[str, tuple[str, ...]]:
    """`{kernel: opcodes in issue order}` of every function in `cubin` (modifiers and predicates dropped:
    `@!P0 LDG.E.128.CONSTANT` reads as `LDG`)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernels.cubin"
        path.write_bytes(cubin)
        run = subprocess.run([nvdisasm(), "-c", str(path)], capture_output=True, text=True)
    if run.returncode != 0:
        raise SassError(f"nvdisasm failed on a {len(cubin)}-byte cubin: {run.stderr.strip()}")
    heads = list(_SECTION.finditer(run.stdout))
    out = {}
    for head, after in zip(heads, [*heads[1:], None], strict=True):
        body = run.stdout[head.end() : after.start() if after else len(run.stdout)]
        out[head.group(1)] = tuple(m.group(1) for m in map(_INSTRUCTION.match, body.splitlines()) if m)
    return out


def loads_before_wait(opcodes: tuple[str, ...]) -> int:
    """How many global loads and prefetches a kernel issues before its first dependent-launch wait (all of
    them when it has none)."""
    end = opcodes.index(WAIT) if WAIT in opcodes else len(opcodes)
    return sum(op in LOADS for op in opcodes[:end])
