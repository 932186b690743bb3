"""``fp4moe bench``: run a benchmark, print a table, write benchmarks/<name>-<gpu>.json and .md.

``fp4moe.cli`` mounts it with ``app.add_typer(bench_app, name="bench")``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from . import MODES
from .report import environment, one_line, write_results

__all__ = ["bench_app", "parse_ms", "parse_shapes", "parse_modes"]

bench_app = typer.Typer(
    name="bench",
    help="Benchmarks held against ceilings measured in the same run; results go to benchmarks/.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

NO_GPU = "fp4moe bench needs a CUDA GPU; none found"


@bench_app.callback()
def _bench() -> None:
    """Benchmarks held against ceilings measured in the same run; results go to benchmarks/."""


def parse_ms(text: str) -> tuple[int, ...]:
    """'1, 16,256' -> (1, 16, 256): positive token counts separated by commas."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise typer.BadParameter(f"expected positive integers separated by commas, e.g. 1,16,256; got {text!r}",
                                 param_hint="--m")
    return values


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """'12288x6144,4096x6144' -> ((12288, 6144), (4096, 6144)): weight shapes N x K."""
    shapes = []
    for part in text.split(","):
        dims = part.strip().lower().replace("×", "x").split("x")
        try:
            n, k = (int(d) for d in dims)
        except ValueError:
            n = k = 0
        if n < 1 or k < 1:
            raise typer.BadParameter(f"expected weight shapes NxK separated by commas, e.g. 12288x6144,4096x6144; "
                                     f"got {part.strip()!r} in {text!r}", param_hint="--shapes")
        shapes.append((n, k))
    return tuple(shapes)


def parse_modes(text: str) -> tuple[str, ...]:
    """'w4a16,w4a4' -> ('w4a16', 'w4a4')."""
    modes = tuple(part.strip().lower() for part in text.split(","))
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise typer.BadParameter(f"expected modes from {', '.join(MODES)} separated by commas; got {text!r}",
                                 param_hint="--modes")
    return modes


def _gpu_run(width: int = 160) -> tuple[Console, dict[str, Any], dict[str, Any]]:
    """The console, environment and ceilings of a benchmark on the GPU; exits with a message without one."""
    import torch

    if not torch.cuda.is_available():
        Console(stderr=True).print(f"[red]{NO_GPU}[/red]")
        raise typer.Exit(2)
    console = Console() if Console().is_terminal else Console(width=width)
    from .linear import bench_ceilings

    env = environment()
    ceilings = bench_ceilings()
    console.print(f"{env['gpu']}: copy {ceilings['copy_gbs']:,.0f} GB/s, bf16 {ceilings['bf16_tflops']:,.0f} TFLOP/s")
    return console, env, ceilings


def _f(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _linear_table(rows: Sequence[Mapping[str, Any]]) -> Table:
    table = Table(title="fp4_linear vs torch bf16 matmul")
    for col in ("shape N×K", "M", "mode", "µs", "of weight-read bound", "of roofline", "TFLOP/s", "torch µs",
                "speed-up", "config / error"):
        table.add_column(col, justify="left" if col in ("shape N×K", "mode", "config / error") else "right")
    for r in rows:
        if r.get("error"):
            table.add_row(r["shape"], str(r["M"]), r["mode"], *["—"] * 4, _f(r["torch_us"], ".1f"), "—",
                          f"[red]{one_line(r['error'], 60)}[/red]")
            continue
        table.add_row(r["shape"], str(r["M"]), r["mode"], _f(r["us"], ".1f"), _f(r["frac_weight_bound"], ".0%"),
                      _f(r["frac_roofline"], ".0%"), _f(r["tflops"], ".1f"), _f(r["torch_us"], ".1f"),
                      _f(r["speedup"], ".2f"), r.get("config") or "")
    return table


def _quantize_table(rows: Sequence[Mapping[str, Any]]) -> Table:
    table = Table(title="quantize_activations (bf16 -> NVFP4)")
    for col in ("shape M×K", "global scale", "µs", "GB/s", "of copy bandwidth", "error"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["shape"], r["global_scale"], _f(r["us"], ".1f"), _f(r["gbs"], ",.0f"),
                      _f(r["frac_copy"], ".0%"), one_line(r.get("error") or "", 60))
    return table


@bench_app.command()
def linear(
    m: Annotated[Optional[str], typer.Option(
        "--m", help="Token counts M, e.g. 1,4,16 (default 1..16384; --quick: 1,16,256,4096).")] = None,
    shapes: Annotated[Optional[str], typer.Option(
        help="Weight shapes NxK, e.g. 12288x6144,4096x6144 (default: the GLM-5 shapes).")] = None,
    modes: Annotated[str, typer.Option(help="Modes: w4a16 (bf16 activations), w4a4 (FP4 activations).")] = "w4a16,w4a4",
    fmt: Annotated[str, typer.Option("--fmt", "--format", help="Weight format: nvfp4 or mxfp4.")] = "nvfp4",
    out: Annotated[Path, typer.Option(help="Folder of the JSON and Markdown results.")] = Path("benchmarks"),
    quick: Annotated[bool, typer.Option(help="Fewer M and repetitions; writes linear-quick-<gpu>.* instead.")] = False,
) -> None:
    """Time fp4_linear for each shape, M and mode against torch bf16 and the measured roofline."""
    from ..formats import get_format
    from .linear import DEFAULT_MS, GLM5_SHAPES, QUICK_MS, bench_ceilings, run_linear_bench, run_quantize_bench

    ms = parse_ms(m) if m is not None else (QUICK_MS if quick else DEFAULT_MS)
    shape_list = parse_shapes(shapes) if shapes is not None else GLM5_SHAPES
    mode_list = parse_modes(modes)
    try:
        fmt = get_format(fmt).name
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--fmt") from None
    block = get_format(fmt).block_size
    for n, k in shape_list:
        if k % block:
            raise typer.BadParameter(f"K={k} of {n}x{k} is not a multiple of the {fmt} block size {block}",
                                     param_hint="--shapes")

    import torch

    if not torch.cuda.is_available():
        Console(stderr=True).print(f"[red]{NO_GPU}[/red]")
        raise typer.Exit(2)

    console = Console()
    if not console.is_terminal:  # a log file: do not squeeze the tables into 80 columns
        console = Console(width=160)
    env = environment()
    console.print(f"{env['gpu']} (sm {env['capability']}), torch {env['torch']}, triton {env['triton']}, "
                  f"commit {env['commit'][:12]}")
    ceilings = bench_ceilings()
    console.print(f"ceilings: copy {ceilings['copy_gbs']:,.0f} GB/s, "
                  f"bf16 matmul {ceilings['bf16_tflops']:,.0f} TFLOP/s, L2 {ceilings['l2_bytes'] / 2**20:.0f} MiB")
    timing = {"reps": 10, "iters_per_graph": 10, "budget_ms": 150.0} if quick else {}
    # the quantizer first, right after its copy-bandwidth ceiling: after the prefill rows the GPU
    # leaves its 700 W power cap at lower clocks, which an issue-bound kernel feels (session 15)
    rows = run_quantize_bench(ceilings=ceilings, console=console, **timing) if "w4a4" in mode_list else []
    rows = run_linear_bench(shape_list, ms, mode_list, fmt, ceilings=ceilings, console=console, **timing) + rows
    json_path, md_path = write_results("linear-quick" if quick else "linear", env, rows, out, ceilings=ceilings)
    console.print(_linear_table([r for r in rows if r["kind"] == "linear"]))
    if any(r["kind"] == "quantize" for r in rows):
        console.print(_quantize_table([r for r in rows if r["kind"] == "quantize"]))
    console.print(f"wrote {json_path} and {md_path}")


@bench_app.command()
def moe(
    model: Annotated[str, typer.Option(help="Model preset: glm-5, deepseek-v3, qwen3-30b-a3b, gpt-oss-120b.")] = "glm-5",
    tp: Annotated[int, typer.Option(min=1, help="Tensor-parallel degree (splits each expert's intermediate).")] = 1,
    m: Annotated[Optional[str], typer.Option("--m", help="Token counts, e.g. 1,16,4096.")] = None,
    mode: Annotated[str, typer.Option(help="w4a16 or w4a4 (NVFP4).")] = "w4a16",
    routings: Annotated[str, typer.Option(help="uniform, zipf or both.")] = "uniform,zipf",
    oea_m: Annotated[str, typer.Option("--oea-m", help="Token counts of the rows timed with OEA on and off ('' for "
                                       "none). OEA, opportunistic expert activation: each token keeps its own top "
                                       "--oea-k0 experts and fills the rest of its top-k only with experts other "
                                       "tokens of the batch already use, so a decode batch reads fewer experts.")]
    = "8,16,32,64",
    oea_k0: Annotated[int, typer.Option(min=1, help="Experts each token keeps as its own under OEA (k0).")] = 4,
    no_torch: Annotated[bool, typer.Option("--no-torch", help="Skip the torch._grouped_mm bf16 baseline.")] = False,
    ep: Annotated[int, typer.Option(min=1, help="Expert-parallel degree: under torchrun with tp x ep processes, "
                                    "the layer split over them (fp4moe.distributed), timed per rank.")] = 1,
    dispatch: Annotated[str, typer.Option(help="Under torchrun: how tokens reach the experts' ranks: all_gather, "
                                          "all_to_all or replicated (every rank the same tokens).")] = "all_gather",
    out: Annotated[Path, typer.Option(help="Folder of the JSON and Markdown results.")] = Path("benchmarks"),
) -> None:
    """Time one FP4 MoE layer per M and routing against torch._grouped_mm bf16 and the weight-read bound;
    under torchrun, the layer split over the processes (--tp x --ep)."""
    import os

    from ..models import get_model
    from .moe import DEFAULT_MS as MOE_MS
    from .moe import run_moe_bench

    try:
        get_model(model)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--model") from None
    if mode not in ("w4a16", "w4a4"):
        raise typer.BadParameter(f"expected w4a16 or w4a4, got {mode!r}", param_hint="--mode")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _parallel_moe(model, tp, ep, dispatch, mode, parse_ms(m) if m is not None else (1, 16, 64, 256), out)
        return
    if ep > 1:
        raise typer.BadParameter(f"{ep} expert-parallel ranks need {tp * ep} processes: run it under torchrun "
                                 f"(torchrun --nproc-per-node {tp * ep} -m fp4moe.cli bench moe --tp {tp} --ep {ep})",
                                 param_hint="--ep")
    route_list = tuple(r.strip() for r in routings.split(",") if r.strip())
    for r in route_list:
        if r not in ("uniform", "zipf"):
            raise typer.BadParameter(f"expected uniform or zipf, got {r!r}", param_hint="--routings")
    ms = parse_ms(m) if m is not None else MOE_MS
    oea_ms = parse_ms(oea_m) if oea_m.strip() else ()

    console, env, ceilings = _gpu_run()
    rows = run_moe_bench(model, tp=tp, ms=ms, routings=route_list, mode=mode, oea_ms=oea_ms, oea_k0=oea_k0,
                         ceilings=ceilings, torch_baseline=not no_torch, console=console)
    name = f"moe-{model}-tp{tp}-{mode}"
    json_path, md_path = write_results(name, env, rows, out, ceilings=ceilings)
    console.print(f"wrote {json_path} and {md_path}")


def _parallel_moe(model: str, tp: int, ep: int, dispatch: str, mode: str, tokens: Sequence[int], out: Path) -> None:
    """``bench moe`` under torchrun: the layer split over the processes; rank 0 prints and writes."""
    import os

    import torch
    import torch.distributed as dist

    from ..distributed import DISPATCH_MODES
    from .parallel import run_parallel_moe_bench

    if dispatch not in DISPATCH_MODES:
        raise typer.BadParameter(f"expected one of {', '.join(DISPATCH_MODES)}, got {dispatch!r}",
                                 param_hint="--dispatch")
    world = int(os.environ["WORLD_SIZE"])
    if tp * ep != world:
        raise typer.BadParameter(f"--tp {tp} x --ep {ep} = {tp * ep} ranks, but torchrun started {world} processes",
                                 param_hint="--ep")
    if not torch.cuda.is_available():
        Console(stderr=True).print(f"[red]{NO_GPU}[/red]")
        raise typer.Exit(2)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast
    dist.init_process_group("nccl")
    try:
        rows = run_parallel_moe_bench(model, tp=tp, ep=ep, dispatch=dispatch, tokens=tokens, mode=mode)
        if dist.get_rank() == 0:
            console = Console()
            table = Table(title=f"{model} MoE layer over {world} ranks (tp {tp} x ep {ep}, {dispatch}), µs per call")
            for col in ("tokens/rank", "call", "experts' compute", "other (comm., wait)", "imbalance", "rows"):
                table.add_column(col, justify="right")
            for r in rows:
                table.add_row(str(r["tokens_per_rank"]), _f(r["call_us"], ",.1f"), _f(r["compute_us"], ",.1f"),
                              _f(r["other_us"], ",.1f"), _f(r["imbalance"], ".2f"), str(r["rows_computed"]))
            console.print(table)
            name = f"moe-{model}-tp{tp}-ep{ep}-{dispatch}-{mode}"
            json_path, md_path = write_results(name, environment(), rows, out)
            console.print(f"wrote {json_path} and {md_path}")
    finally:
        dist.destroy_process_group()


def _calls_table(rows: Sequence[Mapping[str, Any]]) -> Table:
    table = Table(title="FP4MoE: plain calls against the same calls in a CUDA graph (µs per call)")
    for col in ("model", "M", "bound", "graph", "plain", "plain / graph", "host", "no graphs", "no graphs / graph",
                "error"):
        table.add_column(col, justify="left" if col in ("model", "error") else "right")
    for r in rows:
        table.add_row(r["model"], str(r["M"]), _f(r["bound_us"], ".1f"), _f(r["graph_us"], ".1f"),
                      _f(r["plain_us"], ".1f"), _f(r["plain_over_graph"], ".2f"), _f(r["host_us"], ".1f"),
                      _f(r["plain_no_graphs_us"], ".1f"), _f(r["no_graphs_over_graph"], ".2f"),
                      one_line(r.get("error") or "", 60))
    return table


@bench_app.command()
def calls(
    models: Annotated[str, typer.Option("--models", help="Model presets, e.g. glm-5,qwen3-30b-a3b.")] = "glm-5,qwen3-30b-a3b",
    m: Annotated[Optional[str], typer.Option("--m", help="Token counts, e.g. 1,4,16,64,256.")] = None,
    out: Annotated[Path, typer.Option(help="Folder of the JSON and Markdown results.")] = Path("benchmarks"),
) -> None:
    """Time plain calls of the public FP4MoE module against the same calls in a CUDA graph."""
    from ..models import get_model
    from .calls import DEFAULT_MS as CALL_MS
    from .calls import run_calls_bench

    names = tuple(n.strip() for n in models.split(",") if n.strip())
    for name in names:
        try:
            get_model(name)
        except ValueError as err:
            raise typer.BadParameter(str(err), param_hint="--models") from None
    ms = parse_ms(m) if m is not None else CALL_MS

    console, env, ceilings = _gpu_run()
    rows = run_calls_bench(names, ms, ceilings=ceilings, console=console)
    json_path, md_path = write_results("calls", env, rows, out, ceilings=ceilings)
    console.print(_calls_table(rows))
    console.print(f"wrote {json_path} and {md_path}")


def _model_table(rows: Sequence[Mapping[str, Any]]) -> Table:
    table = Table(title="decode step: fp4moe against transformers bf16 on the same model")
    for col in ("weights", "batch", "graph µs", "plain µs", "tokens/s", "bound µs", "of bound", "moe", "attention",
                "dense", "other", "error"):
        table.add_column(col, justify="left" if col in ("weights", "error") else "right")
    for r in rows:
        if r["kind"] != "decode":
            continue
        table.add_row(r["weights"], str(r["batch"]), _f(r["graph_step_us"], ".0f"), _f(r["plain_step_us"], ".0f"),
                      _f(r["tokens_per_s"], ",.1f"), _f(r["bound_us"], ".0f"), _f(r["frac_bound"], ".0%"),
                      _f(r["moe_us"], ".0f"), _f(r["attention_us"], ".0f"), _f(r["dense_us"], ".0f"),
                      _f(r["other_us"], ".0f"), one_line(r.get("error") or r.get("graph_error") or "", 50))
    return table


@bench_app.command("model")
def model_(
    model: Annotated[str, typer.Option(help="Model preset: glm-5, deepseek-v3 or qwen3-30b-a3b.")] = "glm-5",
    layers: Annotated[Optional[int], typer.Option(min=1, help="Layers (the first dense where the model has dense layers); default: as many as let "
                                                  "the bf16 model fit the GPU.")] = None,
    batches: Annotated[str, typer.Option(help="Decode batch sizes, e.g. 1,16,64.")] = "1,16,64",
    steps: Annotated[int, typer.Option(min=1, help="Decode steps timed per batch.")] = 32,
    prefill: Annotated[int, typer.Option(min=0, help="Prefill tokens of the prefill row (0: none).")] = 2048,
    out: Annotated[Path, typer.Option(help="Folder of the JSON and Markdown results.")] = Path("benchmarks"),
) -> None:
    """Decode steps (and a prefill) of a random model with a real model's shapes: fp4moe against bf16."""
    from .model import MODEL_TYPES, run_model_bench

    if model not in MODEL_TYPES:
        raise typer.BadParameter(f"expected one of {', '.join(MODEL_TYPES)}, got {model!r}", param_hint="--model")
    batch_list = parse_ms(batches)

    console, env, ceilings = _gpu_run(170)
    rows, facts = run_model_bench(model, layers=layers, batches=batch_list, steps=steps, prefill=prefill,
                                  ceilings=ceilings, console=console)
    json_path, md_path = write_results(f"model-{model}", env, [{"kind": "model", **facts}, *rows], out,
                                       ceilings=ceilings)
    console.print(_model_table(rows))
    for r in rows:
        if r["kind"] == "comparison":
            console.print(f"batch {r['batch']}: fp4moe {r['fp4moe_tokens_per_s']:,.1f} tokens/s, bf16 "
                          f"{r['bf16_tokens_per_s']:,.1f}: {r['speedup']:.2f}x (bounds {_f(r['bound_ratio'], '.2f')}x); "
                          f"fp4moe step {_f(r['fp4moe_step_over_bound'], '.2f')}x its bound")
    console.print(f"wrote {json_path} and {md_path}")
