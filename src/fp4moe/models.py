"""Model presets (the MoE part of each model) and a reader for Hugging Face ``config.json`` files.

Numbers are from the models' published configurations (REFERENCE.md restates them).
``fp4_linear_ops`` lists the FP4 GEMMs of one layer at a tensor/expert-parallel degree, which is
what ``fp4 plan`` plans.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["MoEModel", "Routing", "PRESETS", "get_model", "from_hf_config", "LinearOp", "fp4_linear_ops"]

RoutingKind = Literal["softmax", "sigmoid_bias", "gpt_oss"]


@dataclass(frozen=True)
class Routing:
    """How a token chooses its experts (see REFERENCE.md "Routing")."""

    kind: RoutingKind
    top_k: int
    renormalize: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        # types and ranges only; what depends on the expert count is checked where E is known
        if self.kind not in ("softmax", "sigmoid_bias", "gpt_oss"):
            raise ValueError(f"Routing.kind: expected 'softmax', 'sigmoid_bias' or 'gpt_oss', got {self.kind!r}")
        for name in ("top_k", "n_group", "topk_group"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Routing.{name}: expected a positive int, got {v!r}")
        if not isinstance(self.renormalize, bool):
            raise ValueError(f"Routing.renormalize: expected a bool, got {self.renormalize!r}")
        f = self.routed_scaling_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0:
            raise ValueError(f"Routing.routed_scaling_factor: expected a positive finite number, got {f!r}")


@dataclass(frozen=True)
class MoEModel:
    name: str
    hidden: int
    expert_intermediate: int
    n_experts: int
    routing: Routing
    n_shared_experts: int
    n_layers: int
    first_dense_layers: int  # leading layers with a dense MLP instead of MoE
    dense_intermediate: int  # that dense MLP's intermediate size (0 if none)
    fmt: str = "nvfp4"  # the FP4 format its public checkpoints use

    def __post_init__(self) -> None:
        for field in ("hidden", "expert_intermediate", "n_experts", "n_layers"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{self.name}: {field} must be positive, got {getattr(self, field)}")
        if not 1 <= self.routing.top_k <= self.n_experts:
            raise ValueError(f"{self.name}: top_k must be in 1..{self.n_experts}, got {self.routing.top_k}")

    @property
    def moe_layers(self) -> int:
        return self.n_layers - self.first_dense_layers


PRESETS: dict[str, MoEModel] = {
    "glm-5": MoEModel(
        name="glm-5", hidden=6144, expert_intermediate=2048, n_experts=256,
        routing=Routing("sigmoid_bias", top_k=8, n_group=1, topk_group=1, routed_scaling_factor=2.5),
        n_shared_experts=1, n_layers=78, first_dense_layers=3, dense_intermediate=12288,
    ),
    "deepseek-v3": MoEModel(
        name="deepseek-v3", hidden=7168, expert_intermediate=2048, n_experts=256,
        routing=Routing("sigmoid_bias", top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5),
        n_shared_experts=1, n_layers=61, first_dense_layers=3, dense_intermediate=18432,
    ),
    "qwen3-30b-a3b": MoEModel(
        name="qwen3-30b-a3b", hidden=2048, expert_intermediate=768, n_experts=128,
        routing=Routing("softmax", top_k=8), n_shared_experts=0, n_layers=48, first_dense_layers=0,
        dense_intermediate=0,
    ),
    "gpt-oss-120b": MoEModel(
        name="gpt-oss-120b", hidden=2880, expert_intermediate=2880, n_experts=128,
        routing=Routing("gpt_oss", top_k=4), n_shared_experts=0, n_layers=36, first_dense_layers=0,
        dense_intermediate=0, fmt="mxfp4",
    ),
}


def get_model(name: str) -> MoEModel:
    key = name.strip().lower()
    if key not in PRESETS:
        raise ValueError(f"model: expected one of {sorted(PRESETS)} (or --config path/to/config.json), got {name!r}")
    return PRESETS[key]


def _first(cfg: dict, *keys: str, default=None):
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return default


def from_hf_config(path: str | Path) -> MoEModel:
    """Read the MoE shape of a model from a Hugging Face ``config.json`` (or its folder).

    Understands DeepSeek-V3 / GLM (``n_routed_experts``, ``moe_intermediate_size``,
    ``n_group``, ``routed_scaling_factor``, ``first_k_dense_replace``), Qwen-MoE / Mixtral
    (``num_experts`` / ``num_local_experts``, ``norm_topk_prob``) and gpt-oss.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"config: no such file {str(p)!r}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"config: {str(p)!r} is not valid JSON ({err})") from None
    if isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]  # multimodal wrappers
    if not isinstance(cfg, dict):
        raise ValueError(f"config: {str(p)!r} holds a JSON {type(cfg).__name__}, expected an object "
                         "(a Hugging Face config.json)")
    model_type = str(cfg.get("model_type", "unknown"))
    n_experts = _first(cfg, "n_routed_experts", "num_experts", "num_local_experts")
    if not n_experts:
        raise ValueError(f"config: {str(p)!r} (model_type {model_type!r}) has no experts "
                         "(n_routed_experts / num_experts / num_local_experts): not a MoE model fp4moe knows")
    hidden = _first(cfg, "hidden_size")
    inter = _first(cfg, "moe_intermediate_size", "intermediate_size")
    top_k = _first(cfg, "num_experts_per_tok", "experts_per_token", "moe_topk", default=None)
    missing = [k for k, v in (("hidden_size", hidden), ("moe_intermediate_size", inter),
                              ("num_experts_per_tok", top_k)) if not v]
    if missing:
        raise ValueError(f"config: {str(p)!r} lacks {', '.join(missing)}")
    try:
        return _model_from_config(cfg, model_type, n_experts, hidden, inter, top_k)
    except (TypeError, ValueError) as err:  # a value of the wrong type or range: name the file
        raise ValueError(f"config: {str(p)!r}: {err}") from None


def _model_from_config(cfg: dict, model_type: str, n_experts, hidden, inter, top_k) -> MoEModel:
    if model_type.startswith("gpt_oss"):
        routing = Routing("gpt_oss", top_k=int(top_k))
        fmt = "mxfp4"
    elif _first(cfg, "scoring_func", default="softmax") == "sigmoid" or "n_group" in cfg:
        routing = Routing("sigmoid_bias", top_k=int(top_k), renormalize=bool(_first(cfg, "norm_topk_prob", default=True)),
                          n_group=int(_first(cfg, "n_group", default=1)),
                          topk_group=int(_first(cfg, "topk_group", default=1)),
                          routed_scaling_factor=float(_first(cfg, "routed_scaling_factor", default=1.0)))
        fmt = "nvfp4"
    else:
        routing = Routing("softmax", top_k=int(top_k), renormalize=bool(_first(cfg, "norm_topk_prob", default=True)))
        fmt = "nvfp4"
    first_dense = int(_first(cfg, "first_k_dense_replace", default=0))
    return MoEModel(
        name=str(_first(cfg, "_name_or_path", default=model_type)) or model_type,
        hidden=int(hidden), expert_intermediate=int(inter), n_experts=int(n_experts), routing=routing,
        n_shared_experts=int(_first(cfg, "n_shared_experts", default=0)),
        n_layers=int(_first(cfg, "num_hidden_layers", default=1)), first_dense_layers=first_dense,
        dense_intermediate=int(_first(cfg, "intermediate_size", default=0)) if first_dense else 0, fmt=fmt,
    )


@dataclass(frozen=True)
class LinearOp:
    """One FP4 GEMM of a layer: ``y[M, N] = x[M, K] @ W[N, K]^T`` for M tokens (per expert)."""

    name: str
    N: int
    K: int
    M: int
    count: int  # how many such GEMMs run per layer on one GPU (e.g. active experts)


def fp4_linear_ops(model: MoEModel, tokens: int, *, tp: int = 1, ep: int = 1) -> list[LinearOp]:
    """The FP4 GEMMs of one MoE layer (and the dense-MLP layers) on one GPU for a batch of tokens.

    Tensor parallelism splits each expert's intermediate dimension by ``tp``; expert
    parallelism gives each GPU ``n_experts / ep`` experts. With uniform routing an active
    expert sees about ``tokens * top_k / n_experts`` tokens (at least one).
    """
    if tokens < 1:
        raise ValueError(f"tokens: expected >= 1, got {tokens}")
    for name, v in (("tp", tp), ("ep", ep)):
        if v < 1:
            raise ValueError(f"{name}: expected >= 1, got {v}")
    if model.expert_intermediate % tp:
        raise ValueError(f"tp: {model.name}'s expert intermediate {model.expert_intermediate} is not divisible by {tp}")
    if model.n_experts % ep:
        raise ValueError(f"ep: {model.name}'s {model.n_experts} experts are not divisible by {ep}")
    H, inter = model.hidden, model.expert_intermediate // tp
    block = 16 if model.fmt == "nvfp4" else 32  # the format's block: every FP4 GEMM's K is a multiple of it
    if H % block:
        raise ValueError(f"{model.name}: hidden size {H} is not a multiple of the {model.fmt} block size {block} "
                         "(the K of the gate/up projections)")
    if inter % block:
        raise ValueError(f"tp: {tp} leaves {inter} of {model.name}'s expert intermediate {model.expert_intermediate} "
                         f"per GPU, not a multiple of the {model.fmt} block size {block} (the K of the down projection)")
    local = model.n_experts // ep
    routed = tokens * model.routing.top_k
    per_expert = max(1, -(-routed // model.n_experts))
    active = min(local, max(1, -(-routed * local // model.n_experts)))
    ops = [
        LinearOp("experts.w13 (gate+up)", N=2 * inter, K=H, M=per_expert, count=active),
        LinearOp("experts.w2 (down)", N=H, K=inter, M=per_expert, count=active),
    ]
    if model.n_shared_experts:
        s_inter = inter * model.n_shared_experts
        ops += [LinearOp("shared.w13", N=2 * s_inter, K=H, M=tokens, count=1),
                LinearOp("shared.w2", N=H, K=s_inter, M=tokens, count=1)]
    if model.first_dense_layers and model.dense_intermediate:
        d_inter = model.dense_intermediate // tp
        ops += [LinearOp("dense.w13", N=2 * d_inter, K=H, M=tokens, count=1),
                LinearOp("dense.w2", N=H, K=d_inter, M=tokens, count=1)]
    return ops
