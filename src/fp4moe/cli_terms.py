"""Library messages in the command line's terms: ``--overwrite`` and ``--gpu`` where the library
says ``overwrite=True`` and ``find_gpu: argument 'text'``. The library keeps its own messages for
its Python users; every command rewrites them where it reports them."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["cli_terms"]

#: Python-level phrasing of library messages -> the command line's terms (``cli_terms``). The
#: library functions keep their messages; the command line rewrites them where it reports them.
_CLI_TERMS: tuple[tuple[str, Any], ...] = (
    (r"find_gpu: argument 'text' must name a GPU; received (.*?); known GPUs", r"expected a GPU name, got \1; known GPUs"),
    (r"find_gpu: argument 'text' received (.*?), which matches no catalogued GPU", r"\1 is not in the GPU catalogue"),
    (r"get_arch: argument 'arch' received (.*?), which is not a known architecture", r"\1 is not a known architecture"),
    (r" \(also spelt 'sm_120', '120', 120, \(12, 0\) or '12\.0'\)", " (also spelt sm_120, 120 or 12.0)"),
    (r"resolve_target: give exactly one of gpu= or arch=; received gpu=None, arch=None",
     "give exactly one of --gpu and --arch (neither was given)"),
    (r"resolve_target: give exactly one of gpu= or arch=; received gpu=(.*?), arch=(.*)$",
     r"give exactly one of --gpu and --arch, not both (got --gpu \1 and --arch \2)"),
    (r"pass (\w+)=True \(--([\w-]+)\)", r"pass --\2"),
    (r"pass (\w+)=True\b", lambda m: f"pass --{m.group(1).replace('_', '-')}"),
    (r"\b(find_gpu|get_arch|resolve_target|arch_for_capability): ", ""),
    # ``models``: "model: expected one of ['deepseek-v3', 'glm-5']", "config: no such file ..."
    (r"^(?:model|config): ", ""),
    (r"expected one of \[('[^\]]*')\]", lambda m: "expected one of " + m.group(1).replace("'", "")),
)


def cli_terms(message: str) -> str:
    """A library message in the command line's terms: options (``--overwrite``, ``--gpu``) instead of
    Python arguments (``overwrite=True``, ``find_gpu: argument 'text'``)."""
    for pattern, replacement in _CLI_TERMS:
        message = re.sub(pattern, replacement, message)
    return message
