"""What to cross-compile for a target: the record both the launchers (``fp4moe.ops``, which know
their kernels' signatures and constexprs) and the planner (``fp4moe.plan.crosscompile``, which
compiles it) use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CompileRequest"]


@dataclass(frozen=True)
class CompileRequest:
    """What to compile: ``kernel`` as "module:function", Triton signature types by argument name
    (e.g. ``{"x_ptr": "*bf16", "M": "i32"}``), constexpr values (dtypes as "bf16"/"fp16"/"fp32"),
    the target compute capability (90, 100, 120 ...) and launch options."""

    kernel: str
    signature: dict[str, str]
    constexprs: dict[str, Any]
    cc: int
    num_warps: int = 4
    num_stages: int = 3
    divisible_by_16: tuple[str, ...] = ()  # arguments the runtime would specialise as multiples of 16
    maxnreg: int | None = None  # the launch's register cap (warp-specialized kernels split it with setmaxnreg)
