"""Benchmark of a whole model's decode step: fp4moe against transformers bf16 on the same random model
(``fp4moe bench model``).

The model is the preset's transformers class with its real layer shapes (GLM-5: ``glm_moe_dsa``,
with DeepSeek-V3's class and GLM-5's shapes where the installed transformers lacks it) and fewer
layers: one dense layer (where the model has dense layers) and as many MoE layers as let the bf16
model fit the GPU (``layers``). Its
random bf16 weights are timed first, then quantized in place (``quantize_model``: MoE experts and
every Linear projection to NVFP4, W4A16; embeddings, norms, routers and ``lm_head`` stay bf16) and
timed again: the same model, the same prompts.

Each model runs in two modes, and its faster one is its figure:

* ``graph``: fp4moe's decode-step runner (``integrations.transformers.decode``): a static cache and
  the whole step replayed from one CUDA graph; transformers' experts on its ``grouped_mm``
  implementation (its capturable one);
* ``plain``: ``model.generate`` as a user calls it (dynamic cache; fp4moe's modules replay graphs of
  their own calls); tokens/s from the difference of two generate lengths, so the prefill cancels.

The bound of a step is every weight byte it reads (all parameters except the embedding table, of
which one row per token, and except the routed experts, of which the ones the step's tokens choose:
their mean count per MoE layer measured by routing the step's own inputs through the fp4moe model's
routers) at the copy bandwidth measured in the same run; KV-cache reads are not in it. The per-part
breakdown is the profiler's device time of one eager step, split by the decoder layers' attention,
MoE and dense MLP modules ("other": embedding, norms, ``lm_head``, sampling).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console

from .report import one_line

__all__ = ["DEFAULT_BATCHES", "MODEL_TYPES", "bench_config", "run_model_bench"]

DEFAULT_BATCHES: tuple[int, ...] = (1, 16, 64)
#: preset -> transformers model types to try, first available first
MODEL_TYPES: dict[str, tuple[str, ...]] = {
    "glm-5": ("glm_moe_dsa", "deepseek_v3"),
    "deepseek-v3": ("deepseek_v3",),
    "qwen3-30b-a3b": ("qwen3_moe",),
}
PROMPT = 32  # prompt tokens of the decode rows
HEADROOM_BYTES = 12 * 2**30  # caches, activations, graphs and one MoE layer's FP4 copy while it is converted


def bench_config(preset: str, layers: int):
    """The transformers config of ``preset`` with ``layers`` layers (the first dense where the model
    has dense layers), GLM-5's shapes
    on DeepSeek-V3's class where transformers has no ``glm_moe_dsa``."""
    import transformers

    from ..models import get_model

    if preset not in MODEL_TYPES:
        raise ValueError(f"model: expected one of {', '.join(MODEL_TYPES)}, got {preset!r}")
    spec = get_model(preset)
    model_type = next((t for t in MODEL_TYPES[preset] if t in transformers.CONFIG_MAPPING), None)
    if model_type is None:
        raise ValueError(f"model {preset}: the installed transformers {transformers.__version__} has none of "
                         f"{', '.join(MODEL_TYPES[preset])}")
    common = dict(num_hidden_layers=layers, max_position_embeddings=4096, pad_token_id=0, bos_token_id=0,
                  eos_token_id=None, tie_word_embeddings=False)
    if model_type == "qwen3_moe":  # no dense layers in the real model, none here
        cfg = transformers.AutoConfig.for_model(model_type, **common)
    else:
        cfg = transformers.AutoConfig.for_model(model_type, first_k_dense_replace=1, **common)
    if model_type == "deepseek_v3" and preset == "glm-5":  # GLM-5's MoE and attention shapes
        for key, value in dict(hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
                               n_routed_experts=256, num_experts_per_tok=8, n_group=1, topk_group=1,
                               num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512,
                               qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                               vocab_size=154880).items():
            setattr(cfg, key, value)
    if getattr(cfg, "hidden_size", None) != spec.hidden:
        raise ValueError(f"model {preset}: {model_type}'s defaults are not the preset's shapes")
    return cfg


def _param_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def auto_layers(preset: str, free_bytes: int) -> int:
    """Layers (one dense where the model has dense layers, the rest MoE) whose bf16 weights fit ``free_bytes`` with ``HEADROOM_BYTES``
    to spare: sized on the meta device."""
    import torch
    import transformers

    from ..models import get_model

    spec = get_model(preset)
    n_dense = 1 if spec.first_dense_layers else 0
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(bench_config(preset, n_dense + 1), dtype=torch.bfloat16)
    layers = m.model.layers
    dense = _param_bytes(layers[0]) if n_dense else 0
    moe = _param_bytes(layers[n_dense])
    rest = _param_bytes(m) - dense - moe
    n = min(int((free_bytes - HEADROOM_BYTES - rest - dense) // moe), spec.moe_layers)
    if n < 1:
        raise ValueError(f"model {preset}: one MoE layer in bf16 ({moe / 2**30:.1f} GiB) and the rest "
                         f"({(rest + dense) / 2**30:.1f} GiB) do not fit {free_bytes / 2**30:.1f} GiB free")
    return n_dense + n


def _build(preset: str, layers: int, seed: int):
    import torch
    import transformers

    cfg = bench_config(preset, layers)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16,
                                                                  experts_implementation="grouped_mm")
        except (TypeError, ValueError):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
            model.config._experts_implementation = "grouped_mm"
    model.generation_config.pad_token_id = 0
    return model.eval()


def _is_moe(module) -> bool:
    from ..integrations.transformers import FAMILIES
    from ..nn import FP4MoE

    classes = {c for f in FAMILIES.values() for c in f.block_classes}
    return isinstance(module, FP4MoE) or type(module).__name__ in classes


def _part_modules(model) -> dict[str, str]:
    """module name -> part ("attention", "moe", "dense") of every decoder layer's attention and MLP."""
    parts = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if ".layers." not in f".{name}" or leaf not in ("self_attn", "mlp"):
            continue
        parts[name] = "attention" if leaf == "self_attn" else ("moe" if _is_moe(module) else "dense")
    return parts


def _breakdown(model, step) -> dict[str, float]:
    """Device µs of one eager ``step()`` per part (``_part_modules``), "other" the rest."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    parts = _part_modules(model)
    stack: list = []
    handles = []
    for name, part in parts.items():
        module = model.get_submodule(name)

        def pre(_m, _a, part=part):
            ctx = record_function(f"fp4moe_part::{part}")
            ctx.__enter__()
            stack.append(ctx)

        def post(_m, _a, _o):
            stack.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    out = {"attention": 0.0, "moe": 0.0, "dense": 0.0}
    total = 0.0
    for e in prof.key_averages():
        if e.key.startswith("fp4moe_part::"):
            out[e.key.split("::", 1)[1]] += e.device_time_total
        else:
            total += e.self_device_time_total
    out["other"] = max(0.0, total - sum(out.values()))
    out["total"] = total
    return out


def _unique_experts(model, step) -> float | None:
    """Mean unique experts per MoE layer that one eager ``step()`` of an fp4moe model routes to."""
    import torch

    from ..nn import FP4MoE

    blocks = [m for m in model.modules() if isinstance(m, FP4MoE)]
    if not blocks:
        return None
    seen: list[int] = []

    def hook(module, args):
        x = args[0]
        ids = module.route(x.reshape(-1, x.shape[-1])).topk_ids
        seen.append(int(torch.unique(ids[ids >= 0]).numel()))

    handles = [b.register_forward_pre_hook(hook) for b in blocks]
    try:
        step()
    finally:
        for h in handles:
            h.remove()
    return sum(seen) / len(seen)


def step_bytes(model, batch: int, unique_experts: float) -> int:
    """Weight bytes one decode step of ``batch`` tokens reads (module docstring)."""
    from ..nn import FP4MoE

    total = _param_bytes(model)
    emb = model.get_input_embeddings().weight
    total += batch * emb.shape[1] * emb.element_size() - emb.numel() * emb.element_size()
    for m in model.modules():
        if isinstance(m, FP4MoE):
            E = m.w13.shape[0]
            experts = sum(t.numel() * t.element_size() for name, t in m._buffers.items()
                          if t is not None and name.startswith(("w13_weight", "w2_weight")))
        elif _is_moe(m):
            E = int(m.experts.gate_up_proj.shape[0])
            experts = _param_bytes(m.experts)
        else:
            continue
        total += int(experts * (min(unique_experts, E) / E)) - experts
    return total


def _measure(model, label: str, batches: Sequence[int], steps: int, prefill: int, gen, console: Console,
             unique: dict[int, float]) -> list[dict[str, Any]]:
    import torch

    from ..integrations.transformers.decode import DecodeGraphs
    from .timing import time_plain_calls

    vocab = model.config.vocab_size
    rows = []
    for B in batches:
        row: dict[str, Any] = {"kind": "decode", "weights": label, "batch": B, "graph_step_us": None,
                               "plain_step_us": None, "best": None, "tokens_per_s": None, "unique_experts": None,
                               "bound_us": None, "frac_bound": None, "moe_us": None, "attention_us": None,
                               "dense_us": None, "other_us": None, "graph_error": None, "error": None}
        try:
            ids = torch.randint(1, vocab, (B, PROMPT), device="cuda", generator=gen)
            runner = DecodeGraphs(model, B, PROMPT + 3 * steps + 8)
            with torch.no_grad():
                runner.prefill(ids, 3 * steps + 4)
                runner.advance()  # eager: compile, probes
                runner.advance()  # captured
                if runner.state.failed:
                    row["graph_error"] = one_line(runner.state.failed, 200)
                else:
                    row["graph_step_us"] = time_plain_calls(runner.advance, calls=steps)[0].median_us
                # the same step, eager, for the expert count and the per-part profile
                runner.prefill(ids, 4)
                if label == "fp4moe":
                    unique[B] = _unique_experts(model, runner.eager_step)
                runner.prefill(ids, 4)
                parts = _breakdown(model, runner.eager_step)
            for key in ("moe", "attention", "dense", "other"):
                row[f"{key}_us"] = parts[key]
            # plain: model.generate as users call it; two lengths, so that prefill and set-up cancel
            gen_kw = dict(do_sample=False, pad_token_id=0)
            with torch.no_grad():
                model.generate(ids, max_new_tokens=4, min_new_tokens=4, **gen_kw)  # warm-up
                model.generate(ids, max_new_tokens=4 + steps, min_new_tokens=4 + steps, **gen_kw)
                t = [time_plain_calls(lambda n=n: model.generate(ids, max_new_tokens=n, min_new_tokens=n, **gen_kw),
                                      reps=1)[0].median_us for n in (4, 4 + steps)]
            if t[1] <= t[0]:
                raise RuntimeError(f"generate of {4 + steps} tokens took no longer than of 4 ({t[1]:.0f} µs, "
                                   f"{t[0]:.0f} µs): too few --steps to time")
            row["plain_step_us"] = (t[1] - t[0]) / steps
            times = {k: row[f"{k}_step_us"] for k in ("graph", "plain") if row[f"{k}_step_us"]}
            row["best"] = min(times, key=times.get)
            row["tokens_per_s"] = B / (times[row["best"]] * 1e-6)
            del runner
        except Exception as err:  # noqa: BLE001 - reported in the row
            row["error"] = f"{type(err).__name__}: {one_line(str(err), 200)}"
        console.print(f"{label} batch {B}: " + (f"[red]{row['error']}[/red]" if row["error"] else
                      f"graph {row['graph_step_us'] or float('nan'):.0f} µs/step, plain {row['plain_step_us']:.0f}; "
                      f"{row['tokens_per_s']:.1f} tokens/s ({row['best']})"
                      + (f"; graph capture failed: {row['graph_error']}" if row["graph_error"] else "")))
        rows.append(row)
        torch.cuda.empty_cache()
    if prefill:
        row = {"kind": "prefill", "weights": label, "tokens": prefill, "us": None, "tokens_per_s": None, "error": None}
        try:
            ids = torch.randint(1, vocab, (1, prefill), device="cuda", generator=gen)
            with torch.no_grad():
                run = lambda: model(ids, use_cache=False, logits_to_keep=1)  # noqa: E731
                run()
                row["us"] = time_plain_calls(run, calls=2)[0].median_us
            row["tokens_per_s"] = prefill / (row["us"] * 1e-6)
        except Exception as err:  # noqa: BLE001
            row["error"] = f"{type(err).__name__}: {one_line(str(err), 200)}"
        console.print(f"{label} prefill {prefill}: " + (f"[red]{row['error']}[/red]" if row["error"] else
                                                        f"{row['us'] / 1e3:.1f} ms, {row['tokens_per_s']:,.0f} tokens/s"))
        rows.append(row)
    return rows


def run_model_bench(preset: str = "glm-5", *, layers: int | None = None, batches: Sequence[int] = DEFAULT_BATCHES,
                    steps: int = 32, prefill: int = 2048, ceilings: Mapping[str, Any] | None = None,
                    console: Console | None = None, seed: int = 0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows (decode per weights and batch, prefill, the fp4moe / bf16 comparison) and facts of the model
    (class, layers, weight sizes)."""
    import torch

    from ..integrations.transformers.convert import quantize_model
    from .linear import bench_ceilings

    console = console or Console()
    ceilings = ceilings if ceilings is not None else bench_ceilings()
    if layers is None:
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        layers = auto_layers(preset, free)
    model = _build(preset, layers, seed)
    facts = {"model": preset, "class": type(model).__name__, "layers": layers,
             "moe_layers": sum(1 for m in model.modules() if _is_moe(m)),
             "bf16_weight_gib": _param_bytes(model) / 2**30, "prompt": PROMPT, "steps": steps}
    console.print(f"{facts['class']} with {preset}'s shapes: {layers} layers ({facts['moe_layers']} MoE), "
                  f"{facts['bf16_weight_gib']:.1f} GiB in bf16")
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    unique: dict[int, float] = {}
    rows = _measure(model, "bf16", batches, steps, prefill, gen, console, unique)
    t = time.perf_counter()
    quantize_model(model)
    facts["quantize_s"] = time.perf_counter() - t
    facts["fp4_weight_gib"] = _param_bytes(model) / 2**30
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)  # the same prompts
    rows += _measure(model, "fp4moe", batches, steps, prefill, gen, console, unique)
    # bounds: the expert counts measured on the fp4moe model's routing (the bf16 routers are the same)
    for row in rows:
        if row["kind"] != "decode" or row.get("error") or unique.get(row["batch"]) is None:
            continue
        row["unique_experts"] = unique[row["batch"]]
        if row["weights"] == "fp4moe":
            row["bound_us"] = step_bytes(model, row["batch"], row["unique_experts"]) / (ceilings["copy_gbs"] * 1e3)
    del model
    torch.cuda.empty_cache()
    return finish(rows, facts, ceilings), facts


def bf16_step_bytes(preset: str, layers: int, batch: int, unique_experts: float) -> int:
    """``step_bytes`` of the bf16 model, sized on the meta device (it is gone when the bounds are made)."""
    import torch
    import transformers

    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(bench_config(preset, layers), dtype=torch.bfloat16)
    return step_bytes(m, batch, unique_experts)


def finish(rows: list[dict[str, Any]], facts: Mapping[str, Any], ceilings: Mapping[str, Any]) -> list[dict[str, Any]]:
    """bf16 bounds, fractions of the bound and the fp4moe / bf16 comparison rows."""
    for row in rows:
        if row["kind"] == "decode" and row["weights"] == "bf16" and row.get("unique_experts") is not None:
            row["bound_us"] = bf16_step_bytes(facts["model"], facts["layers"], row["batch"],
                                              row["unique_experts"]) / (ceilings["copy_gbs"] * 1e3)
        if row["kind"] == "decode" and row.get("bound_us") and row.get("tokens_per_s"):
            row["frac_bound"] = row["bound_us"] / (row["batch"] / row["tokens_per_s"] * 1e6)
    out = list(rows)
    decode = {(r["weights"], r["batch"]): r for r in rows if r["kind"] == "decode"}
    for (w, B), r in decode.items():
        base = decode.get(("bf16", B))
        if w != "fp4moe" or base is None or not r.get("tokens_per_s") or not base.get("tokens_per_s"):
            continue
        cmp = {"kind": "comparison", "batch": B, "fp4moe_tokens_per_s": r["tokens_per_s"],
               "bf16_tokens_per_s": base["tokens_per_s"], "speedup": r["tokens_per_s"] / base["tokens_per_s"],
               "graph_speedup": None, "fp4moe_step_over_bound": None, "bound_ratio": None}
        if r.get("graph_step_us") and base.get("graph_step_us"):
            cmp["graph_speedup"] = base["graph_step_us"] / r["graph_step_us"]
        if r.get("bound_us"):
            cmp["fp4moe_step_over_bound"] = (B / r["tokens_per_s"] * 1e6) / r["bound_us"]
        if r.get("bound_us") and base.get("bound_us"):
            cmp["bound_ratio"] = base["bound_us"] / r["bound_us"]
        out.append(cmp)
    return out
