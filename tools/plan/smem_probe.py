"""Where a compiled kernel's shared memory goes: buffers, offsets, and each layout conversion's scratch.

The derivation tool behind ``fp4moe.target.smem`` (Triton 3.6 internals; CPU only). For one
``fp4_linear_kernel`` configuration it cross-compiles in-process, then prints

* ``metadata.shared``;
* every op that Triton's ``allocate-shared-memory`` pass placed, with its offset;
* the scratch of every ``ttg.convert_layout``, measured by allocating the conversion alone in a
  one-op module with the same layouts (Triton does not print scratch sizes).

    PYTHONPATH=src python tools/plan/smem_probe.py --path w4a4_native --cc 120 128 256 128 8 3
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # before any @triton.jit is defined


def _allocate(text: str, cc: int) -> str:
    from triton._C.libtriton import ir, nvidia

    ctx = ir.context()
    ir.load_dialects(ctx)
    nvidia.load_dialects(ctx)
    with tempfile.NamedTemporaryFile("w", suffix=".mlir", delete=False) as f:
        f.write(text)
    try:
        mod = ir.parse_mlir_module(f.name, ctx)
    finally:
        os.unlink(f.name)
    mod.context = ctx
    pm = ir.pass_manager(ctx)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, cc, 87)
    pm.run(mod, "allocate-shared-memory")
    return str(mod)


_TYPE = r"tensor<[^>]*?(?:<[^>]*>[^>]*?)*>"
_CVT = re.compile(rf"ttg\.convert_layout %\S+ : ({_TYPE}) -> ({_TYPE})")


def conversion_scratch(ttgir: str, cc: int) -> list[tuple[str, int]]:
    """(source type, scratch bytes) of every convert_layout in a TTGIR module."""
    header = [line for line in ttgir.splitlines() if line.startswith("#")]
    module_line = next(line for line in ttgir.splitlines() if line.startswith("module attributes"))
    out = []
    for line in ttgir.splitlines():
        match = _CVT.search(line)
        if not match:
            continue
        src, dst = match.groups()
        elt = re.match(r"tensor<[0-9x]+x(\w+),", src).group(1)
        zero = "0" if elt.startswith("i") else "0.000000e+00"
        body = (f"  tt.func public @probe() {{\n    %0 = arith.constant dense<{zero}> : {src}\n"
                f"    %1 = ttg.convert_layout %0 : {src} -> {dst}\n    tt.return\n  }}\n")
        allocated = _allocate("\n".join(header) + "\n" + module_line + "\n" + body + "}\n", cc)
        out.append((re.match(r"tensor<([0-9x]+x\w+),", src).group(1),
                    int(re.search(r"ttg.shared = (\d+)", allocated).group(1))))
    return out


def main() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fp4moe.ops.linear import LinearConfig, compile_request
    from fp4moe.plan.worker import _dtype

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default="w4a16", choices=("w4a16", "w4a4_emulated", "w4a4_native"))
    ap.add_argument("--cc", type=int, default=120)
    ap.add_argument("--fmt", default="nvfp4")
    ap.add_argument("tile", type=int, nargs="+", help="block_n block_m block_k num_warps num_stages [split_k]")
    args = ap.parse_args()
    cfg = LinearConfig(*args.tile)
    req = compile_request(cfg, args.path, args.fmt, args.cc)
    module, name = req.kernel.split(":")
    fn = getattr(__import__(module, fromlist=[name]), name)
    constexprs = {k: _dtype(v) for k, v in req.constexprs.items()}
    signature = {**req.signature, **{k: "constexpr" for k in constexprs}}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in req.divisible_by_16}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", args.cc, 32),
                              options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    ttgir = compiled.asm["ttgir"]
    print(f"{cfg} {args.path} sm{args.cc}: metadata.shared = {compiled.metadata.shared:,} B")
    for line in _allocate(ttgir, args.cc).splitlines():
        if "allocation.offset" in line:
            op = re.search(r"(ttg\.\w+|ttng\.\w+)", line).group(1)
            offset = int(re.search(r"allocation.offset = (\d+)", line).group(1))
            types = re.findall(r"(?:tensor|memdesc)<([0-9x]+\w+)", line)[:1]
            print(f"  {op:22s} offset {offset:>7,}  {types[0] if types else ''}")
    for shape, size in conversion_scratch(ttgir, args.cc):
        print(f"  convert_layout {shape:20s} scratch {size:>7,} B")


if __name__ == "__main__":
    main()
