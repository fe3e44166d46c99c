"""Rewrite every golden file: ``python tests/unit/golden/regenerate.py``, then review ``git diff``.

A script rather than an environment variable or pytest flag, so a test run never writes files and
regenerating is a deliberate step whose result is read before it is committed.
"""

from __future__ import annotations

import sys
from pathlib import Path

UNIT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(UNIT.parents[1]), str(UNIT)]  # the checkout (dflash_compiler) and tests/unit

import test_pass_fusion  # noqa: E402
import test_pass_memory  # noqa: E402
import test_pass_precision  # noqa: E402


def main() -> None:
    for module in (test_pass_fusion, test_pass_precision, test_pass_memory):
        for case in module.GOLDEN_CASES:
            path = module.golden_path(*case)
            text = module.golden_text(*case)
            changed = not path.exists() or path.read_text() != text
            path.write_text(text)
            print(f"{'updated ' if changed else 'same    '} {path.relative_to(UNIT.parents[1])}")


if __name__ == "__main__":
    main()
