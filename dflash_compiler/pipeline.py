"""The compiler pipeline, top to bottom: validate → lower → passes → schedule → build → emit.

``PASSES`` is the one list of graph rewrites; each runs over both phases. With a dump directory the
graph of every phase is written after every step (``03_fuse_gate_up.propose.txt``). `compile_drafter`
runs the whole pipeline: `optimize` (lower + passes), `build_kernels` (schedule every node, TVM → CUDA →
cubin) and `emit` (the artifact directory).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dflash_compiler.calibrate import collect_calibration
from dflash_compiler.config import DrafterConfig
from dflash_compiler.errors import Problem
from dflash_compiler.ir import dump, verify
from dflash_compiler.ir.graph import Graph
from dflash_compiler.ir_passes.choose_precision import choose_precision
from dflash_compiler.ir_passes.context import Pass, PassContext
from dflash_compiler.ir_passes.fuse_block_embed import fuse_block_embed
from dflash_compiler.ir_passes.fuse_context_kv import fuse_context_kv
from dflash_compiler.ir_passes.fuse_gate_up import fuse_gate_up
from dflash_compiler.ir_passes.fuse_gate_up_silu import fuse_gate_up_silu
from dflash_compiler.ir_passes.fuse_head_prep import fuse_head_prep
from dflash_compiler.ir_passes.fuse_kv_writes import fuse_kv_writes
from dflash_compiler.ir_passes.fuse_lm_head_argmax import fuse_lm_head_argmax
from dflash_compiler.ir_passes.fuse_qkv import fuse_qkv
from dflash_compiler.ir_passes.fuse_residual_norm import fuse_residual_norm
from dflash_compiler.ir_passes.plan_memory import plan_memory
from dflash_compiler.ir_passes.select_rope import select_rope
from dflash_compiler.ir_passes.size_kv_cache import size_kv_cache
from dflash_compiler.ir_passes.tile_weights import tile_weights
from dflash_compiler.lower import Program, lower
from dflash_compiler.options import BuildOptions, Precision
from dflash_compiler.plans import PlanError
from dflash_compiler.targets import Target

if TYPE_CHECKING:
    from dflash_compiler.artifact import Manifest

PASSES: list[tuple[str, Pass]] = [
    ("fuse_context_kv", fuse_context_kv),
    ("fuse_qkv", fuse_qkv),
    ("fuse_gate_up", fuse_gate_up),
    ("select_rope", select_rope),
    ("fuse_head_prep", fuse_head_prep),
    ("fuse_kv_writes", fuse_kv_writes),
    ("choose_precision", choose_precision),
    ("fuse_residual_norm", fuse_residual_norm),
    ("fuse_lm_head_argmax", fuse_lm_head_argmax),
    ("fuse_block_embed", fuse_block_embed),
    ("fuse_gate_up_silu", fuse_gate_up_silu),
    ("tile_weights", tile_weights),
    ("size_kv_cache", size_kv_cache),
    ("plan_memory", plan_memory),
]


@dataclass
class GraphDumper:
    """Writes every phase's graph after each step into ``directory`` (or nowhere)."""

    directory: Path | None
    step: int = 0
    written: list[Path] = field(default_factory=list)

    def __call__(self, label: str, program: Program) -> None:
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        for phase, graph in program.phases.items():
            path = self.directory / f"{self.step:02d}_{label}.{phase}.txt"
            path.write_text(dump(graph))
            self.written.append(path)
        self.step += 1


def apply_pass(program: Program, run: Pass, ctx: PassContext, check: bool) -> Program:
    phases: dict[str, Graph] = {}
    for name, graph in program.phases.items():
        out = run(graph, ctx)
        if check:
            verify(out)
        phases[name] = out
    return program.with_phases(phases["append_context"], phases["propose"])


def optimize(
    cfg: DrafterConfig,
    options: BuildOptions,
    tensors: Callable[[str], np.ndarray] | None = None,
    dump_dir: Path | None = None,
    check: bool = True,
    on_step: Callable[[str], None] | None = None,
) -> Program:
    """Lower ``cfg`` (with the options' block size) and run every pass of :data:`PASSES`."""
    if options.block_size is not None:
        cfg = cfg.with_block_size(options.block_size)
    dumper = GraphDumper(dump_dir)
    program = lower(cfg)
    if check:
        for graph in program.phases.values():
            verify(graph)
    dumper("lower", program)
    ctx = make_pass_context(program, options, tensors)
    for label, run in PASSES:
        program = apply_pass(program, run, ctx, check)
        dumper(label, program)
        if on_step is not None:
            on_step(label)
    check_exclude_globs(program, options)
    return program


def compile_drafter(
    cfg: DrafterConfig,
    options: BuildOptions,
    target: Target,
    out_dir: Path,
    tensors: Callable[[str], np.ndarray] | None = None,
    dump_dir: Path | None = None,
    overwrite: bool = False,
    on_step: Callable[[str], None] | None = None,
) -> tuple[Path, Manifest]:
    """The artifact of `cfg` for `target` (kernels and plans; weights are packed separately)."""
    from dflash_compiler.emit import emit
    from dflash_compiler.kernel_build import build_kernels

    program = optimize(cfg, options, tensors=tensors, dump_dir=dump_dir, on_step=on_step)
    build = build_kernels(program, target, knobs=options.knobs, on_step=on_step)
    path, manifest = emit(out_dir, cfg, options, program, build, overwrite=overwrite)
    if on_step is not None:
        on_step("emit")
    return path, manifest


def check_exclude_globs(program: Program, options: BuildOptions) -> None:
    """An ``exclude`` glob that names no linear in either phase is a typo, not a no-op: refuse it."""
    unmatched = set(options.exclude)
    for graph in program.phases.values():
        unmatched &= set(graph.meta["precision"].unmatched_exclude)
    if unmatched:
        raise PlanError(
            "build options",
            [
                Problem(
                    f"exclude {glob!r}",
                    "a glob that matches no linear layer",
                    "globs over linear names such as 'layers.0.*', 'layers.*.mlp.down_proj', 'fc' or 'lm_head'",
                    "fix the glob (`dflash-compile plan --dump-dir` shows the names) or remove it",
                )
                for glob in sorted(unmatched)
            ],
        )


def make_pass_context(
    program: Program, options: BuildOptions, tensors: Callable[[str], np.ndarray] | None
) -> PassContext:
    """Calibration activations are gathered only when a pass will measure with them (precision auto).

    Then the context's tensors are read once each: calibration's interpreter holds every checkpoint tensor
    in float32 anyway, and choose_precision quantizes the same arrays instead of reading and converting
    the checkpoint a second time (half of an auto build's time on a real-shape drafter). They are freed with
    the context."""
    calibration = None
    if options.precision is Precision.AUTO and tensors is not None:
        tensors = functools.cache(tensors)
        calibration = collect_calibration(program, tensors)
    return PassContext(program.config, options, tensors, calibration=calibration)
