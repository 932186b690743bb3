"""Modules: ``FP4Linear`` (the MoE module joins it in a later issue)."""

from __future__ import annotations

import torch
from torch import nn

from .formats import FP4Format, get_format
from .ops.linear import Mode, fp4_linear
from .quantize import FP4Tensor, quantize

__all__ = ["FP4Linear"]


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

    @property
    def weight_fp4(self) -> FP4Tensor:
        return FP4Tensor(data=self.weight, scales=self.weight_scale, global_scale=self.weight_scale_2,
                         shape=torch.Size((self.out_features, self.in_features)), fmt=self.fmt)

    @classmethod
    def from_fp4(cls, weight: FP4Tensor, bias: torch.Tensor | None = None, *, mode: Mode = "w4a16",
                 input_scale: torch.Tensor | None = None) -> FP4Linear:
        if not isinstance(weight, FP4Tensor) or len(weight.shape) != 2:
            raise TypeError(f"weight: expected a 2-D FP4Tensor, got {type(weight).__name__}")
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
            layer.input_scale = input_scale.detach().to(device=weight.device, dtype=torch.float32).reshape(1)
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str | FP4Format = "nvfp4", *, mode: Mode = "w4a16") -> FP4Linear:
        """Quantize an ``nn.Linear`` (any float dtype) to FP4; the bias keeps the layer's dtype."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear: expected torch.nn.Linear, got {type(linear).__name__}")
        w = quantize(linear.weight.detach(), fmt)
        bias = linear.bias.detach() if linear.bias is not None else None
        if bias is not None and bias.dtype not in (torch.bfloat16, torch.float16):
            bias = bias.to(torch.bfloat16)
        return cls.from_fp4(w, bias, mode=mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return fp4_linear(x, self.weight_fp4, bias, mode=self.mode, input_global_scale=self.input_scale)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, "
                f"mode={self.mode}, bias={self.bias is not None}")
