"""Programmatic dependent launch (PDL) for the @triton.jit kernels of a launch chain (SM90+).

A kernel launched with ``launch_pdl=True`` may be scheduled while the kernel before it in the
stream is still running, as soon as every program of that kernel has called
``griddepcontrol.launch_dependents`` (or exited). Its own programs then block in
``griddepcontrol.wait`` until the previous kernel has completed and its writes are visible, so
what PDL hides is the launch itself: the gap between two dependent kernels of a few microseconds,
which at decode batch sizes is a visible part of an MoE layer (routing -> dispatch -> GEMM 1 ->
epilogue -> GEMM 2 -> combine).

Every chain kernel calls ``pdl_enter`` first, before any load or store, so nothing it reads or
writes can race with the kernel before it; the exceptions read only weights before their wait,
where the launcher knows the kernel before cannot be writing them (the Gluon decode and wgmma
kernels' ``PDL = 2``). Both instructions are no-ops in a kernel launched without the attribute,
which keeps a kernel correct in any position of a stream.
"""

import triton
import triton.language as tl


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """With PDL: wait for the previous grid, then let the next one launch (no-op code when off)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
