"""What any kernel chain can reach on the MoE layer at a few tokens (GPU only): the GLM-5 layer
(``ops.moe.moe_experts`` on the routing's ids) against a pure read of the same weight bytes: the
active experts' packed GEMM 1 words and scales in one launch, then GEMM 2's in a second (PDL, as
the layer's GEMMs run), each program an xor-reduction of 8 KB. Routings rotate per call (the bench
cycles four per graph), so the experts come from DRAM. Also the layer's per-kernel CUDA time
(``kernel_times``), whose non-GEMM part the pure reads do not include.
Usage: PYTHONPATH=src python3 tools/moe_decode/ceiling_moe_decode.py [--tokens 1,2,4] [--out DIR]"""
import argparse
import json
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

BLOCK = 2048  # int32 per program


@triton.jit
def _experts_read(words, scales, ids, out, n_w, n_s, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (b, slot): block b of expert ids[slot]'s words (n_w int32 each), then of its scales
    (n_s int32 each); xor of the block into out (so the loads cannot be dropped)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    b = tl.program_id(0)
    slot = tl.program_id(1)
    e = tl.load(ids + slot).to(tl.int64)
    nb_w = tl.cdiv(n_w, BLOCK)
    r = tl.arange(0, BLOCK)
    if b < nb_w:
        offs = b * BLOCK + r
        v = tl.load(words + e * n_w + offs, mask=offs < n_w, other=0)
    else:
        offs = (b - nb_w) * BLOCK + r
        v = tl.load(scales + e * n_s + offs, mask=offs < n_s, other=0)
    tl.store(out + slot * tl.num_programs(0) + b, tl.xor_sum(v, axis=0))


def _flat_int32(t: torch.Tensor, E: int) -> torch.Tensor:
    """A pack's words or scales as int32 [E, n]: each expert's bytes in one row."""
    return t.contiguous().view(-1).view(torch.int32).reshape(E, -1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--routings", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args()
    from moe_decode_setup import decode_experts

    from fp4moe.bench.moe import moe_bound_us
    from fp4moe.target.roofline import fp4_weight_bytes
    from fp4moe.bench.timing import kernel_times, measure_copy_bandwidth, rotating, time_cuda_graphs
    from fp4moe.ops.moe import moe_experts

    ex = decode_experts()
    copy_gbs = measure_copy_bandwidth()
    E = ex.E
    w13_w, w13_s = _flat_int32(ex.p13.words, E), _flat_int32(ex.p13.scales, E)
    w2_w, w2_s = _flat_int32(ex.p2.words, E), _flat_int32(ex.p2.scales, E)
    per_expert = fp4_weight_bytes(2 * ex.I, ex.H, ex.spec.fmt) + fp4_weight_bytes(ex.H, ex.I, ex.spec.fmt)
    read_bytes = 4 * (w13_w.shape[1] + w13_s.shape[1] + w2_w.shape[1] + w2_s.shape[1])
    print(f"copy {copy_gbs:.0f} GB/s; per expert {per_expert / 1e6:.2f} MB (bound), {read_bytes / 1e6:.2f} MB read",
          flush=True)
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        sets = [ex.batch(T) for _ in range(args.routings)]
        n_unique = sum(int(torch.unique(ids[ids >= 0]).numel()) for _, ids, _ in sets) / len(sets)
        uids = [torch.unique(ids[ids >= 0]).to(torch.int32) for _, ids, _ in sets]
        outs = [torch.empty((triton.cdiv(w.shape[1], BLOCK) + triton.cdiv(s.shape[1], BLOCK)) * E, dtype=torch.int32,
                            device="cuda") for w, s in ((w13_w, w13_s), (w2_w, w2_s))]

        def reads(u):
            for (w, s), o in zip(((w13_w, w13_s), (w2_w, w2_s)), outs):
                grid = (triton.cdiv(w.shape[1], BLOCK) + triton.cdiv(s.shape[1], BLOCK), u.numel())
                _experts_read[grid](w, s, u, o, w.shape[1], s.shape[1], BLOCK=BLOCK, PDL=True, launch_pdl=True)

        layer = rotating(lambda x, ids, wts: moe_experts(x, ex.w13, ex.w2, ids, wts), sets)
        read = rotating(reads, [(u,) for u in uids])
        res = {k: v.median_us for k, v in time_cuda_graphs({"layer": layer, "read": read}, iters_per_graph=8,
                                                           reps=20).items()}
        bound = moe_bound_us(n_unique, ex.H, ex.I, ex.spec.fmt, copy_gbs)  # as the bench's
        kt = kernel_times(layer, calls=8)
        row = dict(T=T, unique_experts=n_unique, bound_us=bound, layer_us=res["layer"], read_us=res["read"],
                   layer_frac=bound / res["layer"], read_frac=bound / res["read"], layer_kernels=kt)
        rows.append(row)
        print(f"T={T}: {n_unique:.2f} experts, bound {bound:.1f} us; layer {res['layer']:.1f} us "
              f"({bound / res['layer']:.1%}); pure read of the same bytes in two launches {res['read']:.1f} us "
              f"({bound / res['read']:.1%})", flush=True)
        for name, us in kt.items():
            print(f"   {us:8.2f} us  {name}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(f"{args.out}/ceiling-moe-decode-h200.json", "w") as f:
            json.dump(dict(about=__doc__.splitlines()[0], copy_gbs=copy_gbs, per_expert_bytes=per_expert, rows=rows),
                      f, indent=1)


if __name__ == "__main__":
    main()
