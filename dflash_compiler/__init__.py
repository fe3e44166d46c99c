"""dflash-compiler: compile DFlash-family speculative-decoding drafters into CUDA artifacts."""

from pathlib import Path as _Path

__version__ = "0.1.0"

# The installed package maps the top-level ir_passes/, schedules/ and targets/ folders to
# dflash_compiler.ir_passes etc. (pyproject's package-dir). A source checkout used through PYTHONPATH
# (the deploy box has no install step) gets the same names by searching the checkout root too.
_root = _Path(__file__).resolve().parent.parent
if (_root / "ir_passes").is_dir() and str(_root) not in __path__:
    __path__.append(str(_root))
