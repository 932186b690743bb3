"""The activation pass into MMA K order (``ops.mma_layout.mma_order_rows``): the kernel's tile
sizes, against the first version (one 4-byte load per pair from its permuted address, kept here
as ``_permuted_load_kernel``) and against a torch copy of the same bytes, all in one run.
GPU only. Usage: PYTHONPATH=src python3 scripts/sweep_mma_order.py [--out DIR]"""
import argparse
import json

import torch
import triton
import triton.language as tl

from fp4moe.kernels.gemm_wgmma import mma_order_rows_kernel, stored_pair
from fp4moe.ops.mma_layout import _x_pairs


@triton.jit
def _permuted_load_kernel(x_ptr, row_ptr, out_ptr, R, K_X, stride_x, stride_o, GATHER: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_q = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < R
    src = tl.load(row_ptr + r, mask=r_mask, other=0) if GATHER else r
    q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    pair = stored_pair(q)
    v = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + pair[None, :],
                mask=(r_mask & (src >= 0))[:, None] & (2 * pair < K_X)[None, :], other=0)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_o + q[None, :], v, mask=r_mask[:, None])


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    cases = [("4096x6144", 4096, 6144, None), ("16384x6144", 16384, 6144, None), ("4096x2048", 4096, 2048, None),
             ("4096x12288", 4096, 12288, None), ("gather 32768 of 4096x6144", 4096, 6144, 32768)]
    tiles = [(16, 128, 4), (16, 256, 4), (32, 128, 4), (32, 256, 4), (32, 256, 8), (64, 128, 8), (8, 512, 4),
             (64, 256, 8)]
    results = []
    for name, M, K, R in cases:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        rows = torch.randint(0, M, (R,), device="cuda", dtype=torch.int32) if R else None
        Rn = R or M
        out = torch.empty(Rn, K, device="cuda", dtype=torch.bfloat16)
        xp, op = _x_pairs(x), out.view(torch.int32)
        nbytes = 2 * Rn * K * 2
        src = x[rows.long()] if R else x
        copy_us = bench(lambda: out.copy_(src))
        ref = None
        row = {"case": name, "bytes": nbytes, "copy_us": copy_us}
        for label, kern, (br, bq, nw) in [("permuted loads", _permuted_load_kernel, (16, 128, 4))] + [
                (f"transpose r{br} q{bq} w{nw}", mma_order_rows_kernel, (br, bq, nw)) for br, bq, nw in tiles]:
            def run(kern=kern, br=br, bq=bq, nw=nw):
                kern[(triton.cdiv(Rn, br), K // 2 // bq)](xp, rows if R else xp, op, Rn, K, xp.stride(0),
                                                          op.stride(0), GATHER=R is not None, BLOCK_R=br,
                                                          BLOCK_Q=bq, num_warps=nw)
            run()
            torch.cuda.synchronize()
            if ref is None:
                ref = out.clone()
            elif not torch.equal(out, ref):
                raise SystemExit(f"{name} {label}: output differs from the permuted-load kernel")
            us = bench(run)
            row[label] = us
            print(f"{name:28s} {label:24s} {us:8.2f} us  {nbytes / us / 1e3:7.0f} GB/s  "
                  f"{copy_us / us:5.1%} of copy ({copy_us:.2f} us)", flush=True)
        results.append(row)
    if args.out:
        with open(f"{args.out}/sweep-mma-order-h200.json", "w") as f:
            json.dump({"command": "PYTHONPATH=src python3 scripts/sweep_mma_order.py --out DIR",
                       "gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
