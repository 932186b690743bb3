"""Subprocess entry point of ``crosscompile``: reads one request per line on stdin
(``{"index": i, "request": {...}}``) and prints one JSON line per request as soon as it is compiled
(``{"index": i, ...}``), so that the caller can hand the next request to whichever worker is free,
and a compiler abort on one request (Triton aborts on some illegal programs) loses nothing that came
before it."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback


def _dtype(value):
    """A request's constexpr as the compiler takes it: dtype names, and Gluon layouts sent as
    ``{"layout": "module:function", "args": [...]}`` (layout objects do not travel as JSON)."""
    import triton.language as tl

    if isinstance(value, dict) and "layout" in value:
        module, name = value["layout"].split(":")
        return getattr(importlib.import_module(module), name)(*value["args"])
    names = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}
    return names.get(value, value) if isinstance(value, str) else value


def _bindir() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _ptxas(ptx: str, cc: int, sass: bool = False) -> tuple[int | None, int | None, str, str]:
    """Registers, spill bytes and the log from the ptxas Triton ships (ptxas-blackwell for cc >=
    100), and the SASS (cuobjdump) when ``sass``: for a kernel Triton's own cache served, whose
    ptxas log it does not keep (``_compile_with_log``)."""
    bindir = _bindir()
    exe = os.path.join(bindir, "ptxas-blackwell" if cc >= 100 and os.path.exists(os.path.join(bindir, "ptxas-blackwell")) else "ptxas")
    arch = f"sm_{cc}a" if cc >= 90 else f"sm_{cc}"
    text = ""
    with tempfile.TemporaryDirectory() as d:
        path, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(path, "w") as f:
            f.write(ptx)
        proc = subprocess.run([exe, "-v", f"--gpu-name={arch}", path, "-o", cubin], capture_output=True, text=True)
        if sass and proc.returncode == 0:
            text = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", cubin], capture_output=True,
                                  text=True).stdout
    regs, spills = _resources(proc.stdout + proc.stderr)
    return regs, spills, (proc.stdout + proc.stderr).strip(), text


def sass_of_ptx(ptx: str, cc: int = 90) -> str:
    """The SASS of ``ptx`` for ``sm_{cc}a``, assembled as the cross-compile worker does."""
    return _ptxas(ptx, cc, sass=True)[3]


def _resources(log: str) -> tuple[int | None, int | None]:
    """(registers per thread, spill stores + loads in bytes) from a ``ptxas -v`` log."""
    regs = re.search(r"Used (\d+) registers", log)
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    return (int(regs.group(1)) if regs else None, max(spills) if spills else None)


def _sass(cubin: bytes) -> str:
    """The SASS of a cubin (cuobjdump)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([os.path.join(_bindir(), "cuobjdump"), "-sass", path], capture_output=True,
                              text=True).stdout


# `ttg.local_alloc ... -> !ttg.memdesc<2x128x64xi8, #shared, ...>`: the explicit shared-memory
# buffers (pipelined operand tiles, MMA operand staging, barriers). Layout-conversion scratch is
# not an op of its own and does not appear here.
_LOCAL_ALLOC = re.compile(r"ttg\.local_alloc\b[^\n]*?->\s*!ttg\.memdesc<([0-9x]+[a-zA-Z0-9]+)")


def smem_buffers(ttgir: str) -> list[str]:
    """Types of the explicit shared-memory buffers of a TTGIR module, e.g. ``["2x128x64xi8"]``."""
    return _LOCAL_ALLOC.findall(ttgir)


def compile_request(req: dict):
    """Triton's compiled kernel for one request (a ``CompileRequest`` as a dict), built as the
    runtime launch would specialise it (divisibility of the arguments named in the request)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    module, name = req["kernel"].split(":")
    fn = getattr(importlib.import_module(module), name)
    constexprs = {k: _dtype(v) for k, v in req["constexprs"].items()}
    signature = dict(req["signature"])
    for k in constexprs:
        signature[k] = "constexpr"
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in req["divisible_by_16"]}
    if isinstance(fn, GluonJITFunction):  # explicit-layout kernels (kernels/linear_mma.py, gemm_wgmma.py)
        src = GluonASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        options = {"num_warps": req["num_warps"]}
    else:
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        options = {"num_warps": req["num_warps"], "num_stages": req["num_stages"]}
    if req.get("maxnreg"):
        options["maxnreg"] = req["maxnreg"]
    options["arch"] = f"sm{req['cc']}"  # the target's lowering whatever TRITON_OVERRIDE_ARCH says
    return triton.compile(src, target=GPUTarget("cuda", req["cc"], 32), options=options)


def _compile_with_log(req: dict):
    """``compile_request`` and the ``ptxas -v`` log of the run that made its cubin: Triton runs
    ptxas verbose and, with ``knobs.nvidia.dump_ptxas_log``, prints that log, which is read here
    instead of assembling the PTX a second time. Empty when Triton's own cache served the kernel."""
    import triton

    knobs = triton.knobs.nvidia
    before = knobs.dump_ptxas_log
    knobs.dump_ptxas_log = True
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):  # stdout is this worker's result channel
            compiled = compile_request(req)
    finally:
        knobs.dump_ptxas_log = before
    return compiled, out.getvalue()


def _compile_one(req: dict) -> dict:
    from fp4moe.plan.crosscompile import mma_instructions
    from fp4moe.plan.sass import loop_local_memory_ops, wgmma_register_hazards

    start = time.perf_counter()
    compiled, log = _compile_with_log(req)
    ptx = compiled.asm["ptx"]
    mma = mma_instructions(ptx)
    # a wgmma reading A from registers must find them untouched until it retires (plan.sass)
    check_sass = any(m.startswith("wgmma") for m in mma)
    regs, spills = _resources(log)
    if regs is not None and compiled.asm.get("cubin"):  # Triton assembled it here: its cubin, its log
        log = log.strip()
        # where the spills sit (plan.sass.loop_local_memory_ops)
        sass = _sass(compiled.asm["cubin"]) if check_sass or spills else ""
    else:
        regs, spills, log, sass = _ptxas(ptx, req["cc"], sass=check_sass)
        if spills and not check_sass:
            sass = _ptxas(ptx, req["cc"], sass=True)[3]
    hazards = [" ".join(h) for h in wgmma_register_hazards(sass)] if check_sass else []
    return {"cc": req["cc"], "ok": True, "error": None, "shared": compiled.metadata.shared, "registers": regs,
            "spill_bytes": spills, "mma": list(mma), "ptxas_log": log[-2000:], "wgmma_hazards": hazards[:20],
            "loop_spill_ops": loop_local_memory_ops(sass) if sass else None,
            "smem_buffers": smem_buffers(compiled.asm.get("ttgir", "")),
            "compile_s": round(time.perf_counter() - start, 3)}


def main() -> None:
    for line in sys.stdin:  # one request per line, answered as soon as it is compiled
        if not line.strip():
            continue
        message = json.loads(line)
        index, req = message["index"], message["request"]
        try:
            result = _compile_one(req)
        except Exception as err:  # report per request; the caller decides
            result = {"cc": req["cc"], "ok": False, "error": f"{type(err).__name__}: {err}\n"
                      + traceback.format_exc()[-3000:], "shared": None, "registers": None,
                      "spill_bytes": None, "mma": [], "ptxas_log": ""}
        print(json.dumps({"index": index, **result}), flush=True)


if __name__ == "__main__":
    main()
