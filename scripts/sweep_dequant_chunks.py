"""Large-batch W4A16 NVFP4 through torch's matmul: the whole weight dequantized to bf16 once
(``ops.linear._dequant_matmul``, what runs today) against the weight taken in chunks of rows, each
dequantized into one reused scratch buffer (1,024 rows of K = 6,144 are 12.6 MB, which the L2 can
keep between the write and the GEMM's read; 4,096 rows of K = 12,288, 100 MB, cannot) and
multiplied into its columns of the output, on one stream or with the next chunk's
dequantize on a second stream beside this chunk's GEMM; torch's bf16 matmul in the same interleaved
replays (``time_cuda_graphs``). Question: does keeping the bf16 copy out of DRAM, or overlapping the
pass, close the gap to torch? Time and SM clock are recorded; energy and L2 hits are not measured.
Each chunk's GEMM reads all of x again. Each variant is checked against the reference first, on an
output filled with NaN. GPU only.
Usage: PYTHONPATH=src python3 scripts/sweep_dequant_chunks.py [--shapes 12288x6144,...] [--ms 4096,16384]
[--chunks 1024,2048,4096] [--out DIR]"""
import argparse
import json

import torch

SHAPES = "12288x6144,6144x12288,4096x6144,6144x2048"


def dequant_into(w, r0: int, r1: int, buf: torch.Tensor) -> torch.Tensor:
    """Rows r0..r1 of the NVFP4 weight ``w`` to bf16 (no global scale) in ``buf``'s first rows."""
    import triton

    from fp4moe.ops._runtime import pdl_kwargs
    from fp4moe.kernels.quantize import nvfp4_weight_dequantize_kernel

    K = w.shape[1]
    data, scales = w.data[r0:r1], w.scales[r0:r1]
    out = buf[: r1 - r0]
    n_bytes = (r1 - r0) * K // 2
    nvfp4_weight_dequantize_kernel[(triton.cdiv(n_bytes, 2048),)](
        data, scales.view(torch.uint8), out.view(torch.int32), n_bytes, BLOCK=2048, num_warps=4,
        **pdl_kwargs(w.device))
    return out


def chunked(x, w, g: float, out, bufs, rows: int, side: torch.cuda.Stream | None):
    """``out = g * x @ W^T`` a chunk of ``rows`` weight rows at a time; ``side``: each chunk's dequantize
    on that stream (two scratch buffers), its GEMM on the current one, waiting on that chunk only."""
    N = w.shape[0]
    starts = list(range(0, N, rows))
    if side is None:
        for r0 in starts:
            r1 = min(r0 + rows, N)
            w_hat = dequant_into(w, r0, r1, bufs[0])
            torch.addmm(out[:, r0:r1], x, w_hat.t(), beta=0.0, alpha=g, out=out[:, r0:r1])
        return out
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    done = []
    for i, r0 in enumerate(starts):
        r1 = min(r0 + rows, N)
        with torch.cuda.stream(side):
            if i >= 2:
                side.wait_event(done[i - 2])  # that buffer's GEMM has read it
            w_hat = dequant_into(w, r0, r1, bufs[i % 2])
            ready = torch.cuda.Event()
            ready.record(side)
        main.wait_event(ready)
        torch.addmm(out[:, r0:r1], x, w_hat.t(), beta=0.0, alpha=g, out=out[:, r0:r1])
        ev = torch.cuda.Event()
        ev.record(main)
        done.append(ev)
    main.wait_stream(side)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--ms", default="4096,16384")
    ap.add_argument("--chunks", default="1024,2048,4096")
    ap.add_argument("--out")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(m) for m in args.ms.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]

    from fp4moe.bench.timing import ClockMonitor, l2_bytes, rotating, rotation_count, time_cuda_graphs
    from fp4moe.formats import NVFP4
    from fp4moe.ops import linear as L
    from fp4moe.quantize import quantize

    side = torch.cuda.Stream()
    rows_out = []
    for N, K in shapes:
        w0 = quantize(torch.randn(N, K, device="cuda"), NVFP4)
        n_sets = rotation_count(w0.data.numel() + w0.scales.numel(), l2_bytes())
        ws = [quantize(torch.randn(N, K, device="cuda"), NVFP4) for _ in range(n_sets)]
        gs = [L.weight_global_host(w) for w in ws]
        wt = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(rotation_count(N * K * 2, l2_bytes()))]
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            fns = {"whole": lambda w, g: L._dequant_matmul(x, w, g, None, out)}
            for c in chunks:
                if c >= N:
                    continue
                bufs = [torch.empty(c, K, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
                fns[f"chunk{c}"] = (lambda c, bufs: lambda w, g: chunked(x, w, g, out, bufs, c, None))(c, bufs)
                fns[f"chunk{c}_2streams"] = (lambda c, bufs: lambda w, g: chunked(x, w, g, out, bufs, c, side))(c, bufs)
            row = dict(N=N, K=K, M=M)
            ref = L.fp4_linear_reference(x, ws[0]).float()
            bad = []
            for name, fn in fns.items():
                out.fill_(float("nan"))  # every variant must write every column itself
                y = fn(ws[0], gs[0]).float()
                err = float((y - ref).abs().max() / ref.abs().max())
                row[f"{name}_rel_err"] = err
                if not err < 1e-2:
                    bad.append(name)
            for name in bad:
                del fns[name]
            calls = {name: rotating(fn, list(zip(ws, gs))) for name, fn in fns.items()}
            calls["torch"] = rotating(lambda b: x @ b.t(), [(b,) for b in wt])
            with ClockMonitor() as mon:
                t = time_cuda_graphs(calls, iters_per_graph=10, reps=15, budget_ms=1500.0)
            row.update({f"{k}_us": v.median_us for k, v in t.items()}, **mon.summary())
            row["not_captured"] = [k for k, v in t.items() if not v.graph]
            for name in fns:
                row[f"speedup_{name}"] = row["torch_us"] / row[f"{name}_us"]
            rows_out.append(row)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                   if k.endswith("_us") or k.startswith("speedup") or k in ("N", "K", "M", "not_captured")}, flush=True)
        del ws, wt
    if args.out:
        with open(f"{args.out}/sweep-dequant-chunks-h200.json", "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
