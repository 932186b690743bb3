"""Modules: ``FP4Linear`` and ``FP4MoE``."""

from __future__ import annotations

import torch
from torch import nn

from .formats import FP4Format, get_format
from .graphs import CallGraphs
from .ops.linear import Mode, fp4_linear, global_scale_tensor
from .quantize import FP4Tensor, quantize, quantize_stacked

__all__ = ["FP4Linear", "FP4MoE", "GatedMLP"]


def _call_graphs(module: nn.Module) -> CallGraphs:
    """The module's graphs of its own calls (``fp4moe.graphs``), made on first use."""
    graphs = module.__dict__.get("_graphs")
    if graphs is None:
        graphs = module.__dict__["_graphs"] = CallGraphs()
    return graphs


def _apply_keeping_dtypes(module: nn.Module, names: tuple[str, ...], fn, recurse: bool) -> None:
    """``nn.Module._apply`` (``.to()``, ``.cuda()``, ``.half()``), except that the buffers ``names``
    (FP4 bytes, block scales, fp32 globals) keep their dtypes and only follow the device; the
    module's call graphs are dropped (they read the old tensors)."""
    _call_graphs(module).clear()
    kept = {name: module._buffers[name] for name in names if module._buffers.get(name) is not None}
    nn.Module._apply(module, fn, recurse)
    for name, old in kept.items():
        new = module._buffers[name]
        if new is not None and new.dtype != old.dtype:
            module._buffers[name] = old.to(new.device)


class FP4Linear(nn.Module):
    """A linear layer with FP4 weights: ``y = x @ W^T + b``.

    The packed weight, its block scales and global scale are buffers (they move with
    ``.to()`` / ``.cuda()`` and are saved in the state dict as ``weight``, ``weight_scale`` and
    ``weight_scale_2``, the ModelOpt names).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, fmt: str | FP4Format = "nvfp4",
                 mode: Mode = "w4a16", dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None):
        super().__init__()
        fmt = get_format(fmt)
        if in_features % fmt.block_size:
            raise ValueError(f"in_features: expected a multiple of the {fmt} block size {fmt.block_size}, "
                             f"got {in_features}")
        if mode not in ("w4a16", "w4a4"):
            raise ValueError(f"mode: expected 'w4a16' or 'w4a4', got {mode!r}")
        if mode == "w4a4" and fmt.name != "nvfp4":
            raise ValueError(f"mode: 'w4a4' needs NVFP4 weights, got fmt={fmt}")
        self.in_features, self.out_features, self.fmt, self.mode = in_features, out_features, fmt, mode
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, in_features // fmt.block_size,
                                                        device=device).to(fmt.scale_dtype))
        self.register_buffer("weight_scale_2", torch.ones((), dtype=torch.float32, device=device)
                             if fmt.has_global_scale else None)
        self.register_buffer("input_scale", None)  # W4A4 static activation global scale, optional
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        from .ops._runtime import check_fp4_state_dict

        self.register_load_state_dict_pre_hook(check_fp4_state_dict)  # load_state_dict checks the values it loads

    def _apply(self, fn, recurse=True):
        """``.to(dtype)`` / ``.half()`` must not touch the FP4 buffers: keep their dtypes, follow the device."""
        _apply_keeping_dtypes(self, tuple(self._buffers), fn, recurse)
        if self.weight.is_cuda:
            # the packed kernels read the weight in MMA operand order (ops.linear.mma_packed): W4A16, and
            # W4A4 where the GPU has no FP4 MMA; pack it now, outside any CUDA graph capture
            from .ops.linear import device_arch, mma_packed, runs_packed

            if runs_packed(self.mode, device_arch(self.weight.device)):
                mma_packed(self.weight_fp4)
        return self

    @property
    def weight_fp4(self) -> FP4Tensor:
        return FP4Tensor(data=self.weight, scales=self.weight_scale, global_scale=self.weight_scale_2,
                         shape=torch.Size((self.out_features, self.in_features)), fmt=self.fmt)

    @classmethod
    def from_fp4(cls, weight: FP4Tensor, bias: torch.Tensor | None = None, *, mode: Mode = "w4a16",
                 input_scale: torch.Tensor | float | None = None) -> FP4Linear:
        if not isinstance(weight, FP4Tensor) or len(weight.shape) != 2:
            raise TypeError(f"weight: expected a 2-D FP4Tensor, got {type(weight).__name__}")
        from .ops._runtime import check_weight_scales

        check_weight_scales(weight, "weight")  # NaN/negative scales, bad global scale, MXFP4 range: once, here
        out_f, in_f = weight.shape
        dtype = bias.dtype if bias is not None else torch.bfloat16
        layer = cls(in_f, out_f, bias=bias is not None, fmt=weight.fmt, mode=mode, dtype=dtype, device=weight.device)
        layer.weight.copy_(weight.data)
        layer.weight_scale.copy_(weight.scales)
        if weight.global_scale is not None:
            layer.weight_scale_2.copy_(weight.global_scale.reshape(()))
        if bias is not None:
            layer.bias.data.copy_(bias.detach())
        if input_scale is not None:
            layer.input_scale = global_scale_tensor(input_scale, weight.device, "input_scale")
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str | FP4Format = "nvfp4", *, mode: Mode = "w4a16") -> FP4Linear:
        """Quantize an ``nn.Linear`` (any float dtype) to FP4; the bias keeps the layer's dtype."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear: expected torch.nn.Linear, got {type(linear).__name__}")
        block = get_format(fmt).block_size
        if linear.in_features % block:
            raise ValueError(f"linear: in_features must be a multiple of the {get_format(fmt)} block size {block}, "
                             f"got {linear.in_features}")
        weight = linear.weight.detach()
        if weight.dtype == torch.float64:  # quantize takes float32 at most; FP4 keeps far less than float32
            weight = weight.float()
        w = quantize(weight, fmt)
        bias = linear.bias.detach() if linear.bias is not None else None
        if bias is not None and bias.dtype not in (torch.bfloat16, torch.float16):
            bias = bias.to(torch.bfloat16)
        return cls.from_fp4(w, bias, mode=mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + b``; a repeated shape replays a CUDA graph of the call (``fp4moe.graphs``)."""
        graphs = _call_graphs(self)
        if (isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[-1] == self.in_features
                and graphs.eligible(self, x, x.numel() // max(1, self.in_features))):
            return graphs.run(self, self._forward_graphable, x, (self.mode, self.fmt))[0]
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return fp4_linear(x, self.weight_fp4, bias, mode=self.mode, input_global_scale=self.input_scale)

    def _forward_graphable(self, x: torch.Tensor):
        return self._forward(x), None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, "
                f"mode={self.mode}, bias={self.bias is not None}")


def register_experts(module: nn.Module, w13: FP4Tensor, w2: FP4Tensor) -> None:
    """Keep stacked FP4 experts as buffers under ModelOpt's names (``w13_weight``, ``w13_weight_scale``,
    ``w13_weight_scale_2``, and the same for ``w2``); ``module._fp4`` remembers each one's logical
    shape and format, from which ``FP4MoE._stacked`` rebuilds the FP4Tensor views."""
    module._fp4 = {}
    for name, t in (("w13", w13), ("w2", w2)):
        module.register_buffer(f"{name}_weight", t.data)
        module.register_buffer(f"{name}_weight_scale", t.scales)
        module.register_buffer(f"{name}_weight_scale_2", t.global_scale)
        module._fp4[name] = (t.shape, t.fmt)


def check_block_input(x, hidden: int) -> None:
    """What an MoE block takes: a bf16/fp16 tensor [..., hidden]."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != hidden:
        raise ValueError(f"x: expected [..., {hidden}] (hidden size {hidden}), got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"x: expected bfloat16 or float16, got {x.dtype}")


class FP4MoE(nn.Module):
    """A Mixture-of-Experts block with FP4 experts: router -> routing -> experts -> combine.

    Experts are stacked FP4Tensors ``w13`` [E, 2I, H] (gate rows then up rows, or interleaved as
    gpt-oss stores them) and ``w2`` [E, H, I]; the router is a bf16 linear [E, H] (not quantized)
    with an optional selection bias (DeepSeek-V3 / GLM-5 ``e_score_correction_bias``); the
    optional shared expert is a pair of FP4Linear layers added unweighted (or ``shared_expert``, any
    module ``x -> y``, e.g. a :class:`GatedMLP` whose gate and up carry different global scales).
    ``router_dtype`` is the dtype the router logits are computed in (default: x's; DeepSeek-V3 and
    GLM compute them in fp32). ``k0`` turns on opportunistic expert activation; ``last_stats``
    then holds the OEA statistics of the last call. ``check_finite`` is routing's
    (``ops.routing.route``): False (default) lets a token whose router logits hold NaN/Inf through
    with a NaN output row; True raises ValueError naming the token (one host sync per call);
    "async" raises through a device-side assertion (no sync, CUDA-graph capturable).

    The experts are buffers (``w13_weight``, ``w13_weight_scale``, ``w13_weight_scale_2`` and the
    same for ``w2``, ModelOpt's names), so they are in the state dict and follow ``.to()``
    without changing dtype; ``w13`` and ``w2`` are FP4Tensor views of them.
    """

    def __init__(self, router_weight: torch.Tensor, w13: FP4Tensor, w2: FP4Tensor, routing, *,
                 router_bias: torch.Tensor | None = None, selection_bias: torch.Tensor | None = None,
                 activation: str = "silu", interleaved: bool = False, w13_bias: torch.Tensor | None = None,
                 w2_bias: torch.Tensor | None = None, shared_gate_up: FP4Linear | None = None,
                 shared_down: FP4Linear | None = None, shared_expert: nn.Module | None = None,
                 router_dtype: torch.dtype | None = None, mode: Mode = "w4a16", k0: int | None = None,
                 check_finite: bool | str = False):
        super().__init__()
        from .ops.moe import check_mode_and_activation, check_moe_extras, check_moe_inputs
        from .ops.routing import _check as check_routing
        from .ops.routing import check_finite_option

        for name, t in (("w13", w13), ("w2", w2)):
            if not isinstance(t, FP4Tensor) or len(t.shape) != 3:
                raise TypeError(f"{name}: expected a stacked FP4Tensor [E, N, K] (fp4moe.quantize_stacked), got "
                                f"{type(t).__name__}{tuple(t.shape) if isinstance(t, FP4Tensor) else ''}")
        if not isinstance(router_weight, torch.Tensor):
            raise TypeError(f"router_weight: expected a torch.Tensor, got {type(router_weight).__name__}")
        E, two_i, H = w13.shape
        if E == 0:
            raise ValueError(f"w13: expected at least one expert, got {tuple(w13.shape)} (E = 0)")
        device = w13.device
        for name, t in (("router_weight", router_weight), ("router_bias", router_bias)):
            if t is not None and t.device != device:
                raise ValueError(f"{name}: expected device {device} (that of w13), got {t.device}")
        if router_weight.shape != (E, H):
            raise ValueError(f"router_weight: expected [{E}, {H}] (experts x hidden, from w13 {tuple(w13.shape)}), "
                             f"got {tuple(router_weight.shape)}")
        # what routing checks on every call, checked now against this block's expert count
        try:
            check_routing(torch.empty(0, E, dtype=torch.float32, device=w13.device), routing, selection_bias, k0,
                          kernel=False)
        except (TypeError, ValueError) as e:  # routing calls it bias; here it is selection_bias
            msg = str(e).replace("(that of logits)", "(that of w13)")
            raise type(e)("selection_" + msg if msg.startswith("bias:") else msg) from None
        probe_ids = torch.zeros(1, routing.top_k, dtype=torch.int32, device=w13.device)
        check_moe_inputs(torch.zeros(1, H, dtype=torch.bfloat16, device=w13.device), w13, w2, probe_ids,
                         torch.zeros(1, routing.top_k, device=w13.device))
        if (shared_gate_up is None) != (shared_down is None):
            raise ValueError("shared_gate_up and shared_down: give both or neither")
        if shared_expert is not None and shared_gate_up is not None:
            raise ValueError("shared_expert: give it or shared_gate_up/shared_down, not both")
        if router_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"router_dtype: expected None (x's dtype), float32, bfloat16 or float16, got {router_dtype}")
        check_mode_and_activation(mode, activation, w13)
        check_finite_option(check_finite)
        check_moe_extras(torch.empty(0, H, device=w13.device), E, two_i // 2, H, w13_bias, w2_bias, None)
        for name, m in (("shared_gate_up", shared_gate_up), ("shared_down", shared_down),
                        ("shared_expert", shared_expert)):
            if m is None:
                continue
            for part, t in (*m.named_parameters(), *m.named_buffers()):
                if t.device != device:
                    raise ValueError(f"{name}.{part}: expected device {device} (that of w13), got {t.device}; "
                                     f"move the module with .to({str(device)!r})")
        from .ops._runtime import check_weight_scales

        # NaN/negative block scales, bad global scales, MXFP4 range: once per weight, here
        check_weight_scales(w13, "w13")
        check_weight_scales(w2, "w2")
        self.routing, self.activation, self.interleaved, self.mode, self.k0 = routing, activation, interleaved, mode, k0
        self.check_finite = check_finite
        self.register_buffer("router_weight", router_weight.detach())
        self.register_buffer("router_bias", None if router_bias is None else router_bias.detach())
        self.register_buffer("selection_bias", None if selection_bias is None else selection_bias.detach().float())
        register_experts(self, w13, w2)
        self.register_buffer("w13_bias", w13_bias)
        self.register_buffer("w2_bias", w2_bias)
        from .ops._runtime import check_fp4_moe_state_dict

        self.register_load_state_dict_pre_hook(check_fp4_moe_state_dict)  # load_state_dict checks the values it loads
        self.shared_gate_up, self.shared_down = shared_gate_up, shared_down
        self.shared_expert = shared_expert
        self.router_dtype = router_dtype
        self.last_stats = None

    def _stacked(self, name: str) -> FP4Tensor:
        shape, fmt = self._fp4[name]
        return FP4Tensor(data=self._buffers[f"{name}_weight"], scales=self._buffers[f"{name}_weight_scale"],
                         global_scale=self._buffers[f"{name}_weight_scale_2"], shape=shape, fmt=fmt)

    @property
    def w13(self) -> FP4Tensor:
        """The gate and up experts [E, 2I, H] (a view of the buffers)."""
        return self._stacked("w13")

    @property
    def w2(self) -> FP4Tensor:
        """The down experts [E, H, I] (a view of the buffers)."""
        return self._stacked("w2")

    def _apply(self, fn, recurse=True):
        # the experts' FP4 parts, and the fp32 selection bias (DeepSeek/GLM select on fp32 scores + bias)
        _apply_keeping_dtypes(self, tuple(f"{n}_weight{p}" for n in self._fp4 for p in ("", "_scale", "_scale_2"))
                              + ("selection_bias",), fn, recurse)
        if self.w13.device.type == "cuda":
            # the packed kernels read the experts in MMA operand order (ops.moe.mma_packed_experts): W4A16,
            # and W4A4 where the GPU has no FP4 MMA; pack them now, outside any CUDA graph capture
            from .ops.linear import device_arch, runs_packed
            from .ops.moe import mma_packed_experts
            from .ops.mma_pack import ROWS

            if (runs_packed(self.mode, device_arch(self.w13.device))
                    and self.w13.shape[1] % ROWS == 0 and self.w2.shape[1] % ROWS == 0):
                mma_packed_experts(self.w13)
                mma_packed_experts(self.w2)
        return self

    @classmethod
    def from_bf16(cls, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing, *,
                  fmt: str = "nvfp4", shared_gate_up: torch.Tensor | None = None,
                  shared_down: torch.Tensor | None = None, **kwargs) -> FP4MoE:
        """Quantize a bf16 MoE block: expert weights [E, 2I, H] and [E, H, I] (one global per expert),
        optional shared expert weights [2Is, H] and [H, Is]."""
        q13, q2 = quantize_stacked(w13, fmt, name="w13"), quantize_stacked(w2, fmt, name="w2")
        # each part alone: the constructor says what is wrong with a shared expert given half
        sgu = None if shared_gate_up is None else FP4Linear.from_fp4(quantize(shared_gate_up.detach(), fmt))
        sd = None if shared_down is None else FP4Linear.from_fp4(quantize(shared_down.detach(), fmt))
        return cls(router_weight, q13, q2, routing, shared_gate_up=sgu, shared_down=sd, **kwargs)

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.shared_expert is not None:
            return self.shared_expert(x)
        if self.shared_gate_up is None:
            return None
        gu = self.shared_gate_up(x)
        g, u = gu.chunk(2, dim=-1)
        return self.shared_down(torch.nn.functional.silu(g.float()).mul(u.float()).to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block on x [..., H]; a repeated token count replays a CUDA graph of the call
        (``fp4moe.graphs``), with the same numerics and ``last_stats`` (then the graph's statistics
        tensors, updated in place by later calls of that count)."""
        check_block_input(x, self._fp4["w2"][0][1])
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        graphs = _call_graphs(self)
        # check_finite=True reads a flag back on the host every call: no graph
        if self.check_finite is not True and graphs.eligible(self, x2, x2.shape[0]):
            key = (self.routing, self.k0, self.check_finite, self.mode, self.activation, self.interleaved,
                   self.router_dtype)
            y, self.last_stats = graphs.run(self, self._forward_2d, x2, key)
        else:
            y, self.last_stats = self._forward_2d(x2)
        return y.reshape(*lead, y.shape[-1])

    def route(self, x2: torch.Tensor):
        """The block's routing of x [T, H]: router logits -> ``fp4moe.ops.routing.route`` (a
        ``RoutingResult``: top-k ids and weights, OEA statistics)."""
        from .ops.routing import route

        rd = self.router_dtype or x2.dtype
        logits = torch.nn.functional.linear(x2.to(rd), self.router_weight.to(rd),
                                            None if self.router_bias is None else self.router_bias.to(rd))
        return route(logits, self.routing, self.selection_bias, k0=self.k0, check_finite=self.check_finite)

    def _forward_2d(self, x2: torch.Tensor):
        """Router -> routing -> experts (+ shared expert) on x [T, H]: (y, OEA statistics or None)."""
        from .ops.moe import moe_experts

        r = self.route(x2)
        y = moe_experts(x2, self.w13, self.w2, r.topk_ids, r.topk_weights, activation=self.activation,
                        interleaved=self.interleaved, w13_bias=self.w13_bias, w2_bias=self.w2_bias,
                        shared_out=self.shared(x2), mode=self.mode)
        return y, r.stats


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with three linears of any kind (FP4Linear or nn.Linear): a
    dense MLP or a shared expert whose gate and up are stored as separate linears.

    SiLU and the product run in fp32 and are rounded once to x's dtype, as :meth:`FP4MoE.shared`.
    """

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(torch.nn.functional.silu(g.float()).mul(u.float()).to(x.dtype))
