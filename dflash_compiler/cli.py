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
    drafter_dir: Annotated[Path, typer.Argument(help="HF drafter directory (config.json [+ *.safetensors])")],
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
