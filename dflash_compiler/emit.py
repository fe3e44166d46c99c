"""Emit: turn an optimized program and its kernel build into the artifact's manifest and files."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from dflash_compiler import __version__
from dflash_compiler.artifact import (
    CUBIN,
    GRAPH,
    SCHEMA_VERSION,
    SOURCE,
    KernelRecord,
    Manifest,
    MemoryTotal,
    Roofline,
    Versions,
    WeightRecord,
    config_sha256,
    write_artifact,
)
from dflash_compiler.config import DrafterConfig
from dflash_compiler.ir import dump, eval_dim
from dflash_compiler.ir.graph import Graph
from dflash_compiler.ir.ops import GATHERED_ARGS, Op
from dflash_compiler.kernel_build import KernelBuild
from dflash_compiler.launch_plan import PhasePlan, phase_plan
from dflash_compiler.lower import Program
from dflash_compiler.nvrtc import nvrtc_version
from dflash_compiler.options import BuildOptions
from dflash_compiler.plans import KVCachePlan, dtype_bytes

# Context lengths the roofline prediction is quoted at (the serving shapes of the benchmark).
ROOFLINE_CONTEXTS = (4096,)


def weight_records(program: Program) -> dict[str, WeightRecord]:
    """Every WEIGHT node of both phases by name (a name read by both phases must declare the same tensor)."""
    out: dict[str, WeightRecord] = {}
    for graph in program.phases.values():
        for name, node in graph.nodes_of(Op.WEIGHT):
            ttype = node.outputs[0]
            shape = tuple(int(d) for d in ttype.shape)
            record = WeightRecord(dtype=ttype.dtype, shape=shape, decl=node.attr("decl").to_json())
            if out.setdefault(name, record) != record:
                raise ValueError(f"weight {name} is declared differently in the two phases")
    return out


def _value_bytes(plan: PhasePlan, kinds: tuple[str, ...]) -> int:
    maxima = dict(plan.dim_maxima)
    total = 0
    for slot in plan.values.values():
        if slot.kind in kinds:
            total += math.prod(eval_dim(d, maxima) for d in slot.shape) * dtype_bytes(slot.dtype)
    return total


def streamed_weights(graph: Graph) -> set[str]:
    """The WEIGHT nodes of `graph` that some node reads whole; a table only gathered from by id (embed_tokens,
    a Markov head's w1: ops.GATHERED_ARGS) streams a few rows per step, not its size, and is left out."""
    return {
        name
        for name, _ in graph.nodes_of(Op.WEIGHT)
        if any(GATHERED_ARGS.get(graph.node(user).op) != arg for user, arg in graph.users(name))
    }


def roofline(
    weights: Mapping[str, WeightRecord],
    kv: KVCachePlan,
    bandwidth: float,
    program: Program,
    max_batch: int,
    max_seq_len: int,
) -> Roofline:
    """Bytes per propose step over the bandwidth: every weight the propose phase streams, once, plus every cached
    K/V row; the append_context phase's own streamed weights are recorded beside it (a serving step runs both)."""
    propose = streamed_weights(program.propose)
    context = streamed_weights(program.phases["append_context"]) - propose

    def total(names: set[str]) -> int:
        return sum(math.prod(weights[w].shape) * dtype_bytes(weights[w].dtype) for w in names)

    weight_bytes = total(propose)
    per_row = kv.bytes_per_page // kv.page_size
    predicted = {}
    for nb in sorted({1, max_batch}):
        for ctx in sorted({min(c, max_seq_len) for c in ROOFLINE_CONTEXTS}):
            predicted[f"nb={nb} ctx={ctx}"] = round((weight_bytes + nb * ctx * per_row) / bandwidth * 1e6, 1)
    return Roofline(
        bandwidth_bytes_per_s=bandwidth,
        weight_bytes=weight_bytes,
        context_weight_bytes=total(context),
        kv_bytes_per_cached_row=per_row,
        predicted_us=predicted,
    )


def make_manifest(
    name: str, cfg: DrafterConfig, options: BuildOptions, program: Program, build: KernelBuild
) -> Manifest:
    import tvm

    phases = {phase: phase_plan(graph, build.plans[phase]) for phase, graph in program.phases.items()}
    weights = weight_records(program)
    kv = program.propose.meta["kv_cache"]
    memory = {phase: graph.meta["memory"] for phase, graph in program.phases.items()}
    total = MemoryTotal(
        weights=sum(math.prod(w.shape) * dtype_bytes(w.dtype) for w in weights.values()),
        kv_cache=kv.total_bytes,
        arenas=sum(p.arena_bytes for p in phases.values()),
        io=sum(_value_bytes(p, ("input", "output")) for p in phases.values()),
    )
    return Manifest(
        schema_version=SCHEMA_VERSION,
        name=name,
        versions=Versions(
            dflash_compiler=__version__, tvm=str(tvm.__version__), nvrtc=".".join(map(str, nvrtc_version()))
        ),
        target=build.target,
        options=options,
        config=dict(cfg.raw),
        config_sha256=config_sha256(cfg.raw),
        block_size=program.config.block_size,
        family=program.config.family.value,
        weights=weights,
        precision={phase: graph.meta["precision"] for phase, graph in program.phases.items()},
        kv_cache=kv,
        memory=memory,
        kernels=dict(build.cuda.functions),
        kernel_rules={n: KernelRecord(rule=k.rule, knobs=dict(k.knobs)) for n, k in sorted(build.kernels.items())},
        phases=phases,
        memory_total=total,
        roofline=roofline(
            weights,
            kv,
            build.target.dram_bandwidth_bytes_per_s,
            program,
            options.max_batch,
            options.max_seq_len,
        ),
        files={},
    )


def artifact_files(program: Program, build: KernelBuild) -> dict[str, bytes]:
    graphs = "\n".join(dump(graph) for graph in program.phases.values())
    return {CUBIN: build.cubin, SOURCE: build.cuda.source.encode(), GRAPH: graphs.encode()}


def emit(
    out_dir: Path,
    cfg: DrafterConfig,
    options: BuildOptions,
    program: Program,
    build: KernelBuild,
    overwrite: bool = False,
) -> tuple[Path, Manifest]:
    manifest = make_manifest(Path(out_dir).name, cfg, options, program, build)
    sealed = write_artifact(Path(out_dir), manifest, artifact_files(program, build), overwrite=overwrite)
    return Path(out_dir), sealed
