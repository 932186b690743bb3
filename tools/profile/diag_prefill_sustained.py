"""Sustained prefill against the power cap: why a tile sweep and the linear bench time the same kernel
differently. ``tools/sweep/sweep_wgmma_tiles.py --persistent`` times 12288x6144, M = 4096 on one
weight (10 x 10 calls); ``fp4moe bench linear`` rotates weights through ``fp4_linear`` (21 x 20 calls).
This times the same product every way in between (torch and fp4moe, one weight and rotating), twice
in alternating order, and samples the SM clock, power and throttle reasons (NVML) while each runs.
GPU only; docs/performance-engineering.md#how-the-numbers-are-measured has the H200's result.
Usage: PYTHONPATH=src python3 tools/profile/diag_prefill_sustained.py [--out DIR] [--shapes NxK,...] [--m 4096]"""
import argparse
import json
import os
import threading
import time
from dataclasses import replace

import torch

from fp4moe.bench.timing import rotating, rotation_count, time_cuda_graph, l2_bytes
from fp4moe.ops.linear import fp4_linear, mma_packed
from fp4moe.ops.wgmma import choose_wgmma_config, launch_linear_wgmma
from fp4moe.quantize import quantize


class Sampler:
    """NVML samples (time, SM MHz, W, throttle reason bits) every ``period`` s in a thread."""

    def __init__(self, period=0.01):
        import pynvml

        pynvml.nvmlInit()
        self.nv = pynvml
        self.h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        self.period, self.samples, self.stop = period, [], threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)

    def run(self):
        nv, h = self.nv, self.h
        while not self.stop.is_set():
            try:
                self.samples.append((time.time(), nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                                     nv.nvmlDeviceGetPowerUsage(h) / 1000,
                                     nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)))
            except Exception as err:  # keep timing even if one query fails
                self.samples.append((time.time(), -1, -1, str(err)))
            time.sleep(self.period)

    def window(self, t0, t1):
        s = [x for x in self.samples if t0 <= x[0] <= t1 and x[1] >= 0]
        if not s:
            return {}
        mhz = sorted(x[1] for x in s)
        w = sorted(x[2] for x in s)
        reasons = {}
        for x in s:
            reasons[x[3]] = reasons.get(x[3], 0) + 1
        return dict(n=len(s), mhz_min=mhz[0], mhz_med=mhz[len(mhz) // 2], mhz_max=mhz[-1],
                    w_med=w[len(w) // 2], w_max=w[-1], reasons={hex(k) if isinstance(k, int) else k: v
                                                                for k, v in reasons.items()})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--shapes", default="12288x6144,4096x6144")
    ap.add_argument("--m", type=int, default=4096)
    args = ap.parse_args()
    smp = Sampler()
    smp.t.start()
    gen = torch.Generator(device="cuda").manual_seed(0)
    l2 = l2_bytes()
    res = []
    for N, K in [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]:
        M = args.m
        w = quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen), "nvfp4")
        n_sets = rotation_count(w.data.numel() + w.scales.numel(), l2)
        sets = [w] + [replace(w, data=w.data.clone(), scales=w.scales.clone()) for _ in range(n_sets - 1)]
        for q in sets:
            mma_packed(q)
        wb = w.dequantize(torch.bfloat16)
        wbs = [wb] + [wb.clone() for _ in range(rotation_count(wb.numel() * 2, l2) - 1)]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        cfg = choose_wgmma_config(M, N, K)
        p = mma_packed(w)
        ways = {
            "torch_one": lambda: torch.matmul(x, wb.t()),
            "torch_rot": rotating(lambda b: torch.matmul(x, b.t()), [(b,) for b in wbs]),
            "kernel_one": lambda: launch_linear_wgmma(x, p, None, y, cfg),
            "op_one": lambda: fp4_linear(x, w),
            "op_rot": rotating(lambda q: fp4_linear(x, q), [(q,) for q in sets]),
        }
        for f in ways.values():
            f()
        torch.cuda.synchronize()
        order = list(ways) + list(reversed(ways))
        for rnd, name in enumerate(order):
            for shape_label, kw in (("10x10", dict(iters_per_graph=10, reps=10)),
                                    ("21x20", dict(iters_per_graph=20, reps=21))):
                t0 = time.time()
                t = time_cuda_graph(ways[name], **kw)
                t1 = time.time()
                row = dict(N=N, K=K, M=M, way=name, graph=shape_label, round=0 if rnd < len(ways) else 1,
                           median=t.median_us, p10=t.p10_us, p90=t.p90_us, sets=n_sets, torch_sets=len(wbs),
                           config=str(cfg), **smp.window(t0, t1))
                res.append(row)
                print(f"{N}x{K} {name:10s} {shape_label} r{row['round']}: {t.median_us:7.1f} "
                      f"(p10 {t.p10_us:7.1f}, p90 {t.p90_us:7.1f}) MHz {row.get('mhz_min')}/{row.get('mhz_med')} "
                      f"W {row.get('w_med')} {row.get('reasons')}", flush=True)
        ways.clear()
        torch.cuda.empty_cache()
    smp.stop.set()
    if args.out:
        with open(os.path.join(args.out, "diag-prefill-sustained-h200.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=res, samples=smp.samples), f)


if __name__ == "__main__":
    main()
