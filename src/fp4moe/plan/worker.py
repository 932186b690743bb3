"""Subprocess entry point of ``crosscompile``: reads requests as JSON on stdin, prints results."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback


def _dtype(value):
    import triton.language as tl

    names = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}
    return names.get(value, value) if isinstance(value, str) else value


def _ptxas(ptx: str, cc: int) -> tuple[int | None, int | None, str]:
    """Registers and spill bytes from the ptxas Triton ships (ptxas-blackwell for cc >= 100)."""
    import triton

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    exe = os.path.join(bindir, "ptxas-blackwell" if cc >= 100 and os.path.exists(os.path.join(bindir, "ptxas-blackwell")) else "ptxas")
    arch = f"sm_{cc}a" if cc >= 90 else f"sm_{cc}"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        proc = subprocess.run([exe, "-v", f"--gpu-name={arch}", path, "-o", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    return (int(regs.group(1)) if regs else None, max(spills) if spills else None, log.strip())


def _compile_one(req: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fp4moe.plan.crosscompile import mma_instructions

    module, name = req["kernel"].split(":")
    fn = getattr(importlib.import_module(module), name)
    constexprs = {k: _dtype(v) for k, v in req["constexprs"].items()}
    signature = dict(req["signature"])
    for k in constexprs:
        signature[k] = "constexpr"
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in req["divisible_by_16"]}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": req["num_warps"], "num_stages": req["num_stages"]}
    compiled = triton.compile(src, target=GPUTarget("cuda", req["cc"], 32), options=options)
    ptx = compiled.asm["ptx"]
    regs, spills, log = _ptxas(ptx, req["cc"])
    return {"cc": req["cc"], "ok": True, "error": None, "shared": compiled.metadata.shared, "registers": regs,
            "spill_bytes": spills, "mma": list(mma_instructions(ptx)), "ptxas_log": log[-2000:]}


def main() -> None:
    requests = json.loads(sys.stdin.read())
    results = []
    for req in requests:
        try:
            results.append(_compile_one(req))
        except Exception as err:  # report per request; the caller decides
            results.append({"cc": req["cc"], "ok": False, "error": f"{type(err).__name__}: {err}\n"
                            + traceback.format_exc()[-3000:], "shared": None, "registers": None,
                            "spill_bytes": None, "mma": [], "ptxas_log": ""})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
