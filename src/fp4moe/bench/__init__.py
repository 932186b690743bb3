"""The benchmark harness: timing (CUDA graphs), roofline arithmetic, reports, ``fp4moe bench``.

Modules: ``timing`` (the one place that times anything), ``roofline`` (pure arithmetic),
``report`` (environment stamp and JSON/Markdown files), ``linear`` (the FP4 linear and
activation-quantize benchmarks) and ``cli`` (the ``fp4moe bench`` commands).
"""
