"""Benchmark results on disk: the environment stamp and JSON + Markdown files.

``benchmarks/<name>-<gpu-slug>.json`` holds ``{"environment", "ceilings", "rows"}``;
the ``.md`` beside it has the same header (GPU, versions, commit, command, ceilings) and one
table per kind of row. Files are overwritten; the git history keeps old results.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = ["environment", "gpu_slug", "markdown", "one_line", "write_results"]

_CHECKOUT = Path(__file__).resolve().parent  # git commands run here: the library's checkout, not the cwd


def _run(cmd: list[str]) -> str | None:
    """stdout of ``cmd`` stripped, or None when it is missing, fails or hangs."""
    try:
        done = subprocess.run(cmd, cwd=_CHECKOUT, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def _gpu() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"gpu": None, "capability": None, "kernels_arch": None, "sm_count": None, "memory_gib": None,
                "l2_bytes": None, "driver": None}
    from ..ops._runtime import emulated_arch

    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])  # same for every GPU
    kernels = emulated_arch(device)
    return {
        "gpu": props.name,
        "capability": f"{props.major}.{props.minor}",
        # FP4MOE_ARCH: another architecture's kernels on this GPU (None: the GPU's own)
        "kernels_arch": kernels.name if kernels is not None else None,
        "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "l2_bytes": int(getattr(props, "L2_cache_size", 0)) or None,
        "driver": driver.splitlines()[0] if driver else None,
    }


def environment() -> dict[str, Any]:
    """Where and how a benchmark ran: GPU, driver, versions, git commit, time and command line."""
    import torch

    import fp4moe

    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency on Linux
        triton_version = None
    commit = _run(["git", "rev-parse", "HEAD"]) or "unknown"
    status = _run(["git", "status", "--porcelain"]) if commit != "unknown" else None
    return {
        **_gpu(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton_version,
        "fp4moe": fp4moe.__version__,
        "python": platform.python_version(),
        "commit": commit,
        "dirty": None if status is None else bool(status),
        "timestamp_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else "",
        "argv": list(sys.argv),
    }


def gpu_slug(gpu: str | None) -> str:
    """File-name form of a GPU name: 'NVIDIA H200' -> 'h200'; None -> 'cpu'."""
    if not gpu:
        return "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    return re.sub(r"^nvidia-", "", slug) or "gpu"


def one_line(text: str, width: int = 90) -> str:
    """The first line of ``text``, at most ``width`` characters (for tables and progress lines)."""
    lines = str(text).strip().splitlines()
    first = lines[0] if lines else ""
    return first if len(first) <= width else first[: width - 1] + "…"


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns and key != "kind"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(col)) for col in columns) + " |" for row in rows]
    return lines


def markdown(name: str, env: Mapping[str, Any], ceilings: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str:
    """The Markdown report: header, ceilings and one table per ``row["kind"]`` (in order of appearance)."""
    dirty = {True: " (uncommitted changes)", False: "", None: ""}[env.get("dirty")]
    lines = [
        f"# {name} on {env.get('gpu') or 'no GPU'}",
        "",
        f"- GPU: {env.get('gpu')} (sm {env.get('capability')}, {env.get('sm_count')} SMs), driver {env.get('driver')}",
        *([f"- kernels: {env['kernels_arch']}'s (FP4MOE_ARCH), lowered by Triton for it and assembled for this GPU"]
          if env.get("kernels_arch") else []),
        f"- versions: fp4moe {env.get('fp4moe')}, torch {env.get('torch')} (CUDA {env.get('cuda')}), "
        f"triton {env.get('triton')}, python {env.get('python')}",
        f"- commit: {env.get('commit')}{dirty}",
        f"- date (UTC): {env.get('timestamp_utc')}",
        f"- command: `{env.get('command')}`",
        "",
        "## Ceilings measured in the same run",
        "",
    ]
    lines += [f"- {key}: {_cell(value)}" for key, value in ceilings.items()] or ["- none"]
    kinds: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        kinds.setdefault(str(row.get("kind", "results")), []).append(row)
    for kind, group in kinds.items():
        lines += ["", f"## {kind}", "", *_table(group)]
    return "\n".join(lines) + "\n"


def write_results(
    name: str,
    env: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    out_dir: str | os.PathLike[str] = "benchmarks",
    *,
    ceilings: Mapping[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write ``<out_dir>/<name>-<gpu-slug>.json`` and ``.md``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-{gpu_slug(env.get('gpu'))}" + (f"-{env['kernels_arch']}-kernels" if env.get("kernels_arch") else "")
    ceilings = dict(ceilings or {})
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    payload = {"environment": dict(env), "ceilings": ceilings, "rows": [dict(r) for r in rows]}
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    md_path.write_text(markdown(name, env, ceilings, rows))
    return json_path, md_path
