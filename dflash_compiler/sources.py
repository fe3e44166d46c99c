"""One tensor source over a drafter checkpoint and its target's embed_tokens / lm_head.

Weight declarations name checkpoint tensors as the config expects them (`layers.0.mlp.up_proj.weight`)
and the target's as `target.embed_tokens` / `target.lm_head`; this maps those names to the stored
tensors (after the checkpoint checks, which also resolve prefixed names) and returns float32 values, or
with ``as_stored`` the values in the dtype the checkpoint stores them in (what pack-weights reads: the
weight transforms keep a dtype, and a bf16 tensor packed as bf16 is then never widened to float32).

The embedding table is the exception: a lookup reads a few of its rows, and each reader converts what it
gathered (the interpreter, the reference), so without ``as_stored`` it is the stored table mapped read-only
over the file's pages. An auto build then neither reads nor holds the 151936 × 4096 table in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from dflash_compiler.config import DrafterConfig

TensorSource = Callable[[str], np.ndarray]


def checkpoint_source(
    cfg: DrafterConfig, drafter_dir: Path, target_model: Path, as_stored: bool = False
) -> TensorSource:
    """A checked tensor source; InputError (listing every problem) when either checkpoint is unusable."""
    from dflash_compiler.target_model import check_target, load_target
    from dflash_compiler.weights import WeightSet, check_drafter_weights

    ws = WeightSet(drafter_dir)
    report = check_drafter_weights(cfg, ws, check_values=False)
    target = load_target(target_model, cfg)
    check_target(cfg, target, check_values=False)

    def tensor(name: str) -> np.ndarray:
        if name == "target.embed_tokens":  # only ever gathered: its rows are converted as they are looked up
            return target.embed_tokens() if as_stored else target.embed_tokens_mapped()
        if name == "target.lm_head":
            return target.lm_head(as_f32=not as_stored)
        stored = report.stored_names.get(name, name)
        return ws.get(stored) if as_stored else ws.get_f32(stored)

    return tensor
