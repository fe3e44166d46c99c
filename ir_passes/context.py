"""What every pass may read besides the graph: the drafter config, the build options, the weights and
the calibration activations."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from dflash_compiler.config import DrafterConfig
from dflash_compiler.ir.graph import Graph
from dflash_compiler.options import BuildOptions


@dataclass(frozen=True)
class PassContext:
    """Read-only inputs of a pass.

    ``tensors`` gives checkpoint tensors by name (``target.embed_tokens``, ``target.lm_head`` included); only
    passes that measure weights (precision ``auto``) read it. ``calibration`` maps a linear's weight (its
    WEIGHT node name, or a checkpoint tensor name) to the activation rows that multiply it, as
    :func:`dflash_compiler.calibrate.calibrate` records them; precision ``auto`` needs it.
    """

    config: DrafterConfig
    options: BuildOptions
    tensors: Callable[[str], np.ndarray] | None = None
    calibration: Mapping[str, np.ndarray] | None = None


Pass = Callable[[Graph, PassContext], Graph]
"""Graph → Graph rewrites, one per file. The order they run in lives in ``dflash_compiler.pipeline``."""
