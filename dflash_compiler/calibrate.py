"""Calibration activations for precision ``auto``: the rows that multiply each linear's weight.

``choose_precision`` keeps a linear in FP8 only where the quantized weight's output error is within
budget, and an output error only means something on the activations the linear actually sees. So the
program is run with the numpy interpreter (:class:`GraphDrafter`) over a short multi-step protocol
scenario, on the build's own weights, and the first input of every linear node is recorded, keyed by the
WEIGHT node the linear reads. Both phases contribute: a weight read in both (``k_proj`` reads the block
rows in ``propose`` and the context rows in ``append_context``) gets the rows of both.

The pipeline calibrates the lowered program, where a weight node is named after its checkpoint tensor;
``choose_precision`` finds the rows of a fused weight (``concat_rows`` of several tensors, one shared
input) under its sources' names, preferring the rows of its own phase (``<phase>/<name>`` keys).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from dflash_compiler.graph_runner import Drafts, GraphDrafter
from dflash_compiler.ir.graph import Graph, Node
from dflash_compiler.ir.ops import Op
from dflash_compiler.lower import PAGE_SIZE, Program
from dflash_compiler.protocol import Scenario, run_scenario

LINEAR_OPS = (Op.MATMUL, Op.MATMUL_FP8, Op.LM_HEAD)
PROBE_PREFIX = "calibrate."
DEFAULT_SCENARIO = Scenario(prompt_lengths=(5, 17, 30, 3), steps=4, replace_at=2)

Tensors = Mapping[str, np.ndarray] | Callable[[str], np.ndarray]


def with_probes(graph: Graph) -> tuple[Graph, dict[str, str]]:
    """A copy of ``graph`` with an identity probe (``SCALE`` by 1) on each linear's first input.

    The interpreter's capture records a node's first output only, and a linear may read port 1 of a
    two-output node (``rmsnorm_residual``); a probe makes every linear input a capturable value of its own.
    Returns the graph and ``probe name -> weight node name``.
    """
    out = graph.copy()
    probes: dict[str, str] = {}
    for name, _ in graph.nodes_of(*LINEAR_OPS):
        x, w = graph.inputs(name)[:2]
        probe = PROBE_PREFIX + name
        out.add(probe, Node.make(Op.SCALE, [graph.type_of(x)], factor=1.0), [x])
        probes[probe] = w.node
    return out, probes


class _CalibrationDrafter(GraphDrafter):
    """A :class:`GraphDrafter` over probed graphs that keeps every probe's rows of every call."""

    def __init__(self, program: Program, tensors: Tensors, num_pages: int, max_seq_len: int) -> None:
        append, self._append_probes = with_probes(program.append_context)
        propose, self._propose_probes = with_probes(program.propose)
        super().__init__(program.with_phases(append, propose), tensors, num_pages, max_seq_len)
        self.rows: dict[str, list[np.ndarray]] = {}

    def _keep(self, phase: str, values: Mapping[str, np.ndarray], probes: Mapping[str, str]) -> None:
        for probe, weight in probes.items():
            rows = np.asarray(values[probe], np.float32)
            self.rows.setdefault(weight, []).append(rows)
            self.rows.setdefault(f"{phase}/{weight}", []).append(rows)

    def append_context(
        self, seq_ids: Sequence[int], taps: Sequence[np.ndarray], positions: Sequence[np.ndarray]
    ) -> None:
        super().append_context(seq_ids, taps, positions)
        self._keep("append_context", self.last_values["append_context"], self._append_probes)

    def propose(self, seq_ids: Sequence[int], anchors: Sequence[int]) -> Drafts:
        drafts = super().propose(seq_ids, anchors)
        self._keep("propose", self.last_values["propose"], self._propose_probes)
        return drafts


def _pool_for(scenario: Scenario, block: int) -> tuple[int, int]:
    """(num_pages, max_seq_len) that admit every sequence of ``scenario`` at its longest."""
    longest = max((*scenario.prompt_lengths, scenario.replacement_prompt)) + (scenario.steps + 1) * block
    sequences = len(scenario.prompt_lengths) + (scenario.replace_at is not None)
    return sequences * (-(-longest // PAGE_SIZE) + 1) + 1, longest


def _subsample(rows: np.ndarray, max_rows: int) -> np.ndarray:
    """Evenly spaced rows (deterministic), so huge calibration runs stay cheap to measure."""
    if len(rows) <= max_rows:
        return rows
    return rows[np.unique(np.linspace(0, len(rows) - 1, max_rows).round().astype(np.int64))]


def collect_calibration(
    program: Program, tensors: Tensors, scenario: Scenario | None = None, max_rows: int = 2048
) -> dict[str, np.ndarray]:
    """``weight -> f32 [rows, K]``: the rows that multiplied that WEIGHT node over ``scenario``.

    Each weight appears twice: under its node name (rows of both phases) and under ``<phase>/<name>``
    (rows of that phase), so a pass that sees a fused weight can look up the rows of its phase.
    """
    scenario = scenario or DEFAULT_SCENARIO
    cfg = program.config
    num_pages, max_seq_len = _pool_for(scenario, cfg.block_size)
    drafter = _CalibrationDrafter(program, tensors, num_pages, max_seq_len)
    run_scenario(drafter, cfg, scenario)
    return {weight: _subsample(np.concatenate(parts), max_rows) for weight, parts in drafter.rows.items()}
