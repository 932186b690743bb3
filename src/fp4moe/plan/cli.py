"""``fp4moe plan``: prove each FP4 GEMM of a model fits the target GPU, on a machine without one.

For every token bucket and every FP4 GEMM of one layer (``models.fp4_linear_ops``: the experts'
gate+up and down, planned as the two grouped GEMMs over the local experts, ``fp4_moe_mma`` at
decode, ``fp4_moe_wgmma`` for SM90 prefill and ``fp4_moe_gemm`` otherwise; the shared expert and the dense MLP as ``fp4_linear``,
``fp4_linear_mma`` for bf16 decode or ``fp4_linear_wgmma`` for SM90 prefill, and from
``LinearTuning.dequant_matmul_min_m`` (``fp4moe.tuning``) tokens on SM90 ``nvfp4_weight_dequantize`` followed by torch's
matmul, which is not planned: the kernels the runtime runs), the planner picks a
configuration, proves
it by cross-compiling for the target, and reports shared memory used / allowed with its
breakdown, registers, MMA instruction, modelled time and fraction of the roofline.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

__all__ = ["moe_problem", "plan_command", "plan_model"]


#: The per-expert rows of ``models.fp4_linear_ops`` that run as the grouped GEMMs of
#: ``kernels.moe.moe_gemm_kernel``, and which GEMM (1: gate+up with SwiGLU, 2: down) each is.
_GROUPED = {"experts.w13 (gate+up)": 1, "experts.w2 (down)": 2}


def moe_problem(model, tokens: int, gemm: int, *, tp: int = 1, ep: int = 1, fmt: str | None = None,
                mode: str = "w4a16", arch=None):
    """The ``MoEGemmProblem`` of one grouped GEMM of ``model``'s MoE layer on one GPU.

    Tensor parallelism splits the expert intermediate I by ``tp``; expert parallelism keeps
    ``n_experts / ep`` local experts, which receive ``1 / ep`` of the token-expert pairs under
    uniform routing: the problem holds ``ceil(tokens / ep)`` tokens of ``top_k`` pairs each.
    Both GEMMs run on one dispatch plan, so block_m is pinned to the runtime's
    (``ops.moe.choose_moe_configs``) for both: the two planned configurations run together.
    """
    from ..target import get_arch
    from ..ops.moe import choose_moe_configs
    from .space import MoEGemmProblem

    H, inter = model.hidden, model.expert_intermediate // tp
    N, K = (inter, H) if gemm == 1 else (H, inter)
    T, E = max(1, -(-tokens // ep)), model.n_experts // ep
    block_m = None
    if arch is not None:
        block_m = choose_moe_configs(T, model.routing.top_k, E, H, inter, arch=get_arch(arch), mode=mode)[0].block_m
    return MoEGemmProblem(T=T, top_k=model.routing.top_k, E=E, N=N, K=K, gemm=gemm, fmt=fmt or model.fmt, mode=mode,
                          block_m=block_m)


def plan_model(model, *, arch=None, gpu=None, tp: int = 1, ep: int = 1, tokens=(1, 16, 64, 4096),
               mode: str = "w4a16", compile: bool = True, jobs: int | None = None, progress=None):
    """[(tokens, name, LinearOp, PlanResult)] for every FP4 GEMM of one layer of ``model`` per token bucket.

    The routed experts' rows ("experts.w13 (gate+up)", "experts.w2 (down)") are planned as the
    grouped GEMMs (``fp4_moe_mma`` at decode, ``fp4_moe_wgmma`` for SM90 prefill, else ``fp4_moe_gemm``; problem
    ``moe_problem``; one launch per layer each);
    the shared expert and the dense MLP as the kernel the runtime runs for them
    (``fp4_linear_mma`` for bf16 decode, ``fp4_linear_wgmma`` for bf16 prefill on SM90,
    ``fp4_linear`` otherwise). ``progress(done, total)``: cross-compilations (``plan_many``)."""
    from ..models import fp4_linear_ops
    from .planner import _resolve, plan_many
    from .space import LinearProblem, WeightDequantizeProblem, get_kernel

    target = _resolve(arch, gpu)[0]
    fmt = model.fmt if mode == "w4a16" else "nvfp4"
    entries, items = [], []
    for t in tokens:
        for op in fp4_linear_ops(model, t, tp=tp, ep=ep):
            if op.name in _GROUPED:  # the routed experts: one grouped GEMM over every local expert
                problem = moe_problem(model, t, _GROUPED[op.name], tp=tp, ep=ep, fmt=fmt, mode=mode, arch=target)
                kernel = _moe_kernel(model, problem, target)
                if kernel != "fp4_moe_gemm":  # both GEMMs run on one plan: pin the runtime's tile height
                    # (emulated W4A4 runs the packed kernels on its dequantized activations,
                    # ops.moe._w4a4_activations: their specs plan it as such)
                    problem = dataclasses.replace(problem, block_m=None)
                    problem = dataclasses.replace(problem, block_m=get_kernel(kernel).heuristic(problem, target).block_m)
                for name, planned in _decode_launches(op.name, kernel, problem):
                    entries.append((t, name, op))
                    items.append((kernel, planned))
                continue
            entries.append((t, op.name, op))
            kernel = _linear_kernel(op.M, op.N, op.K, mode, target, fmt)
            if kernel == "nvfp4_weight_dequantize":  # then torch's matmul (cuBLAS): not planned here
                items.append((kernel, WeightDequantizeProblem(N=op.N, K=op.K)))
                continue
            # emulated W4A4 on a packed kernel: x dequantized to bf16 (ops.linear._launch_packed)
            items.append((kernel, LinearProblem(M=op.M, N=op.N, K=op.K, fmt=fmt, mode=mode)))
            if mode == "w4a4":  # each fp4_linear quantizes its own input (a checkpoint's static scale)
                chain = _activation_chain(f"{op.name} input", op.M, op.K, kernel, dynamic=False)
                entries += [(t, name, None) for name, _ in chain]
                items += [item for _, item in chain]
        if mode == "w4a4" and getattr(model, "n_experts", 0):  # the experts' x (once per token) and h
            chain = _w4a4_chain(model, t, tp, ep, target)
            entries += [(t, name, None) for name, _ in chain]
            items += [item for _, item in chain]
    results = plan_many(items, arch, gpu, compile=compile, jobs=jobs, progress=progress)
    return [(t, name, op, r) for (t, name, op), r in zip(entries, results)]


def _decode_launches(name: str, kernel: str, problem) -> list:
    """[(row name, problem)] of one grouped GEMM: itself, or where the runtime runs it as two
    launches (``ops.moe.MMAHeights``: the experts of few rows on shorter tiles) one per class of
    experts, each with its class's expected share of the rows (``MoEGemmProblem.rows``)."""
    from ..ops.dispatch import ALL_ROWS
    from ..ops.moe import MMAHeights, mma_moe_layer_config

    if kernel != "fp4_moe_mma":
        return [(name, problem)]
    layer = mma_moe_layer_config(problem.pairs / problem.E, problem.E)
    if not isinstance(layer, MMAHeights):
        return [(name, problem)]
    out = []
    for cfg, (lo, hi) in layer.classes():
        which = f"<= {hi} rows" if lo == 0 else (f"> {lo} rows" if hi == ALL_ROWS else f"{lo + 1}-{hi} rows")
        out.append((f"{name}, experts of {which}", dataclasses.replace(problem, rows=(lo, hi), block_m=cfg.block_m)))
    return out


def _activation_chain(name: str, M: int, K: int, reader: str, globals_: int = 1, dynamic: bool = True) -> list:
    """W4A4's activation kernels for one input [M, K] as the runtime runs them for the kernel that
    reads it: [(name, (kernel, problem))]. The Triton kernels (and FP4 MMA) take the NVFP4 codes (the
    quantizer); the packed kernels of emulated W4A4 take bf16 values, which the mma.sync kernels
    and the MoE's GEMM 1 gather ("gather") read in x's order (the quantizer writing the values,
    ``values_out``: ``fake_quantize_activations``) and the wgmma kernels read in MMA K order (the
    quantizer, then the dequantize kernel: ``ops.linear._launch_packed``,
    ``ops.moe._w4a4_activations``). ``globals_``: the weight global scales joined into g."""
    from .space import DequantizeProblem, QuantizeProblem

    if reader in ("fp4_linear", "fp4_moe_gemm"):
        return [(f"quantize {name} (NVFP4)", ("nvfp4_quantize", QuantizeProblem(M=M, K=K, dynamic=dynamic)))]
    if reader in ("fp4_linear_mma", "fp4_moe_mma", "gather"):
        return [(f"quantize {name} (NVFP4 -> bf16)", ("nvfp4_quantize", QuantizeProblem(
            M=M, K=K, dynamic=dynamic, values_out=True, weight_globals=globals_)))]
    return [(f"quantize {name} (NVFP4)", ("nvfp4_quantize", QuantizeProblem(M=M, K=K, dynamic=dynamic))),
            (f"dequantize {name} (bf16)", ("nvfp4_dequantize", DequantizeProblem(M=M, K=K, mma_order=True,
                                                                                weight_globals=globals_)))]


def _w4a4_chain(model, tokens: int, tp: int, ep: int, arch) -> list:
    """The routed experts' W4A4 activation kernels (``_activation_chain``): x's, whose global scale
    the MoE computes per call (the checkpoints' static scales do not reach the MoE block), and those
    of the SwiGLU output h (its T x top_k rows, dynamic global scale) before GEMM 2; one weight
    global per local expert."""
    pairs = max(1, -(-tokens // ep)) * model.routing.top_k
    inter = model.expert_intermediate // tp
    kernel = _moe_kernel(model, moe_problem(model, tokens, 2, tp=tp, ep=ep, fmt="nvfp4", mode="w4a4", arch=arch),
                         arch)
    experts = max(1, model.n_experts // ep)  # one global scale per local expert (per-row ones: not in a preset)
    return (_activation_chain("x", tokens, model.hidden, "gather" if kernel == "fp4_moe_wgmma" else kernel, experts)
            + _activation_chain("h", pairs, inter, kernel, experts))


def _linear_kernel(M: int, N: int, K: int, mode: str, arch, fmt: str = "nvfp4") -> str:
    """The registered kernel ``fp4_linear`` runs for this shape on ``arch`` (``ops.linear.packed_config``):
    bf16 W4A16 decode on the mma.sync kernel, prefill on SM90 on the wgmma kernel, or from
    ``LinearTuning.dequant_matmul_min_m`` rows (NVFP4) the weight to bf16 (``nvfp4_weight_dequantize``) then torch's
    matmul (``dequant_matmul_applies``), else the Triton kernel; emulated W4A4 (no FP4 MMA) the same
    packed kernels on its activations dequantized to bf16."""
    from ..target import get_arch
    from ..ops.linear import dequant_matmul_applies, packed_config, target_path
    from ..ops.mma_sync import MMAConfig
    from ..ops.wgmma import WgmmaConfig

    arch = get_arch(arch) if arch is not None else None
    path = target_path(mode, arch)
    cfg = packed_config(path, arch, M, N, K, fmt=fmt)
    if dequant_matmul_applies(path, arch, M, N, K, fmt):
        return "nvfp4_weight_dequantize"
    if isinstance(cfg, WgmmaConfig):
        return "fp4_linear_wgmma"
    return "fp4_linear_mma" if isinstance(cfg, MMAConfig) else "fp4_linear"


#: kernels that run an MoE layer's experts as one grouped GEMM (a MoEGemmProblem)
_GROUPED_KERNELS = ("fp4_moe_gemm", "fp4_moe_mma", "fp4_moe_wgmma")


def _moe_kernel(model, problem, arch) -> str:
    """The runtime's choice (``ops.moe.packed_moe_kernel``) for bf16 W4A16 experts and emulated W4A4:
    the grouped mma.sync kernel at decode, the wgmma kernel above (SM90, gate-then-up w13: gpt-oss
    checkpoints interleave gate and up rows), otherwise (and for native W4A4) the Triton kernel."""
    from ..ops.moe import packed_moe_kernel

    H, inter = problem.hidden_and_intermediate()
    from ..target import get_arch
    from ..ops.linear import runs_packed

    kernel = packed_moe_kernel(arch, problem.pairs / problem.E, 2 * inter, H, model.routing.kind == "gpt_oss")
    if kernel is None or not runs_packed(problem.mode, get_arch(arch) if arch is not None else None):
        return "fp4_moe_gemm"
    return f"fp4_moe_{kernel}"


def short_mma(forms: str | None) -> str:
    """'mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale...' -> 'mma.sync m16n8k64 FP4 block-scaled'."""
    if not forms:
        return "—"
    out = []
    for form in forms.split(", "):
        parts = form.split(".")
        shape = next((p for p in parts if p.startswith("m") and "n" in p and "k" in p[1:]), "")
        op = "tcgen05.mma" if form.startswith("tcgen05") else ("wgmma" if form.startswith("wgmma") else "mma.sync")
        kind = "FP4 block-scaled" if "mxf4" in form or "mxf8f6f4" in form else ("bf16" if "bf16" in form else "fp16")
        out.append(" ".join(x for x in (op, shape, kind) if x))
    return "; ".join(out)


def _row(t, name, op, r) -> dict:
    v = r.chosen
    out = {"tokens": t, "op": name, "kernel": r.kernel, "variant": r.variant, "problem": str(r.problem),
           "count_per_layer": op.count if op is not None and r.kernel not in _GROUPED_KERNELS else 1}
    if v is None:
        out.update(config=None, error="no legal configuration")
        return out
    out.update(config=str(v.config), shared_compiled=v.shared_compiled, shared_model=v.shared_model,
               shared_limit=v.smem_limit, breakdown=v.smem.describe(), registers=v.registers, spill_bytes=v.spills,
               mma=", ".join(v.mma) or None, modelled_us=v.time.us, fraction_of_peak=v.time.fraction,
               limiter=v.time.limiter, proven=v.stage == "compile")
    return out


#: the library's "name: ..." messages (``models``) and the plan option each name is given by
_OPTION_PREFIXES = {"model": "--model", "config": "--config", "tp": "--tp", "ep": "--ep", "tokens": "--tokens"}


def _option_of(message: str) -> tuple[str | None, str]:
    """(the option a library message is about, the message without its "name: " prefix), e.g.
    "tp: glm-5's expert intermediate 2048 is not divisible by 3" -> ("--tp", "glm-5's ...")."""
    name, sep, rest = message.partition(": ")
    if sep and name in _OPTION_PREFIXES:
        return _OPTION_PREFIXES[name], rest
    return None, message


def plan_command(
    model: Annotated[Optional[str], typer.Option(help="Model preset: glm-5, deepseek-v3, qwen3-30b-a3b, gpt-oss-120b.")] = None,
    config: Annotated[Optional[Path], typer.Option(help="A Hugging Face config.json (or its folder) instead of a preset.")] = None,
    gpu: Annotated[Optional[str], typer.Option(help="Target GPU from the catalogue, e.g. 'rtx pro 6000', 'h200', 'b200'.")] = None,
    arch: Annotated[Optional[str], typer.Option(help="Target architecture instead of a GPU, e.g. sm120, sm90.")] = None,
    tp: Annotated[int, typer.Option(min=1, help="Tensor-parallel degree.")] = 1,
    ep: Annotated[int, typer.Option(min=1, help="Expert-parallel degree.")] = 1,
    tokens: Annotated[str, typer.Option(help="Token buckets, e.g. 1,16,64,4096.")] = "1,16,64,4096",
    mode: Annotated[str, typer.Option(help="w4a16 or w4a4.")] = "w4a16",
    explain: Annotated[bool, typer.Option(help="List rejected configurations with the reason.")] = False,
    no_compile: Annotated[bool, typer.Option("--no-compile", help="Judge by the analytical model only.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for machines.")] = False,
) -> None:
    """Plan every FP4 GEMM of a model for a target GPU: proven by cross-compilation, no GPU needed.

    Compilation results are kept in $FP4MOE_CACHE_DIR/plan (default ~/.cache/fp4moe/plan): a second
    plan of the same kernels takes seconds.
    """
    from .. import models
    from ..target import resolve_target

    if (model is None) == (config is None):
        raise typer.BadParameter("give exactly one of --model and --config", param_hint="--model/--config")
    try:
        spec = models.get_model(model) if model is not None else models.from_hf_config(config)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--model" if model is not None else "--config") from None
    try:
        target, product = resolve_target(gpu=gpu, arch=arch)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--gpu/--arch") from None
    try:
        buckets = tuple(int(t) for t in tokens.split(","))
        if any(t < 1 for t in buckets):
            raise ValueError
    except ValueError:
        raise typer.BadParameter(f"expected positive integers separated by commas, got {tokens!r}",
                                 param_hint="--tokens") from None
    mode = mode.lower()
    if mode not in ("w4a16", "w4a4"):
        raise typer.BadParameter(f"expected w4a16 or w4a4, got {mode!r}", param_hint="--mode")
    console = Console(stderr=as_json)
    if not console.is_terminal:  # a log or a pipe: do not squeeze the table into 80 columns
        console = Console(stderr=as_json, width=170)
    start = time.perf_counter()
    what = f"planning {spec.name} on {product.name if product else target.name} (cross-compiling for the target)"
    if not console.is_terminal:  # a log or a pipe gets no spinner: say what the wait is
        console.print(what + " ...", highlight=False)
    with console.status(what) as status:
        def progress(done: int, total: int) -> None:
            status.update(f"{what}: {done}/{total} compiled")

        try:
            planned = plan_model(spec, arch=target, gpu=product, tp=tp, ep=ep, tokens=buckets, mode=mode,
                                 compile=not no_compile, progress=progress)
        except ValueError as err:
            hint, message = _option_of(str(err))
            raise typer.BadParameter(message, param_hint=hint) from None
    seconds = time.perf_counter() - start
    rows = [_row(*p) for p in planned]
    if as_json:
        payload = {"model": spec.name, "target": target.name, "gpu": product.name if product else None, "tp": tp,
                   "ep": ep, "mode": mode, "seconds": seconds, "rows": rows}
        if explain:
            payload["plans"] = [r.as_dict(rejected=True) for *_, r in planned]
        typer.echo(json.dumps(payload, indent=2, default=str))
        return
    limit = target.smem_per_block_optin
    table = Table(title=f"{spec.name} on {product.name if product else target.name} ({target.name}, "
                        f"{limit:,} B shared memory per block), tp={tp} ep={ep}, {mode}")
    for col in ("tokens", "op", "N×K (M)", "configuration", "shared memory", "regs", "MMA", "µs (model)", "of roofline"):
        table.add_column(col, overflow="fold")
    for (t, name, op, r), row in zip(planned, rows):
        if r.kernel in _GROUPED_KERNELS:
            p = r.problem
            shape = f"{p.E}× {p.weight_rows}×{p.K} ({p.pairs} rows)"
        else:
            # the activation kernels (quantize, dequantize): K of their own problem, its rows as M
            shape = f"{op.N}×{op.K} (M={op.M})" if op is not None else f"{r.problem.K} (M={r.problem.M})"
        if row.get("error"):
            table.add_row(str(t), name, shape, f"[red]{row['error']}[/red]", "", "", "", "", "")
            continue
        shared = row["shared_compiled"] if row["shared_compiled"] is not None else row["shared_model"]
        proof = "" if row["proven"] else " (model)"
        mma = short_mma(row["mma"])
        table.add_row(str(t), name, shape, row["config"], f"{shared:,} / {limit:,} B{proof}", str(row["registers"] or "—"),
                      mma, f"{row['modelled_us']:.1f}",
                      "<1%" if row['fraction_of_peak'] < 0.005 else f"{row['fraction_of_peak']:.0%}")
    console.print(table)
    if explain:
        for *_, r in planned:
            console.print(r.explain(rejected=True), highlight=False, markup=False)
    else:  # the shared-memory breakdown of the first row that uses shared memory
        from .planner import smem_breakdown

        shown = next(((t, name, r.chosen.smem) for t, name, _, r in planned
                      if r.chosen is not None and r.chosen.smem.total > 0), None)
        if shown is not None:
            t, name, smem = shown
            console.print(f"shared memory of {name} at {t} tokens: {smem_breakdown(smem)} (--explain: every row)",
                          highlight=False, markup=False)
    console.print(f"planned {len(rows)} kernels in {seconds:.1f} s", highlight=False)
