"""The benchmark harness: timing (CUDA graphs), reports, ``fp4moe bench``.

Modules: ``timing`` (the one place that times anything), ``report`` (environment stamp and
JSON/Markdown files), ``linear``, ``moe``, ``calls``, ``model`` and ``parallel`` (the benchmarks;
roofline arithmetic is ``fp4moe.target.roofline``) and ``cli`` (the ``fp4moe bench`` commands).
"""

#: the benchmarks' modes: W4A16 (bf16 activations) and W4A4 (FP4 activations); here, so that the
#: command line can check ``--modes`` without importing torch
MODES: tuple[str, ...] = ("w4a16", "w4a4")
