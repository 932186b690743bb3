"""When a public op may skip its ``torch.library`` custom op and run its implementation directly.

The custom ops (``fp4moe::moe_experts``, ``route``, ``dispatch``, ``linear``) exist so that
torch.compile and torch.export see each op as one opaque node with a fake implementation. A plain
eager call gains nothing from them and pays the dispatcher: 50-130 µs of host time per op (schema
binding, autograd and aliasing checks), several of which nest in one MoE layer. A call runs the same
implementation directly when nothing traces it: no torch.compile or export, no Python dispatch mode
(FakeTensorMode, FunctionalTensorMode, ...), only plain tensors (no tensor subclasses), and no
autograd recording (the custom ops' outputs then say that they have no backward).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["runs_direct"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def runs_direct(*tensors: torch.Tensor | None) -> bool:
    """True when the op's implementation may run without its custom op (module docstring)."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    grad = torch.is_grad_enabled()
    return all(t is None or (type(t) in _PLAIN and not (grad and t.requires_grad)) for t in tensors)
