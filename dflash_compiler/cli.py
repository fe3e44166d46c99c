"""`dflash-compile`: the command-line front of the compiler."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from dflash_compiler.errors import InputError

app = typer.Typer(
    name="dflash-compile",
    help="Compile DFlash / DFlash2 / DSpark drafter heads into CUDA artifacts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


# Build options shared by `plan` and `compile` (one declaration each; BuildOptions validates them).
DrafterDir = Annotated[Path, typer.Argument(help="HF drafter directory (config.json [+ *.safetensors])")]
BlockSize = Annotated[int | None, typer.Option(help="serve with this block size")]
MaxBatch = Annotated[int, typer.Option(help="sequences per propose step")]
MaxSeqLen = Annotated[int, typer.Option(help="longest sequence the KV cache admits")]
MaxCtxRows = Annotated[int, typer.Option(help="most context rows one append takes")]
PrecisionOpt = Annotated[str, typer.Option(help="bf16, fp8 or auto")]
Exclude = Annotated[list[str] | None, typer.Option(help="glob of linears kept in bf16 (repeatable)")]
KVBudget = Annotated[int | None, typer.Option(help="size the KV pool from a byte budget")]
DumpDir = Annotated[Path | None, typer.Option("--dump-dir", help="write every phase's graph after each step")]
Knob = Annotated[
    list[str] | None,
    typer.Option(
        help="schedule knob over the target's default, RULE.KNOB=INT (repeatable; `inspect` lists each kernel's "
        "rule and knobs), recorded in the manifest"
    ),
]


def _fail(error: InputError) -> typer.Exit:
    err_console.print(f"[bold red]error[/]: {error.subject}: {len(error.problems)} problem(s)")
    for p in error.problems:
        err_console.print(f"  [red]-[/] [bold]{p.where}[/]: found {p.found}; expected {p.expected}.")
        err_console.print(f"    fix: {p.fix}")
    return typer.Exit(code=1)


def _print_rows(title: str, rows: list[tuple[str, str]]) -> None:
    table = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for label, value in rows:
        table.add_row(label, value)
    console.print(table)


@app.command()
def validate(
    drafter_dir: DrafterDir,
    target_model: Annotated[
        Path | None, typer.Option("--target-model", help="target model directory (config.json + safetensors)")
    ] = None,
    check_values: Annotated[bool, typer.Option(help="scan every tensor for NaN/Inf")] = True,
) -> None:
    """Validate a drafter (and optionally its target) and print a summary; exit 1 listing every problem."""
    from dflash_compiler.config import load_drafter_config
    from dflash_compiler.summary import config_rows
    from dflash_compiler.target_model import check_target, load_target
    from dflash_compiler.weights import WeightSet, check_drafter_weights, has_safetensors

    try:
        cfg = load_drafter_config(drafter_dir)
        rows = config_rows(cfg)
        if drafter_dir.is_dir() and has_safetensors(drafter_dir):
            report = check_drafter_weights(cfg, WeightSet(drafter_dir), check_values=check_values)
            rows += report.rows()
        else:
            rows.append(("weights", "not checked (config.json only)"))
        if target_model is not None:
            target = load_target(target_model, cfg)
            rows += check_target(cfg, target, check_values=check_values).rows()
    except InputError as error:
        raise _fail(error) from None
    _print_rows(f"drafter {drafter_dir}", rows)
    console.print("[bold green]valid[/]")


@app.command("make-example")
def make_example(
    name: Annotated[str, typer.Argument(help="bundled example name (see `examples`) or a path to a config.json")],
    out: Annotated[Path, typer.Argument(help="output directory (gets drafter/ and target/)")],
    seed: Annotated[int, typer.Option(help="random seed; same seed, same bytes")] = 0,
    dtype: Annotated[str, typer.Option(help="storage dtype: bf16 or fp32")] = "bf16",
    target_shards: Annotated[int, typer.Option(help="write the target as this many safetensors shards")] = 1,
    force: Annotated[bool, typer.Option("--force", help="replace an existing drafter/ and target/ in OUT")] = False,
) -> None:
    """Write a random-weight drafter checkpoint and a matching target checkpoint."""
    from dflash_compiler.checkpoint import write_example

    try:
        written = write_example(name, out, seed=seed, dtype=dtype, target_shards=target_shards, overwrite=force)
    except InputError as error:
        raise _fail(error) from None
    console.print(f"wrote drafter to [bold]{written.drafter_dir}[/] and target to [bold]{written.target_dir}[/]")


@app.command()
def plan(
    drafter_dir: DrafterDir,
    target_model: Annotated[
        Path | None, typer.Option("--target-model", help="target model directory (needed for precision auto)")
    ] = None,
    block_size: BlockSize = None,
    max_batch: MaxBatch = 16,
    max_seq_len: MaxSeqLen = 8192,
    max_ctx_rows: MaxCtxRows = 512,
    precision: PrecisionOpt = "bf16",
    exclude: Exclude = None,
    kv_budget_bytes: KVBudget = None,
    dump_dir: DumpDir = None,
) -> None:
    """Lower the drafter, run every graph pass and print the KV-cache, precision and memory plans."""
    from dflash_compiler.config import load_drafter_config
    from dflash_compiler.pipeline import optimize

    try:
        cfg = load_drafter_config(drafter_dir)
        options = _build_options(
            block_size=block_size,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            max_ctx_rows=max_ctx_rows,
            precision=precision,
            exclude=tuple(exclude or ()),
            kv_budget_bytes=kv_budget_bytes,
        )
        tensors = _checkpoint_tensors(cfg, drafter_dir, target_model)
        program = optimize(
            cfg,
            options,
            tensors=tensors,
            dump_dir=dump_dir,
            on_step=lambda label: console.print(f"  pass [bold]{label}[/] done"),
        )
    except InputError as error:
        raise _fail(error) from None
    rows = []
    for phase, graph in program.phases.items():
        rows.append((f"{phase} nodes", str(len(graph))))
        for key in ("kv_cache", "precision", "memory"):
            if key in graph.meta and not (key == "kv_cache" and phase != "propose"):
                rows.append((f"{phase} {key}", graph.meta[key].summary()))
    _print_rows(f"plan {drafter_dir}", rows)
    if dump_dir is not None:
        console.print(f"graphs written to [bold]{dump_dir}[/]")


def _build_options(**fields: object):
    """BuildOptions from CLI values; a bad value is an InputError naming the option."""
    from pydantic import ValidationError

    from dflash_compiler.errors import Problem
    from dflash_compiler.options import BuildOptions

    try:
        return BuildOptions(**fields)
    except ValidationError as err:
        raise InputError(
            "build options",
            [
                Problem(".".join(map(str, e["loc"])) or "options", repr(e.get("input")), e["msg"], "fix the option")
                for e in err.errors()
            ],
        ) from None


def _checkpoint_tensors(cfg, drafter_dir: Path, target_model: Path | None):
    """A tensor source over the drafter checkpoint and the target's embed/lm_head, when both are there."""
    from dflash_compiler.sources import checkpoint_source
    from dflash_compiler.weights import has_safetensors

    if target_model is None or not has_safetensors(drafter_dir):
        return None
    return checkpoint_source(cfg, drafter_dir, target_model)


@app.command()
def compile(
    drafter_dir: DrafterDir,
    out: Annotated[Path, typer.Option("-o", "--out", help="artifact directory to write")],
    target_model: Annotated[
        Path | None, typer.Option("--target-model", help="target model directory (embed_tokens, lm_head)")
    ] = None,
    target: Annotated[str, typer.Option(help="sm_90, sm_120, sm_121 or auto (the local GPU)")] = "auto",
    block_size: BlockSize = None,
    max_batch: MaxBatch = 16,
    max_seq_len: MaxSeqLen = 8192,
    max_ctx_rows: MaxCtxRows = 512,
    precision: PrecisionOpt = "bf16",
    exclude: Exclude = None,
    kv_budget_bytes: KVBudget = None,
    weights: Annotated[bool, typer.Option(help="pack weights.safetensors when the checkpoints are given")] = True,
    dependent_launch: Annotated[
        bool, typer.Option(help="let each kernel start while the one before it drains (programmatic dependent launch)")
    ] = True,
    weight_tiles: Annotated[
        bool, typer.Option(help="store the linears' own weights as 64 x 64 tiles (else row-major)")
    ] = True,
    force: Annotated[bool, typer.Option(help="replace an existing artifact directory")] = False,
    dump_dir: DumpDir = None,
    knob: Knob = None,
) -> None:
    """Compile a drafter into an artifact: kernels (cubin), plans and manifest, plus packed weights."""
    import time

    from dflash_compiler.artifact import human_summary
    from dflash_compiler.config import load_drafter_config
    from dflash_compiler.errors import DFlashError
    from dflash_compiler.options import knob_overrides
    from dflash_compiler.pack import pack_weights
    from dflash_compiler.pipeline import compile_drafter
    from dflash_compiler.targets import get_target

    started = time.perf_counter()

    def step(label: str) -> None:
        console.print(f"  [bold]{label}[/] done ({time.perf_counter() - started:.1f} s)")

    try:
        cfg = load_drafter_config(drafter_dir)
        options = _build_options(
            block_size=block_size,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            max_ctx_rows=max_ctx_rows,
            precision=precision,
            exclude=tuple(exclude or ()),
            kv_budget_bytes=kv_budget_bytes,
            dependent_launch=dependent_launch,
            weight_tiles=weight_tiles,
            knobs=knob_overrides(knob or ()),
        )
        chosen = get_target(target)
        console.print(f"compiling {drafter_dir} for [bold]{chosen.name}[/] ({chosen.description})")
        tensors = _checkpoint_tensors(cfg, drafter_dir, target_model)
        path, manifest = compile_drafter(
            cfg, options, chosen, out, tensors=tensors, dump_dir=dump_dir, overwrite=force, on_step=step
        )
        if weights and tensors is not None and target_model is not None:
            manifest = pack_weights(path, drafter_dir, target_model)
            step("pack-weights")
    except InputError as error:
        raise _fail(error) from None
    except DFlashError as error:
        err_console.print(f"[bold red]error[/]: {error}")
        raise typer.Exit(code=1) from None
    _print_rows(f"artifact {path}", human_summary(manifest))


@app.command("pack-weights")
def pack_weights_command(
    artifact: Annotated[Path, typer.Argument(help="artifact directory (from `compile`)")],
    drafter_dir: Annotated[Path, typer.Argument(help="the drafter checkpoint it was compiled from")],
    target_model: Annotated[Path, typer.Option("--target-model", help="target model directory")],
) -> None:
    """Write the artifact's weights.safetensors from the checkpoints (numpy only: runs where TVM is absent)."""
    from dflash_compiler.errors import DFlashError
    from dflash_compiler.pack import pack_weights

    try:
        manifest = pack_weights(artifact, drafter_dir, target_model)
    except InputError as error:
        raise _fail(error) from None
    except DFlashError as error:
        err_console.print(f"[bold red]error[/]: {error}")
        raise typer.Exit(code=1) from None
    record = manifest.files["weights.safetensors"]
    console.print(f"packed {len(manifest.weights)} tensors, {record.bytes:,} bytes into {artifact}")


@app.command()
def inspect(artifact: Annotated[Path, typer.Argument(help="artifact directory")]) -> None:
    """Verify an artifact's manifest and files and print what it holds."""
    from dflash_compiler.artifact import human_summary, load_manifest
    from dflash_compiler.errors import DFlashError

    try:
        manifest = load_manifest(artifact, require=())
    except DFlashError as error:
        err_console.print(f"[bold red]error[/]: {error}")
        raise typer.Exit(code=1) from None
    _print_rows(f"artifact {artifact}", human_summary(manifest))
    table = Table("phase", "calls", "kernels")
    for name, plan in manifest.phases.items():
        table.add_row(name, str(len(plan.calls)), str(len({c.kernel for c in plan.calls})))
    console.print(table)
    kernels = Table("kernel", "rule", "knobs")
    for name, record in manifest.kernel_rules.items():
        kernels.add_row(name, record.rule, " ".join(f"{k}={v}" for k, v in record.knobs.items()))
    console.print(kernels)


@app.command()
def run(
    artifact: Annotated[Path, typer.Argument(help="artifact directory with packed weights")],
    drafter_dir: Annotated[Path, typer.Option("--drafter", help="the drafter checkpoint (for the reference)")],
    target_model: Annotated[Path, typer.Option("--target-model", help="target model directory")],
    steps: Annotated[int, typer.Option(help="propose steps")] = 20,
    sequences: Annotated[int, typer.Option(help="sequences, each with a different prompt length")] = 4,
    seed: Annotated[int, typer.Option(help="seed of the random taps and acceptance")] = 0,
    graphs: Annotated[bool, typer.Option(help="replay propose as CUDA graphs")] = True,
) -> None:
    """GPU: run the artifact over a scripted scenario, check its drafts against the reference, print latency."""
    from dflash_compiler.config import load_drafter_config
    from dflash_compiler.errors import DFlashError
    from dflash_compiler.runtime.drafter import Drafter
    from dflash_compiler.selfcheck import default_scenario, self_check
    from dflash_compiler.sources import checkpoint_source

    try:
        cfg = load_drafter_config(drafter_dir)
        drafter = Drafter.load(artifact, use_graphs=graphs)
        tensor = checkpoint_source(cfg, drafter_dir, target_model)
        scenario = default_scenario(sequences, steps, seed)
        result = self_check(drafter, cfg, tensor, scenario, drafter.manifest.precision)
    except InputError as error:
        raise _fail(error) from None
    except DFlashError as error:
        err_console.print(f"[bold red]error[/]: {error}")
        raise typer.Exit(code=1) from None
    console.print(f"{drafter.device.name}: {result.comparison.summary()}")
    console.print(
        f"propose step (host in, drafts out): median {result.median_propose_ms:.3f} ms over "
        f"{len(result.propose_ms)} steps"
    )
    for line in result.comparison.mismatches[:20]:
        err_console.print(f"  [red]-[/] {line}")
    if not result.comparison.ok:
        raise typer.Exit(code=1)


@app.command()
def examples() -> None:
    """List the bundled example drafters."""
    from dflash_compiler.checkpoint import example_config_path, list_examples
    from dflash_compiler.config import load_drafter_config
    from dflash_compiler.tensors import parameter_count

    table = Table("name", "family", "layers", "hidden", "block", "parameters")
    for example in list_examples():
        cfg = load_drafter_config(example_config_path(example))
        table.add_row(
            example,
            cfg.family.value,
            str(cfg.num_layers),
            str(cfg.hidden_size),
            str(cfg.block_size),
            f"{parameter_count(cfg):,}",
        )
    console.print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
