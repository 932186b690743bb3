"""Where a plain call of FP4MoE spends its host time: cProfile of plain calls at GLM-5 shapes, with the
module's graphs off (every kernel launched from Python) and on (one graph replay per call).

    PYTHONPATH=src python tools/profile/profile_plain_call.py [--tokens 1] [--calls 50] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from fp4moe.bench.calls import random_block
from fp4moe.graphs import graph_policy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="glm-5")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    block = random_block(args.model)
    x = torch.randn(args.tokens, block.router_weight.shape[1], device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for graphs in (False, True):
            with graph_policy(enabled=graphs):
                for _ in range(3):
                    block(x)
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(args.calls):
                    block(x)
                host = (time.perf_counter() - t) / args.calls * 1e6
                torch.cuda.synchronize()
                idle = []
                for _ in range(args.calls):  # one call at a time on an idle GPU: host time alone
                    t = time.perf_counter()
                    block(x)
                    idle.append((time.perf_counter() - t) * 1e6)
                    torch.cuda.synchronize()
                idle_us = sorted(idle)[len(idle) // 2]
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.calls):
                    block(x)
                prof.disable()
                torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.top)
            print(f"=== graphs {'on' if graphs else 'off'}: host {host:.1f} us per call back to back, {idle_us:.1f} us "
                  f"on an idle GPU (median; without the profiler); top {args.top} by cumulative time over "
                  f"{args.calls} calls ===")
            print("\n".join(line[:160] for line in s.getvalue().splitlines()[4:] if line.strip()))


if __name__ == "__main__":
    main()
