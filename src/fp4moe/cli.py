"""The ``fp4moe`` command. Subcommands plug into ``app``; each prints a table or, with --json, JSON."""

from __future__ import annotations

import functools
import json
import os
import platform
import re
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from rich.console import Console
from rich.table import Table

from .cli_terms import cli_terms

app = typer.Typer(
    name="fp4moe",
    help="FP4 (NVFP4, MXFP4) Mixture-of-Experts inference on every NVIDIA generation.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # plain help: flags read as flags ("--explain / --no-explain", not "<bool>" after each), in any
    # terminal or log, and the help needs no Markdown renderer
    rich_markup_mode=None,
)

console = Console()


def _in_cli_terms(command: Callable[..., Any]) -> Callable[..., Any]:
    """``command`` with the usage errors it raises reworded by ``cli_terms``."""

    @functools.wraps(command)  # typer reads the options from the wrapped function's signature
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except typer.BadParameter as err:
            err.message = cli_terms(err.message)
            raise

    wrapper._in_cli_terms = True  # type: ignore[attr-defined]
    return wrapper


def _mount_subcommands() -> None:
    from .bench.cli import bench_app
    from .checkpoints.cli import quantize_command
    from .plan.cli import plan_command

    for command in bench_app.registered_commands:  # their usage errors in the command line's terms too
        if command.callback is not None and not getattr(command.callback, "_in_cli_terms", False):
            command.callback = _in_cli_terms(command.callback)
    app.add_typer(bench_app, name="bench", short_help="Benchmarks against ceilings measured in the same run (GPU).")
    app.command("quantize", short_help="Write an NVFP4 checkpoint of a bf16 Hugging Face model.")(
        _in_cli_terms(quantize_command))
    app.command("plan", short_help="Plan a model's FP4 GEMMs for a target GPU, no GPU needed.")(
        _in_cli_terms(plan_command))


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


@app.command(short_help="The GPU in hand, the software versions and the catalogue entry.")
def info(
    gpu: Annotated[Optional[str], typer.Option(help="Show this catalogue GPU instead of the one in hand, e.g. 'rtx pro 6000'.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """The GPU in hand (or 'no GPU'), the software versions, and the catalogue entry."""
    from . import target as arch

    detected = arch.detect()
    if gpu is not None:
        try:
            entry: arch.GPU | None = arch.find_gpu(gpu, strict=True)
        except ValueError as err:
            message = re.sub(r"use --arch (\w+) to plan for the architecture alone",
                             r"`fp4moe plan --arch \1` plans for the architecture alone", str(err))
            raise typer.BadParameter(cli_terms(message), param_hint="--gpu") from None
    else:
        entry = detected.gpu if detected else None
    chip = entry.arch if entry else (detected.arch if detected else None)
    kernels = None
    if detected is not None:  # FP4MOE_ARCH: another architecture's kernels run on this GPU
        import torch

        from .ops._runtime import emulated_arch

        found = emulated_arch(torch.device("cuda"))
        kernels = found.name if found is not None else None
    report = {
        "versions": versions(),
        "detected": arch.as_dict(detected) if detected else None,
        "kernels_arch": kernels,
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
        if kernels is not None:
            console.print(f"[yellow]FP4MOE_ARCH:[/yellow] this process runs {kernels}'s kernels on it")
    if entry is not None:
        console.print(_kv_table(f"catalogue: {entry.name}", {k: v for k, v in report["catalogue_gpu"].items() if k != "arch"}))
    if chip is not None:
        console.print(_kv_table(f"architecture: {chip.name}", report["catalogue_arch"]))


@app.command(short_help="List the GPU catalogue.")
def gpus(as_json: JsonFlag = False) -> None:
    """List the GPU catalogue: shared memory, SMs, bandwidth, peaks and FP4 MMA per product."""
    from . import target as arch

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
    # a log or a pipe: do not squeeze the table into 80 columns (as plan does)
    (console if console.is_terminal else Console(width=170)).print(table)


@app.command(short_help="Quantize a random matrix; --e2e: run a random MoE model through fp4moe.")
def demo(
    rows: Annotated[int, typer.Option(min=1, help="Rows of the random matrix.")] = 256,
    cols: Annotated[int, typer.Option(min=32, help="Columns (K); a multiple of 32.")] = 1024,
    seed: int = 0,
    e2e: Annotated[bool, typer.Option("--e2e", help="End to end instead: build a random MoE model with transformers, "
                                      "quantize it, load it through fp4moe, generate, compare with bf16.")] = False,
    family: Annotated[str, typer.Option(help="--e2e: qwen3_moe, deepseek_v3, glm4_moe or gpt_oss.")] = "qwen3_moe",
    size: Annotated[str, typer.Option(help="--e2e: 'tiny' (CPU, seconds) or 'large' (GPU: hidden 2048, 128 experts "
                                      "of 768, top-8, 4 layers).")] = "tiny",
    fmt: Annotated[str, typer.Option("--format", help="--e2e: checkpoint format, modelopt or compressed-tensors.")] = "modelopt",
    new_tokens: Annotated[int, typer.Option(min=1, help="--e2e: greedy tokens to generate.")] = 8,
    timing: Annotated[bool, typer.Option("--timing", help="--e2e: also time generate and the MoE layers (bf16 vs "
                                         "fp4moe); meaningful on a GPU only.")] = False,
    workdir: Annotated[Optional[str], typer.Option(help="--e2e: keep the bf16 model and checkpoint here, in "
                                                   "DIR/bf16 and DIR/<format> (a checkpoint already there is "
                                                   "replaced; default: a temporary folder, removed).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Quantize a random matrix to NVFP4 and MXFP4 and report the round-trip error (CPU or GPU);
    with --e2e, run a random transformers MoE model end to end through fp4moe."""
    if e2e:
        _demo_e2e(family, size, fmt, new_tokens, timing, workdir, seed, as_json)
        return
    e2e_only = {"--family": family != "qwen3_moe", "--size": size != "tiny", "--format": fmt != "modelopt",
                "--new-tokens": new_tokens != 8, "--timing": timing, "--workdir": workdir is not None}
    given = [name for name, differs in e2e_only.items() if differs]
    if given:
        raise typer.BadParameter(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to --e2e only "
                                 "(add --e2e)", param_hint=given[0])
    import torch

    from .quantize import dequantize, quantize

    if cols % 32:
        raise typer.BadParameter(f"expected a multiple of 32, got {cols}", param_hint="--cols")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    results = {}
    for fmt_name in ("nvfp4", "mxfp4"):
        t = quantize(x, fmt_name)
        y = dequantize(t, torch.float32)
        rel = ((y - x).norm() / x.norm()).item()
        results[fmt_name] = {
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
    for fmt_name, r in results.items():
        table.add_row(fmt_name, f"{r['bytes']:,}", f"{r['bits_per_element']:.2f}", f"{r['relative_rms_error']:.4f}",
                      f"{r['max_abs_error']:.4f}")
    console.print(table)


def _demo_e2e(family: str, size: str, fmt: str, new_tokens: int, timing: bool, workdir: str | None, seed: int,
              as_json: bool) -> None:
    import sys
    import tempfile

    import torch

    from .integrations.transformers import FAMILIES

    if family not in FAMILIES:
        raise typer.BadParameter(f"expected one of {', '.join(FAMILIES)}, got {family!r}", param_hint="--family")
    if size not in ("tiny", "large"):
        raise typer.BadParameter(f"expected tiny or large, got {size!r}", param_hint="--size")
    if fmt not in ("modelopt", "compressed-tensors"):
        raise typer.BadParameter(f"expected modelopt or compressed-tensors, got {fmt!r}", param_hint="--format")
    if workdir is not None:
        _check_workdir(workdir, fmt)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built locally
    if not torch.cuda.is_available():
        if size == "large":
            raise typer.BadParameter("'large' needs a CUDA GPU (the interpreter would take hours); use tiny",
                                     param_hint="--size")
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            if any(m.startswith("fp4moe.kernels") for m in sys.modules):  # pragma: no cover - defensive
                raise typer.BadParameter("no GPU: set TRITON_INTERPRET=1 before fp4moe's kernels are imported")
            os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined, i.e. imported next
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise typer.BadParameter("needs transformers>=5.17,<6: pip install 'fp4moe[hf]'", param_hint="--e2e") from None
    from .integrations.transformers.e2e import run_e2e

    with tempfile.TemporaryDirectory(prefix="fp4moe-e2e-") as tmp:
        result = run_e2e(family, size, workdir=workdir or tmp, fmt=fmt, seed=seed, new_tokens=new_tokens,
                         timing=timing)  # type: ignore[arg-type]
    report = {**result.as_dict(), "versions": versions()}
    if as_json:
        _emit_json(report)
        return
    r = result
    console.print(f"[bold]{family}[/bold] ({size}: hidden {r.shapes['hidden']}, {r.shapes['experts']} experts of "
                  f"{r.shapes['moe_inter']}, top-{r.shapes['top_k']}, {r.shapes['layers']} layers) on {r.device}: "
                  f"random bf16 model -> {fmt} NVFP4 checkpoint -> transformers model with fp4moe MoE blocks and "
                  "FP4 linears")
    table = Table(title="agreement with the bf16 model", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("weights: relative RMS error of FP4", f"{r.weight_error['relative_rms']:.4f}")
    table.add_row("logits: relative RMS error, fp4moe vs bf16", f"{r.logits_error_vs_bf16:.4f}")
    table.add_row("  transformers running the FP4 weights, vs bf16", f"{r.logits_error_fake_quant_vs_bf16:.4f}")
    table.add_row("  fp4moe vs transformers on the same FP4 weights", f"{r.logits_error_vs_fake_quant:.4f}")
    table.add_row("  predicted from the weight error (x sqrt(GEMMs))", f"{r.predicted_logits_error:.4f} "
                  f"({r.quantized_gemms_per_token} quantized GEMMs per token)")
    table.add_row("next-token argmax agreement (prompt positions)", f"{r.top1_agreement:.0%}")
    table.add_row("greedy tokens, bf16", str(r.generated_bf16))
    table.add_row("greedy tokens, fp4moe", str(r.generated_fp4moe))
    table.add_row("greedy token agreement", f"{r.token_agreement:.0%}")
    console.print(table)
    if r.timing:
        t = Table(title="tokens/s (median of 20 after a warm-up)", title_justify="left")
        for col in ("tokens", "MoE layers", "bf16 ms", "fp4moe ms", "bf16 tok/s", "fp4moe tok/s", "speed-up"):
            t.add_column(col)
        for row in r.timing["moe_layers"]:
            t.add_row(str(row["tokens"]), str(row["moe_layers"]), f"{row['bf16_ms']:.3f}", f"{row['fp4moe_ms']:.3f}",
                      f"{row['bf16_tokens_per_s']:,.0f}", f"{row['fp4moe_tokens_per_s']:,.0f}", f"{row['speedup']:.2f}x")
        console.print(t)
        console.print(f"generate (whole model): bf16 {r.timing['generate_tokens_per_s_bf16']:,.1f} tok/s, fp4moe "
                      f"{r.timing['generate_tokens_per_s_fp4moe']:,.1f} tok/s (model.generate); with each decode step "
                      f"one CUDA graph (fp4moe.integrations.transformers.generate): bf16 "
                      f"{r.timing['generate_graphs_tokens_per_s_bf16']:,.1f} tok/s, fp4moe "
                      f"{r.timing['generate_graphs_tokens_per_s_fp4moe']:,.1f} tok/s")
    if r.device == "cpu":
        console.print("[dim]CPU: fp4moe's kernels ran through the Triton interpreter. Random weights give nearly flat "
                      "logits, so a small error flips argmaxes; the logits error is the measure.[/dim]")


def _check_workdir(workdir: str, fmt: str) -> None:
    """Refuse a --workdir that demo --e2e cannot use, before any work: it writes DIR/bf16 (the
    bf16 model) and DIR/<format> (the checkpoint, replaced if there) into a folder it may create."""
    def bad(message: str) -> typer.BadParameter:
        return typer.BadParameter(message, param_hint="--workdir")

    if not workdir.strip():
        raise bad("expected a folder, got an empty path")
    path = Path(workdir).expanduser()
    if path.exists() and not path.is_dir():
        raise bad(f"{workdir}: exists and is not a folder; --workdir names a folder (created if missing) "
                  f"for the bf16 model and the {fmt} checkpoint")
    if path.is_dir():
        model_files = [p.name for p in path.iterdir() if p.name == "config.json" or p.suffix == ".safetensors"]
        if model_files:
            raise bad(f"{workdir}: is a model folder (holds {', '.join(sorted(model_files)[:3])}); --workdir writes "
                      f"bf16/ and {fmt}/ into the folder it names: give a new or empty folder")
        for sub, what in (("bf16", "the bf16 model"), (fmt, f"the {fmt} checkpoint")):
            target = path / sub
            if target.exists() and not target.is_dir():
                raise bad(f"{workdir}: {sub} exists and is not a folder ({what} goes there)")
            if target.is_dir() and any(target.iterdir()) and not (target / "config.json").is_file():
                raise bad(f"{workdir}: {sub}/ holds files but no config.json (not a model or checkpoint); "
                          f"{what} would be written over it: empty it or give another folder")
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise bad(f"{workdir}: {ancestor} is not a folder, so the folder cannot be created")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise bad(f"{workdir}: {ancestor} is not writable")


def main() -> None:
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
