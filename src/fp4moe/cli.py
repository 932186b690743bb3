"""The ``fp4moe`` command. Subcommands plug into ``app``; each prints a table or, with --json, JSON."""

from __future__ import annotations

import json
import platform
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    name="fp4moe",
    help="FP4 (NVFP4, MXFP4) Mixture-of-Experts inference on every NVIDIA generation.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

console = Console()


def _mount_subcommands() -> None:
    from .bench.cli import bench_app
    from .checkpoints.cli import quantize_command
    from .plan.cli import plan_command

    app.add_typer(bench_app, name="bench")
    app.command("quantize")(quantize_command)
    app.command("plan")(plan_command)


_mount_subcommands()

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for machines instead of tables.")]


def _emit_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


def _kv_table(title: str, rows: dict[str, Any]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value")
    for key, value in rows.items():
        table.add_row(key, "—" if value is None else str(value))
    return table


def versions() -> dict[str, str | None]:
    """Versions of what fp4moe runs on (also stamped into benchmark results)."""
    import torch

    import fp4moe

    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency on Linux
        triton_version = None
    return {
        "fp4moe": fp4moe.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda (torch build)": torch.version.cuda,
        "platform": platform.platform(),
    }


@app.command()
def info(
    gpu: Annotated[Optional[str], typer.Option(help="Show this catalogue GPU instead of the one in hand, e.g. 'rtx pro 6000'.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """The GPU in hand (or 'no GPU'), the software versions, and the catalogue entry."""
    from . import arch

    detected = arch.detect()
    if gpu is not None:
        try:
            entry: arch.GPU | None = arch.find_gpu(gpu)
        except ValueError as err:
            raise typer.BadParameter(str(err), param_hint="--gpu") from None
    else:
        entry = detected.gpu if detected else None
    chip = entry.arch if entry else (detected.arch if detected else None)
    report = {
        "versions": versions(),
        "detected": arch.as_dict(detected) if detected else None,
        "catalogue_gpu": arch.as_dict(entry) if entry else None,
        "catalogue_arch": arch.as_dict(chip) if chip else None,
    }
    if as_json:
        _emit_json(report)
        return
    console.print(_kv_table("versions", report["versions"]))
    if detected is None:
        console.print("[bold]GPU:[/bold] no GPU (torch.cuda.is_available() is False): kernels run through "
                      "the Triton interpreter; planning cross-compiles for any target.")
    else:
        rows = {k: v for k, v in report["detected"].items() if k not in ("arch", "gpu", "differences")}
        console.print(_kv_table("detected GPU", rows))
        for line in detected.differences:
            console.print(f"[yellow]differs from the catalogue:[/yellow] {line}")
        if not detected.differences:
            console.print("[green]matches the catalogue[/green]")
    if entry is not None:
        console.print(_kv_table(f"catalogue: {entry.name}", {k: v for k, v in report["catalogue_gpu"].items() if k != "arch"}))
    if chip is not None:
        console.print(_kv_table(f"architecture: {chip.name}", report["catalogue_arch"]))


@app.command()
def gpus(as_json: JsonFlag = False) -> None:
    """List the GPU catalogue: shared memory, SMs, bandwidth, peaks and FP4 MMA per product."""
    from . import arch

    if as_json:
        _emit_json({name: arch.as_dict(g) for name, g in arch.GPUS.items()})
        return
    table = Table(title="GPU catalogue")
    for col in ("GPU", "arch", "SMs", "smem/block (opt-in)", "HBM/GDDR GB/s", "bf16 TFLOP/s", "FP4 TFLOP/s", "FP4 MMA"):
        table.add_column(col)
    for g in arch.GPUS.values():
        table.add_row(g.name, g.arch.name, str(g.sm_count), f"{g.arch.smem_per_block_optin:,} B",
                      f"{g.mem_bandwidth_gbs:,.0f}", f"{g.bf16_dense_tflops:,.0f}",
                      "—" if g.fp4_dense_tflops is None else f"{g.fp4_dense_tflops:,.0f}", g.arch.fp4_mma)
    console.print(table)


@app.command()
def demo(
    rows: Annotated[int, typer.Option(min=1, help="Rows of the random matrix.")] = 256,
    cols: Annotated[int, typer.Option(min=32, help="Columns (K); a multiple of 32.")] = 1024,
    seed: int = 0,
    as_json: JsonFlag = False,
) -> None:
    """Quantize a random matrix to NVFP4 and MXFP4 and report the round-trip error (CPU or GPU)."""
    import torch

    from .quantize import dequantize, quantize

    if cols % 32:
        raise typer.BadParameter(f"expected a multiple of 32, got {cols}", param_hint="--cols")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    results = {}
    for fmt in ("nvfp4", "mxfp4"):
        t = quantize(x, fmt)
        y = dequantize(t, torch.float32)
        rel = ((y - x).norm() / x.norm()).item()
        results[fmt] = {
            "shape": [rows, cols],
            "bytes": t.nbytes,
            "bits_per_element": 8 * t.nbytes / x.numel(),
            "relative_rms_error": rel,
            "max_abs_error": (y - x).abs().max().item(),
        }
    if as_json:
        _emit_json(results)
        return
    table = Table(title=f"quantize -> dequantize of a random {rows}x{cols} normal matrix")
    for col in ("format", "bytes", "bits/element", "relative RMS error", "max |error|"):
        table.add_column(col)
    for fmt, r in results.items():
        table.add_row(fmt, f"{r['bytes']:,}", f"{r['bits_per_element']:.2f}", f"{r['relative_rms_error']:.4f}",
                      f"{r['max_abs_error']:.4f}")
    console.print(table)


def main() -> None:
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
