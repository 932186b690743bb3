"""W4A16 NVFP4 linear at large batches, the two SM90 paths of ``fp4_linear`` against torch's bf16
matmul, their replays interleaved (``time_cuda_graphs``: the same clocks for all three): the wgmma
kernel (decode in the main loop) and W dequantized to bf16 then cuBLAS (``ops.linear``'s
``dequant_matmul_applies``). What ``LinearTuning.dequant_matmul_min_m`` should be. Weights rotate past the L2 as in
``fp4moe bench linear``; each path's output is checked against the reference first. GPU only.
Usage: PYTHONPATH=src python3 tools/sweep/sweep_dequant_matmul.py [--shapes 12288x6144,...] [--ms 1024,2048,4096]
[--out DIR]"""
import argparse
import json

import torch

SHAPES = "12288x6144,6144x12288,4096x6144,6144x2048"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--ms", default="1024,2048,4096,16384")
    ap.add_argument("--out")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(m) for m in args.ms.split(",")]

    from fp4moe.bench.timing import ClockMonitor, l2_bytes, rotating, rotation_count, time_cuda_graphs
    from fp4moe.formats import NVFP4
    from fp4moe.ops import linear as L
    from fp4moe.tuning import tuning
    from fp4moe.quantize import quantize

    rows = []
    for N, K in shapes:
        w0 = quantize(torch.randn(N, K, device="cuda"), NVFP4)
        n_sets = rotation_count(w0.data.numel() + w0.scales.numel(), l2_bytes())
        ws = [quantize(torch.randn(N, K, device="cuda"), NVFP4) for _ in range(n_sets)]
        wt = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(rotation_count(N * K * 2, l2_bytes()))]
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)

            def path(min_m):
                def run(w):
                    # read when the graph is captured: each graph keeps its path
                    with tuning(linear=dict(dequant_matmul_min_m=min_m)):
                        return L.fp4_linear(x, w)
                return run

            fns = {"wgmma": path(1 << 40), "dequant_matmul": path(0)}
            row = dict(N=N, K=K, M=M)
            ref = L.fp4_linear_reference(x, ws[0]).float()
            for name, fn in fns.items():
                for w in ws:  # packs, host globals and guards made outside capture
                    fn(w)
                y = fn(ws[0]).float()
                row[f"{name}_rel_err"] = float((y - ref).abs().max() / ref.abs().max())
            calls = {name: rotating(fn, [(w,) for w in ws]) for name, fn in fns.items()}
            calls["torch"] = rotating(lambda b: x @ b.t(), [(b,) for b in wt])
            with ClockMonitor() as mon:
                t = time_cuda_graphs(calls, iters_per_graph=10, reps=15, budget_ms=1500.0)
            row.update({f"{k}_us": v.median_us for k, v in t.items()}, **mon.summary())
            row["speedup_wgmma"] = row["torch_us"] / row["wgmma_us"]
            row["speedup_dequant_matmul"] = row["torch_us"] / row["dequant_matmul_us"]
            rows.append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        del ws, wt
    if args.out:
        with open(f"{args.out}/sweep-dequant-matmul-h200.json", "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
