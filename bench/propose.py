"""The drafter step on the GPU: ours vs a PyTorch implementation of the same step vs the memory roofline.

One step = append 7 new context rows per sequence + propose one block of 16 per sequence, with 4096
context rows already cached, for nb ∈ {1, 4, 8, 16} sequences of the Qwen3-8B-DFlash-b16 shape.

    # build box (TVM, no GPU): the sm_90 artifacts (bf16 and FP8, each also with plain launches),
    # kernels and plans only
    python bench/propose.py build -o build/propose [--variants bf16 fp8] [--knob RULE.KNOB=INT ...]
    #   [--no-weight-tiles]  (the linears' weights row-major instead of as 64 x 64 tiles: an A/B)
    # GPU box (numpy, ml_dtypes, pydantic, cuda-python, torch for the peer)
    PYTHONPATH=. python bench/propose.py run build/propose --json build/propose/results.json

`run` makes the example's random checkpoint, packs each artifact (numpy only), fills every sequence's cache, and
measures in one process: our step (both phases replayed as one CUDA graph, as `Drafter.step` does, GPU time
between events, each step queued whole behind a host gate so that submitting it is not timed; also each phase as
its own graph, and the host's wall time of a step through the API, `step` against `append_context` then
`propose`, first calls with their graph captures apart), the PyTorch peer (static cache, fused projections, SDPA,
the whole step in one CUDA graph, timed behind the same gate) and the roofline (bytes one step must read ÷ the
device-to-device copy bandwidth measured in the same run). It prints ms (median of >= 30), GB/s, % of roofline
and the ratio to PyTorch per nb, a per-kernel breakdown of our step, and with `--timeline NB...` (torch.profiler,
so torch is needed) when each kernel of one replayed step ran. `--batches NB...` measures only those nb (a
profiler run, an A/B of two bundles). Given several bundles, `run` measures each one's variants in turn in the
same process (one checkpoint, one copy bandwidth, one PyTorch peer), labelled by bundle directory: an A/B of two
builds. Later bundles measure slower: on an H100 one build measured first and again third (two copies, three
bundles) took 1.487 / 1.739 / 2.482 ms and 1.497 / 1.750 / 2.509 ms at nb = 4 / 8 / 16. So give the candidate
between two copies of its baseline (directories of different names) and compare it with both.
Correctness is the GPU tests' job (tests/gpu): the peer's cache holds random rows, so its drafts are not
compared.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.torch_peer import TorchPeer, torch_weights  # noqa: E402  (the repository root is on the path now)

EXAMPLE = "qwen3-8b-dflash-b16"
BATCHES = (1, 4, 8, 16)
CACHED = 4096
NEW_ROWS = 7
REPEATS = 30
# (name, precision, dependent launch): the defaults launch every kernel as a programmatic dependent of the
# one before it (BuildOptions.dependent_launch), the "-plain" builds do not
VARIANTS = (
    ("bf16", "bf16", True),
    ("fp8", "fp8", True),
    ("bf16-plain", "bf16", False),
    ("fp8-plain", "fp8", False),
)
VARIANT_NAMES = tuple(name for name, _, _ in VARIANTS)


# ------------------------------------------------------------------------------------------ build box


def build(args: argparse.Namespace) -> None:
    from dflash_compiler.checkpoint import example_config_path
    from dflash_compiler.config import load_drafter_config
    from dflash_compiler.options import BuildOptions, Precision, knob_overrides
    from dflash_compiler.pipeline import compile_drafter
    from dflash_compiler.targets import SM90

    cfg = load_drafter_config(example_config_path(EXAMPLE))
    knobs = knob_overrides(args.knob)
    for variant, precision, dependent in VARIANTS:
        if variant not in args.variants:
            continue
        options = BuildOptions(
            max_batch=max(BATCHES),
            max_seq_len=CACHED + 64,
            max_ctx_rows=512,
            precision=Precision(precision),
            dependent_launch=dependent,
            weight_tiles=args.weight_tiles,
            knobs=knobs,
        )
        out = Path(args.out) / f"{EXAMPLE}-sm_90-{variant}"
        _, manifest = compile_drafter(cfg, options, SM90, out, overwrite=True)
        print(f"{out}: {len(manifest.kernels)} kernels, predicted {manifest.roofline.predicted_us}")


# -------------------------------------------------------------------------------------------- GPU box


def _step_bytes(manifest: Any, nb: int) -> int:
    """DRAM bytes one step must read: every weight either phase streams, once (the manifest's roofline leaves
    out tables only gathered from, like embed_tokens), and each sequence's cached K/V."""
    roof = manifest.roofline
    return roof.weight_bytes + roof.context_weight_bytes + nb * (CACHED + NEW_ROWS) * roof.kv_bytes_per_cached_row


FILL_ROWS = 512


def _fill(drafter: Any, nb: int, pool: np.ndarray) -> None:
    """Create `nb` sequences holding CACHED context rows each, appended in FILL_ROWS-row pieces of `pool`
    (random bf16 taps drawn once per run: the cached values do not change what a step reads or computes,
    and drawing 4096 fresh rows of 20480 features per sequence cost more than the measurement)."""
    for seq in range(nb):
        drafter.create(seq)
        for start in range(0, CACHED, FILL_ROWS):
            rows = min(FILL_ROWS, CACHED - start)
            drafter.append_context([seq], [pool[:rows]], [np.arange(start, start + rows)])


def _ours(drafter: Any, nb: int, rng: np.random.Generator, timeline: bool = False) -> dict[str, Any]:
    """GPU time of one step (both phases as one CUDA graph, as `Drafter.step` replays them), median of REPEATS;
    the same with each phase its own graph; the host's wall time of a step through the public API (`_api_ms`);
    a per-call breakdown and, with `timeline`, when each kernel of one replayed step ran (`_timeline`)."""
    from dflash_compiler.runtime.steps import context_step, padded_context, propose_step

    m = drafter.manifest
    kv = m.kv_cache
    append, propose = drafter.phases["append_context"], drafter.phases["propose"]
    width = int(append.plan.values["taps"].shape[1])
    seqs = list(range(nb))
    positions = [np.arange(CACHED, CACHED + NEW_ROWS)] * nb
    # padded as Drafter.step pads them: what the API launches
    ctx = padded_context(context_step(drafter.pages, seqs, positions), append.maxima["ctx"], kv.page_size)
    taps = np.zeros((len(ctx.slots), width), _bf16())
    taps[: nb * NEW_ROWS] = rng.standard_normal((nb * NEW_ROWS, width), np.float32)
    append.write_input("taps", taps, drafter.stream)
    append.write_input("ctx_positions", ctx.positions, drafter.stream)
    append.write_input("ctx_slots", ctx.slots, drafter.stream)
    step = propose_step(drafter.pages, seqs, m.block_size, kv.pages_per_seq)  # lengths include the new rows
    propose.write_input(
        "anchors", rng.integers(0, m.weights["target.embed_tokens"].shape[0], nb).astype(np.int32), drafter.stream
    )
    propose.write_input("blk_positions", step.positions, drafter.stream)
    propose.write_input("block_table", step.block_table, drafter.stream)
    propose.write_input("cache_lens", step.cache_lens, drafter.stream)
    dims_a = {"ctx": len(ctx.slots), "pages": kv.num_pages}
    dims_p = {"nb": nb, "blk": m.block_size, "pages": kv.num_pages, "maxp": kv.pages_per_seq}
    phases = [(append, dims_a), (propose, dims_p)]

    def one_graph() -> None:  # what Drafter.step replays
        drafter.graphs.run(phases, drafter.stream)

    def two_graphs() -> None:  # each phase's own graph, as append_context then propose would replay them
        drafter.graphs.run(phases[:1], drafter.stream)
        drafter.graphs.run(phases[1:], drafter.stream)

    samples = {name: _gpu_ms(drafter, launch) for name, launch in (("one", one_graph), ("two", two_graphs))}
    taps = [rng.standard_normal((NEW_ROWS, width), np.float32).astype(_bf16()) for _ in seqs]
    anchors = [int(a) for a in rng.integers(0, m.weights["target.embed_tokens"].shape[0], nb)]
    return {
        "ms": statistics.median(samples["one"]),
        "samples": samples["one"],
        "two_graphs_ms": statistics.median(samples["two"]),
        "api_ms": _api_ms(drafter, seqs, taps, positions, anchors),
        "breakdown": _breakdown(drafter, phases),
        "timeline": _timeline(drafter, phases) if timeline else None,
        "anchors": propose.read_value("anchors", dims_p, np.int32, drafter.stream),
    }


def _gpu_ms(drafter: Any, launch: Any) -> list[float]:
    """GPU ms of REPEATS steps queued by `launch`, each between two events, after one warm-up step. Each step is
    queued whole behind a host gate (`HostGate`) before the GPU may start it, so the host's time to submit it
    (a graph launch from Python) is not in the figure."""
    from dflash_compiler.runtime.cuda import EventTimer, HostGate

    launch()
    drafter.stream.synchronize()
    samples = []
    with HostGate() as gate:
        for _ in range(REPEATS):
            with gate.held(drafter.stream.handle), EventTimer(drafter.stream.handle) as timer:
                launch()
            samples.append(timer.elapsed_ms())
    return samples


def _api_ms(
    drafter: Any, seqs: list[int], taps: list[Any], positions: list[Any], anchors: list[int]
) -> dict[str, float]:
    """Host wall time of one step through the public API, median of REPEATS, drafts read back each time:
    `step` (one graph) against `append_context` then `propose` (a graph each, with a synchronisation on the
    host between them); and of each one's first call, which captures its graphs. The same rows are
    rewritten each time, so the cache lengths stay put."""
    from dflash_compiler.protocol import ContextRows

    out = {}
    calls = {
        "step": lambda: drafter.step(ContextRows(seqs, taps, positions), seqs, anchors),
        "append_context+propose": lambda: (
            drafter.append_context(seqs, taps, positions),
            drafter.propose(seqs, anchors),
        ),
    }
    drafter.graphs.close()  # the first step then captures its graph, as a new (rows, sequences) combination does
    for name, call in calls.items():
        start = time.perf_counter()
        call()
        out[f"{name} (first)"] = (time.perf_counter() - start) * 1e3
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            call()
            times.append((time.perf_counter() - start) * 1e3)
        out[name] = statistics.median(times)
    return out


def _breakdown(drafter: Any, phases: list[tuple[Any, dict[str, int]]]) -> list[tuple[str, str, float]]:
    """(node, kernel, µs) of every launch, median of 10 rounds: plain launches one after the other with an
    event between each two (events inside a captured graph cannot be timed). Each round is queued whole
    behind a host gate, so host launch latency (Python, tens of µs per launch) never shows up as GPU time."""
    from cuda.bindings import driver as cu

    from dflash_compiler.runtime.cuda import HostGate, check

    launches, labels = [], []
    for phase, dims in phases:
        for p in phase.prepared(dims):
            launches.append((phase, p))
            labels.append((p.node, p.launch.name))
    events = [check(cu.cuEventCreate(0), "cuEventCreate") for _ in range(len(launches) + 1)]
    handle = drafter.stream.handle
    per: list[list[float]] = [[] for _ in labels]
    with HostGate() as gate:
        for _ in range(10):
            with gate.held(handle):
                check(cu.cuEventRecord(events[0], handle), "cuEventRecord")
                for i, (phase, p) in enumerate(launches):
                    phase.module.launch(p.launch, p.pointers, p.env, handle)
                    check(cu.cuEventRecord(events[i + 1], handle), "cuEventRecord")
            drafter.stream.synchronize()
            for i in range(len(labels)):
                elapsed = check(cu.cuEventElapsedTime(events[i], events[i + 1]), "cuEventElapsedTime")
                per[i].append(float(elapsed) * 1e3)
    for event in events:
        check(cu.cuEventDestroy(event), "cuEventDestroy")
    return [(node, kernel, statistics.median(t)) for (node, kernel), t in zip(labels, per, strict=True)]


def _timeline(drafter: Any, phases: list[tuple[Any, dict[str, int]]]) -> list[dict[str, Any]]:
    """When each kernel of one step ran, as the graphs replay it: (node, kernel, start, end) in µs from the
    step's first kernel, from the CUDA profiler's kernel records (torch.profiler, i.e. CUPTI), of the last of
    three replayed steps. Unlike `_breakdown`, nothing separates the kernels, so under dependent launch a
    kernel starts before the one before it ends; `timeline_summary` says what each adds to the step."""
    from torch.profiler import ProfilerActivity, profile

    labels = [(p.node, p.launch.name) for phase, dims in phases for p in phase.prepared(dims)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            drafter.graphs.run(phases, drafter.stream)
        drafter.stream.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        records = json.loads(trace.read_text())["traceEvents"]
    kernels = sorted((e for e in records if e.get("cat") == "kernel"), key=lambda e: float(e["ts"]))
    if len(kernels) < 3 * len(labels):
        raise RuntimeError(
            f"the profiler recorded {len(kernels)} kernels of 3 steps of {len(labels)} launches each; expected all "
            "of them (CUPTI kernel tracing of the graphs' kernel nodes)"
        )
    last = kernels[-len(labels) :]
    names = [e["name"] for e in last]
    if names != [kernel for _, kernel in labels]:
        raise RuntimeError(f"the profiled kernels {names[:4]}... are not the step's launches in order")
    t0 = float(last[0]["ts"])
    return [
        {"node": node, "kernel": kernel, "start": float(e["ts"]) - t0, "end": float(e["ts"]) + float(e["dur"]) - t0}
        for (node, kernel), e in zip(labels, last, strict=True)
    ]


def _attributed(timeline: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], float, float]]:
    """Each launch of `timeline` in order with the idle gap before it (no kernel ran) and what it adds to the
    span: how far its end moves the latest end so far (0 where it ends inside a launch before it, as
    dependent launches can), so the adds sum to the span."""
    span = 0.0
    for e in timeline:
        yield e, max(0.0, e["start"] - span), max(0.0, e["end"] - span)
        span = max(span, e["end"])


def timeline_summary(timeline: list[dict[str, Any]]) -> dict[str, Any]:
    """The step's span, its kernels' busy time, the idle gaps where no kernel ran, and per kernel its
    launches and what they add to the span (`_attributed`)."""
    busy = sum(e["end"] - e["start"] for e in timeline)
    span = max((e["end"] for e in timeline), default=0.0)
    added: dict[str, list[float]] = {}
    idle = 0.0
    for e, gap, adds in _attributed(timeline):
        idle += gap
        row = added.setdefault(e["kernel"], [0, 0.0])
        row[0] += 1
        row[1] += adds
    kernels = [
        {"kernel": k, "launches": int(n), "adds": t} for k, (n, t) in sorted(added.items(), key=lambda kv: -kv[1][1])
    ]
    return {"span": span, "busy": busy, "idle": idle, "kernels": kernels}


GATHERED_PARAMS = ("table",)  # embed's table: a few rows gathered per step, left out of the roofline as well


def node_floors(manifest: Any, nb: int, bandwidth: float) -> dict[str, float]:
    """µs each node of a step takes at least: the DRAM bytes it must read at the copy bandwidth. Those are the
    weights it streams (each counted at its first reader; a table only gathered from is not streamed) and, for
    an attention node, its layer's share of every sequence's cached K/V. Their bytes add up to `_step_bytes`,
    checked here, so the floors sum to the roofline."""
    from dflash_compiler.plans import dtype_bytes

    weights, nbytes, seen = manifest.weights, {}, set()
    attention = [
        c.node for phase in manifest.phases.values() for c in phase.calls if any(b.param == "kv" for b in c.buffers)
    ]
    kv_bytes = nb * (CACHED + NEW_ROWS) * manifest.roofline.kv_bytes_per_cached_row
    for phase in manifest.phases.values():
        for call in phase.calls:
            n = 0
            if call.node in attention:  # shares of kv_bytes that add up to it exactly
                i = attention.index(call.node)
                n = kv_bytes * (i + 1) // len(attention) - kv_bytes * i // len(attention)
            for b in call.buffers:
                if b.value in weights and b.value not in seen and b.param not in GATHERED_PARAMS:
                    seen.add(b.value)
                    n += math.prod(weights[b.value].shape) * dtype_bytes(weights[b.value].dtype)
            nbytes[call.node] = nbytes.get(call.node, 0) + n
    total, expected = sum(nbytes.values()), _step_bytes(manifest, nb)
    if total != expected:
        raise RuntimeError(
            f"the nodes' floors add up to {total} bytes, the step's roofline to {expected}; expected them equal "
            f"(a weight read another way than streamed or gathered through {GATHERED_PARAMS})"
        )
    return {node: n / bandwidth * 1e6 for node, n in nbytes.items()}


def _kind(node: str) -> str:
    """A node's name without its layer prefix `lN.`: what the layers' copies of it share."""
    return re.sub(r"^l\d+\.", "", node)


def beyond_roofline(timeline: list[dict[str, Any]], floors: dict[str, float]) -> list[dict[str, Any]]:
    """Where a step loses against its roofline: per kind of node (`_kind`), the launches, the µs they add to
    the span (`_attributed`), the µs their bytes take at copy speed (`node_floors`) and the difference,
    largest first. The differences add up to the span minus the roofline."""
    rows: dict[str, list[float]] = {}
    for e, _, adds in _attributed(timeline):
        row = rows.setdefault(_kind(e["node"]), [0, 0.0, 0.0])
        row[0] += 1
        row[1] += adds
    for node, floor in floors.items():
        rows.setdefault(_kind(node), [0, 0.0, 0.0])[2] += floor
    out = [{"node": k, "launches": int(n), "adds": a, "floor": f, "over": a - f} for k, (n, a, f) in rows.items()]
    return sorted(out, key=lambda r: -r["over"])


def _print_timeline(summary: dict[str, Any]) -> None:
    """A `timeline_summary` as a table, every kernel that adds at least 1 µs, then `beyond_roofline`."""
    print(
        f"    timeline: span {summary['span']:.1f} µs, kernels busy {summary['busy']:.1f} µs, "
        f"idle between kernels {summary['idle']:.1f} µs"
    )
    for row in summary["kernels"]:
        if row["adds"] >= 1.0:
            per = row["adds"] / row["launches"]
            print(f"      {row['kernel'][:60]:60s} x{row['launches']:<3d} adds {row['adds']:8.1f} µs ({per:6.1f} each)")
    if summary.get("beyond_roofline"):
        print("    beyond the roofline, per kind of node: µs added to the span, µs of its bytes at copy speed")
        for row in summary["beyond_roofline"]:
            if abs(row["over"]) >= 1.0:
                print(
                    f"      {row['node'][:28]:28s} x{row['launches']:<3d} adds {row['adds']:8.1f}  bytes "
                    f"{row['floor']:8.1f}  over {row['over']:+8.1f} µs"
                )


def _bf16() -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16


def _artifact(bundle: Path, variant: str) -> Path:
    return bundle / f"{EXAMPLE}-sm_90-{variant}"


def run(args: argparse.Namespace) -> int:
    from dflash_compiler.checkpoint import write_example
    from dflash_compiler.config import load_drafter_config
    from dflash_compiler.kernel_check import copy_bandwidth
    from dflash_compiler.pack import pack_weights
    from dflash_compiler.runtime.cuda import Device
    from dflash_compiler.runtime.drafter import Drafter

    device = Device()
    bandwidth = copy_bandwidth(device)
    print(f"device: {device.name}   copy bandwidth (D2D, read+write): {bandwidth / 1e9:.0f} GB/s")
    work = Path(tempfile.mkdtemp(prefix="propose-bench-"))
    write_example(EXAMPLE, work / "ckpt", seed=0)
    cfg = load_drafter_config(work / "ckpt" / "drafter")
    results: dict[str, Any] = {"device": device.name, "copy_gbps": bandwidth / 1e9, "rows": [], "load": {}}
    peer_ms: dict[int, float] = {}
    pool: np.ndarray | None = None  # the taps every sequence's cache is filled from (_fill)
    # several bundles (an A/B of two builds): each variant of each, against the same checkpoint and bandwidth
    wanted = [(Path(bundle), variant) for bundle in args.bundle for variant in args.variants]
    runs = [(bundle, variant) for bundle, variant in wanted if _artifact(bundle, variant).is_dir()]
    empty = [bundle for bundle in args.bundle if all(built != Path(bundle) for built, _ in runs)]
    if empty:
        raise SystemExit(
            f"{', '.join(empty)}: no artifact of variant {' or '.join(args.variants)}. Fix: build them "
            "(bench/propose.py build -o DIR --variants ...)"
        )
    for bundle, variant in wanted:  # an A/B's candidate may be built in one variant only
        if (bundle, variant) not in runs:
            print(f"{_artifact(bundle, variant)}: not built, not measured")
    for index, (bundle, variant) in enumerate(runs):
        precision, dependent = {name: (p, d) for name, p, d in VARIANTS}[variant]
        label = f"{bundle.name}/{variant}" if len(args.bundle) > 1 else variant
        artifact = _artifact(bundle, variant)
        local = work / f"{index}-{label.replace('/', '-')}"  # a bundle given twice (a repeat) gets a copy each
        shutil.copytree(artifact, local)
        pack_weights(local, work / "ckpt" / "drafter", work / "ckpt" / "target")
        torch_here = variant == "bf16" and not args.no_torch and not peer_ms
        if torch_here:
            tw = torch_weights(local)
        print(f"\n== {label}: {artifact}")
        head = ("nb", "ours ms", "torch ms", "roof ms", "GB/s", "% roof", "x roof", "vs torch")
        print("{:>3} {:>9} {:>9} {:>8} {:>7} {:>7} {:>7} {:>8}".format(*head))
        start = time.perf_counter()
        drafter = Drafter.load(local, device=device)
        full_s = time.perf_counter() - start
        if drafter.manifest.options.dependent_launch != dependent:
            raise SystemExit(
                f"{artifact}: built with dependent_launch={drafter.manifest.options.dependent_launch}, but variant "
                f"{variant} means {dependent}; rebuild it with `bench/propose.py build`"
            )
        # the same artifact with every weight borrowed (what a serving engine holding them does): manifest,
        # hashes of what it reads, cubin, launch plans, KV cache
        start = time.perf_counter()
        Drafter.load(local, device=device, external_weights=drafter.weights).close()
        bare_s = time.perf_counter() - start
        weight_gb = (local / "weights.safetensors").stat().st_size / 1e9
        print(
            f"load: {bare_s:.2f} s with every weight borrowed; {full_s:.2f} s reading and uploading {weight_gb:.2f} GB"
        )
        results["load"][label] = {"borrowed_weights_s": bare_s, "with_weights_s": full_s, "weights_gb": weight_gb}
        for nb in args.batches:
            rng = np.random.default_rng(nb)
            width = int(drafter.phases["append_context"].plan.values["taps"].shape[1])
            if pool is None or pool.shape[1] != width:
                pool = np.random.default_rng(0).standard_normal((FILL_ROWS, width), np.float32).astype(_bf16())
            _fill(drafter, nb, pool)
            ours = _ours(drafter, nb, rng, timeline=nb in args.timeline)
            nbytes = _step_bytes(drafter.manifest, nb)
            roof_ms = nbytes / bandwidth * 1e3
            summary = timeline_summary(ours["timeline"]) if ours["timeline"] else None
            if summary:
                summary["beyond_roofline"] = beyond_roofline(
                    ours["timeline"], node_floors(drafter.manifest, nb, bandwidth)
                )
            if torch_here:
                import torch

                peer = TorchPeer(tw, cfg, nb, CACHED, NEW_ROWS)
                peer.anchors.copy_(torch.from_numpy(ours["anchors"].astype(np.int64)).cuda())
                peer.capture()
                peer_ms[nb] = statistics.median(peer.time(REPEATS))
                del peer
                torch.cuda.empty_cache()
            ratio = ours["ms"] / peer_ms[nb] if nb in peer_ms else float("nan")
            gbps = nbytes / (ours["ms"] * 1e-3) / 1e9
            print(
                f"{nb:>3} {ours['ms']:9.3f} {peer_ms.get(nb, float('nan')):9.3f} {roof_ms:8.3f} {gbps:7.0f} "
                f"{100 * roof_ms / ours['ms']:6.1f}% {ours['ms'] / roof_ms:7.2f} {ratio:8.2f}"
            )
            api = ours["api_ms"]
            print(
                f"    two graphs (one a phase) {ours['two_graphs_ms']:.3f} ms; through the API (host wall time, "
                + ", ".join(f"{name} {ms:.3f} ms" for name, ms in api.items())
                + ")"
            )
            results["rows"].append(
                {
                    "variant": variant,
                    "bundle": str(bundle),
                    "precision": precision,
                    "nb": nb,
                    "ours_ms": ours["ms"],
                    "two_graphs_ms": ours["two_graphs_ms"],
                    "api_ms": api,
                    "torch_ms": peer_ms.get(nb),
                    "roofline_ms": roof_ms,
                    "bytes": nbytes,
                    "gbps": gbps,
                    "x_roofline": ours["ms"] / roof_ms,
                    "ratio_to_torch": ratio,
                    "breakdown": ours["breakdown"],
                    "timeline": ours["timeline"],
                    "timeline_summary": summary,
                }
            )
            if nb in (1, max(BATCHES)):
                total = sum(t for _, _, t in ours["breakdown"])
                print(f"    per-kernel (nb={nb}, sum {total / 1e3:.3f} ms):")
                by_kernel: dict[str, float] = {}
                for _node, kernel, t in ours["breakdown"]:
                    by_kernel[kernel] = by_kernel.get(kernel, 0.0) + t
                for kernel, t in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:12]:
                    print(f"      {kernel:48s} {t:9.1f} µs  {100 * t / total:5.1f}%")
            if summary:
                _print_timeline(summary)
            if args.json:  # after every row: a run cut short by a time limit keeps what it measured
                _write_json(Path(args.json), results)
            for seq in range(nb):
                drafter.free(seq)
        drafter.close()
    _print_speedups(results["rows"])
    return 0


def _print_speedups(rows: list[dict[str, Any]]) -> None:
    """bf16 ms ÷ FP8 ms per nb, for each bundle measured in both precisions (the issue's FP8 target)."""
    ms = {(row["bundle"], row["precision"], row["nb"]): row["ours_ms"] for row in rows}
    for bundle, precision, nb in ms:
        if precision == "fp8" and (bundle, "bf16", nb) in ms:
            speedup = ms[(bundle, "bf16", nb)] / ms[(bundle, "fp8", nb)]
            print(f"{bundle}: FP8 {speedup:.3f}x faster than bf16 at nb={nb}")


def _write_json(path: Path, results: dict[str, Any]) -> None:
    """`results` as JSON at `path`, replaced whole (written beside it, then renamed)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(results, indent=1, default=float))
    partial.replace(path)


def main() -> int:
    from dflash_compiler.options import BuildOptions

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build box: the bf16 and FP8 sm_90 artifacts")
    b.add_argument("-o", "--out", required=True)
    b.add_argument("--variants", nargs="*", default=list(VARIANT_NAMES), choices=VARIANT_NAMES)
    b.add_argument(
        "--weight-tiles",
        action=argparse.BooleanOptionalAction,
        default=BuildOptions.model_fields["weight_tiles"].default,
        help="the linears' weights as 64 x 64 tiles, else row-major (an A/B: --no-weight-tiles)",
    )
    b.add_argument(
        "--knob",
        action="append",
        default=[],
        metavar="RULE.KNOB=INT",
        help="schedule knob over the default in every variant built (repeatable): one side of an A/B",
    )
    r = sub.add_parser("run", help="GPU box: pack, fill the caches, measure")
    r.add_argument(
        "bundle",
        nargs="+",
        help="one bundle, or several to compare in one run (an A/B of two builds; one given twice runs twice)",
    )
    r.add_argument("--variants", nargs="*", default=list(VARIANT_NAMES), choices=VARIANT_NAMES)
    r.add_argument("--no-torch", action="store_true", help="skip the PyTorch peer")
    r.add_argument(
        "--batches",
        nargs="*",
        type=int,
        default=list(BATCHES),
        choices=BATCHES,
        metavar="NB",
        help="measure these nb only",
    )
    r.add_argument(
        "--timeline",
        nargs="*",
        type=int,
        default=[],
        choices=BATCHES,
        metavar="NB",
        help="also record when each kernel ran in one replayed step at these nb (torch.profiler)",
    )
    r.add_argument("--json")
    args = parser.parse_args()
    if args.command == "build":
        build(args)
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
