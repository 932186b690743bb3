"""``fp4moe quantize MODEL_DIR OUT_DIR``: a bf16 Hugging Face model to an NVFP4 checkpoint.

``fp4moe.cli`` mounts it as the ``quantize`` command.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

__all__ = ["quantize_command"]


def quantize_command(
    model_dir: Annotated[Path, typer.Argument(help="bf16 Hugging Face model folder (config.json + safetensors).")],
    out_dir: Annotated[Path, typer.Argument(help="Folder for the NVFP4 checkpoint; must not exist or be empty.")],
    format: Annotated[str, typer.Option(
        "--format", help="Checkpoint format: modelopt or compressed-tensors.")] = "modelopt",
    exclude: Annotated[Optional[list[str]], typer.Option(
        "--exclude", help="Module pattern to keep in bf16 (fnmatch, or re:REGEX); repeat for more, "
                          "e.g. --exclude 'model.layers.*.self_attn*'.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace a checkpoint fp4moe wrote in OUT_DIR (a folder with fp4moe_checkpoint.json) once the new one is complete; other folders are refused.")]
    = False,
    max_shard_size: Annotated[str, typer.Option(help="Largest shard, e.g. 5GB, 500MB.")] = "5GB",
    progress: Annotated[bool, typer.Option(help="Show a progress bar on stderr.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for machines instead of a table.")] = False,
) -> None:
    """Quantize a bf16 model's linear layers to NVFP4 and write a ModelOpt or compressed-tensors checkpoint."""
    from .errors import CheckpointError
    from .writer import WRITE_FORMATS, parse_size, write_checkpoint

    fmt = format.strip().lower()
    if fmt not in WRITE_FORMATS:
        raise typer.BadParameter(f"expected one of {', '.join(WRITE_FORMATS)}, got {format!r}", param_hint="--format")
    try:
        max_bytes = parse_size(max_shard_size)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--max-shard-size") from None
    try:
        report = write_checkpoint(model_dir, out_dir, fmt, exclude or [], overwrite=overwrite,  # type: ignore[arg-type]
                                  progress=progress and not as_json, max_shard_bytes=max_bytes)
    except CheckpointError as err:
        from ..cli_terms import cli_terms  # the library's message in the command line's terms

        Console(stderr=True).print(f"[red]error:[/red] {cli_terms(str(err))}", markup=True, highlight=False)
        raise typer.Exit(1) from None
    summary = {
        "out_dir": str(report.out_dir),
        "format": report.format,
        "quantized_linears": len(report.quantized),
        "kept_unquantized": report.kept,
        "shards": list(report.shards),
        "bytes_in": report.bytes_in,
        "bytes_out": report.bytes_out,
    }
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    console = Console()
    table = Table(title=f"wrote {report.format} NVFP4 checkpoint {report.out_dir}", show_header=False,
                  title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_row("quantized linears", f"{len(report.quantized):,}")
    reasons: dict[str, int] = {}
    for why in report.kept.values():
        reasons[why] = reasons.get(why, 0) + 1
    table.add_row("kept unquantized", ", ".join(f"{n} {why}" for why, n in sorted(reasons.items())) or "none")
    table.add_row("shards", f"{len(report.shards)}")
    table.add_row("size", f"{report.bytes_in / 1e6:,.1f} MB -> {report.bytes_out / 1e6:,.1f} MB "
                          f"({report.bytes_out / max(report.bytes_in, 1):.0%})")
    console.print(table)
