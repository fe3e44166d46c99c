"""Rewrite plan_memory's golden plans: ``python tests/unit/golden/regenerate_plan_memory.py``,
then review ``git diff``. A script rather than an environment variable, so a test run never writes files.
"""

from __future__ import annotations

import sys
from pathlib import Path

UNIT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(UNIT.parents[1]), str(UNIT)]  # the checkout (dflash_compiler) and tests/unit

from test_pass_memory import GOLDEN_CASES, golden_path, golden_text  # noqa: E402


def main() -> None:
    for case in GOLDEN_CASES:
        path = golden_path(*case)
        text = golden_text(*case)
        changed = not path.exists() or path.read_text() != text
        path.write_text(text)
        print(f"{'updated ' if changed else 'same    '} {path.relative_to(UNIT.parents[1])}")


if __name__ == "__main__":
    main()
