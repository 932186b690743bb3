"""fp4moe.distributed: FP4 weights sharded exactly; tensor- and expert-parallel MoE blocks and linears
on gloo process groups equal the single-process modules within the reduction order's rounding."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp4moe.distributed import (ExpertPlacement, ParallelFP4MoE, ParallelGroups, column_parallel, make_groups,
                                row_parallel)
from fp4moe.distributed.shard import shard_gate_up, shard_k, shard_range, shard_rows, take_experts
from fp4moe.models import Routing
from fp4moe.nn import FP4Linear, FP4MoE
from fp4moe.quantize import dequantize, quantize, quantize_stacked

# ---------------------------------------------------------------------------------------------
# slicing: every shard dequantizes to exactly the full weight's values


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_shards_dequantize_exactly(fmt):
    g = torch.Generator().manual_seed(0)
    w = quantize_stacked(torch.randn(3, 8, 128, generator=g), fmt)  # per-expert globals
    full = dequantize(w, torch.float32)
    assert torch.equal(dequantize(shard_k(w, 2, 1), torch.float32), full[..., 64:])
    assert torch.equal(dequantize(shard_rows(w, slice(2, 6)), torch.float32), full[:, 2:6])
    assert torch.equal(dequantize(take_experts(w, torch.tensor([2, 0])), torch.float32), full[[2, 0]])
    gu = dequantize(shard_gate_up(w, 2, 1), torch.float32)  # gate rows 2:4, up rows 6:8
    assert torch.equal(gu, torch.cat([full[:, 2:4], full[:, 6:8]], dim=1))
    inter = dequantize(shard_gate_up(w, 2, 0, interleaved=True), torch.float32)  # whole (gate, up) pairs
    assert torch.equal(inter, full[:, :4])


def test_per_row_global_scales_follow_their_rows():
    w = quantize(torch.randn(8, 64), "nvfp4")
    per_row = type(w)(data=w.data, scales=w.scales, global_scale=torch.linspace(0.5, 2, 8), shape=w.shape,
                      fmt=w.fmt)
    part = shard_rows(per_row, slice(4, 8))
    assert torch.equal(part.global_scale, per_row.global_scale[4:])
    assert torch.equal(dequantize(part, torch.float32), dequantize(per_row, torch.float32)[4:])


def test_cuts_off_block_boundaries_are_refused():
    w = quantize(torch.randn(8, 64), "nvfp4")
    with pytest.raises(ValueError, match="multiples of 16"):
        shard_k(w, 8, 0)  # 8 columns per shard: half an NVFP4 block
    with pytest.raises(ValueError, match="equal shards"):
        shard_range(10, 3, 0, what="rows")
    with pytest.raises(ValueError, match="index"):
        shard_range(8, 2, 2, what="rows")


def test_placement():
    p = ExpertPlacement.contiguous(7, 3)
    assert p.owners == ((0, 1, 2), (3, 4), (5, 6))
    assert p.owner_table().tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert p.local_table().tolist() == [0, 1, 2, 0, 1, 0, 1]
    assert ExpertPlacement.of([[3, 0], [1, 2]], 4, 2).local_table().tolist() == [1, 0, 1, 0]
    for bad, match in (([[0, 1], [1, 2, 3]], "owned by ranks 0 and 1"), ([[0], [1, 2]], "no owner"),
                       ([[0, 1, 2, 3], []], "owns no expert"), ([[0, 1], [2, 9]], "outside")):
        with pytest.raises(ValueError, match=match):
            ExpertPlacement(4, bad)
    with pytest.raises(ValueError, match="2 ranks"):
        ExpertPlacement.of([[0, 1, 2, 3]], 4, 2)
    with pytest.raises(ValueError, match="ranks"):
        ExpertPlacement.contiguous(2, 3)


def test_groups_are_checked():
    with pytest.raises(ValueError, match="tp_group"):
        ParallelGroups(tp=2, tp_rank=0)
    with pytest.raises(ValueError, match="tp_rank"):
        ParallelGroups(tp=1, tp_rank=1)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            make_groups(2, 1)


def test_one_rank_is_the_block_itself():
    """tp = ep = 1: no communication, the same call as the block (bit for bit)."""
    moe, x = _block(Routing("softmax", top_k=2), shared="pair", seed=1)
    par = ParallelFP4MoE.from_module(moe, ParallelGroups())
    assert torch.equal(par(x), moe(x))
    par.half()  # FP4MoE's .to(): the FP4 experts and the fp32 selection keep their dtypes
    assert par.w13_weight.dtype == torch.uint8 and par.w13.fmt.name == "nvfp4"


def test_bad_options():
    moe, _ = _block(Routing("softmax", top_k=2), shared=None, seed=1)
    with pytest.raises(ValueError, match="dispatch"):
        ParallelFP4MoE(moe, ParallelGroups(), dispatch="broadcast")
    with pytest.raises(TypeError, match="ParallelGroups"):
        ParallelFP4MoE(moe, (1, 1))
    with pytest.raises(TypeError, match="FP4MoE"):
        ParallelFP4MoE(torch.nn.Linear(2, 2), ParallelGroups())


# ---------------------------------------------------------------------------------------------
# several processes on gloo

E, H, I = 8, 64, 64


def _block(routing, *, shared, seed, k0=None, interleaved=False, activation="silu", one_rank_experts=None):
    """A block with E experts; ``one_rank_experts``: router rows that send every (positive) token to
    those experts."""
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=g)
    if one_rank_experts is not None:
        router = -torch.ones(E, H)
        router[list(one_rank_experts)] = torch.linspace(1, 2, len(one_rank_experts))[:, None]
    kw = dict(k0=k0, interleaved=interleaved, activation=activation)
    if routing.kind == "sigmoid_bias":
        kw["selection_bias"] = torch.randn(E, generator=g) * 0.1
    if routing.kind == "gpt_oss":
        kw["w13_bias"] = torch.randn(E, 2 * I, generator=g).bfloat16()
        kw["w2_bias"] = torch.randn(E, H, generator=g).bfloat16()
    if shared == "pair":
        kw.update(shared_gate_up=torch.randn(2 * I, H, generator=g), shared_down=torch.randn(H, I, generator=g))
    moe = FP4MoE.from_bf16(router.bfloat16(), torch.randn(E, 2 * I, H, generator=g) / 8,
                           torch.randn(E, H, I, generator=g) / 8, routing, **kw)
    if shared == "gated":
        from fp4moe.nn import GatedMLP

        torch.manual_seed(seed)  # the same shared expert on every rank
        moe.shared_expert = GatedMLP(*(FP4Linear.from_linear(torch.nn.Linear(a, b, bias=False))
                                       for a, b in ((H, I), (H, I), (I, H))))
    x = torch.randn(6, H, generator=g).bfloat16()
    return moe, x


def _tokens(case, rank, world):
    """This rank's tokens (each rank its own, or the same on all for dispatch 'replicated')."""
    g = torch.Generator().manual_seed(100 + (0 if case.get("dispatch") == "replicated" else rank))
    T = case.get("tokens", [5] * world)[rank]
    x = torch.randn(T, H, generator=g).bfloat16()
    return x.abs() if "one_rank_experts" in case else x


def _assert_close(out, ref, what):
    assert out.shape == ref.shape, what
    if ref.numel() == 0:
        return
    scale = ref.float().abs().max().clamp(min=1e-3)
    err = (out.float() - ref.float()).abs().max() / scale
    # each rank's partial output is rounded to bf16 (2^-8 relative) before the sum
    assert err < 2e-2, f"{what}: max error {err:.3g} of the output's max"


def _worker(rank, world, port, cases):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        made = {}
        for case in cases:
            tp, ep = case["tp"], case["ep"]
            if (tp, ep) not in made:
                made[tp, ep] = make_groups(tp, ep)
            groups = made[tp, ep]
            kw = {k: case[k] for k in ("k0", "interleaved", "activation", "one_rank_experts") if k in case}
            moe, _ = _block(case["routing"], shared=case.get("shared"), seed=7, **kw)
            x = _tokens(case, groups.ep_rank, ep)  # tensor-parallel ranks hold the same tokens
            par = ParallelFP4MoE.from_module(moe, groups, dispatch=case.get("dispatch", "all_gather"),
                                             placement=case.get("placement"))
            out = par(x)
            ref = moe(x) if len(x) else x.new_zeros(0, H)
            _assert_close(out, ref, f"rank {rank} {case['name']}")
            if moe.k0 is not None and len(x):
                assert torch.equal(par.last_stats.active_experts, moe.last_stats.active_experts), case["name"]
        if any(case.get("linear") for case in cases):
            _linear_checks(rank, world)
    finally:
        dist.destroy_process_group()


def _linear_checks(rank, world):
    """Column-parallel then row-parallel linears (one all-reduce) equal the two whole linears."""
    torch.manual_seed(11)  # the same linears on every rank
    up = FP4Linear.from_linear(torch.nn.Linear(H, 4 * H).to(torch.bfloat16))
    down = FP4Linear.from_linear(torch.nn.Linear(4 * H, H).to(torch.bfloat16))
    x = torch.randn(3, H).bfloat16()
    ref = down(up(x))
    col = column_parallel(up, world, rank)
    row = row_parallel(down, world, rank, dist.group.WORLD)
    _assert_close(row(col(x)), ref, f"rank {rank} column -> row parallel linears")


def _spawn(world, cases):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(world, port, cases), nprocs=world, join=True)


SOFTMAX = Routing("softmax", top_k=2)
SIGMOID = Routing("sigmoid_bias", top_k=2, n_group=2, topk_group=1, routed_scaling_factor=2.5)
GPT_OSS = Routing("gpt_oss", top_k=2, renormalize=False)


def test_two_ranks_core():
    """One case of each parallelism and dispatch mode (the full list: ``test_two_ranks``)."""
    _spawn(2, [c for c in TWO_RANK_CASES if c["name"] in CORE])


@pytest.mark.slow
def test_two_ranks():
    """Tensor parallelism, expert parallelism in each dispatch mode, the shared expert, biases, OEA,
    a rank with no tokens, every token on one rank's experts, an explicit placement; and the
    column -> row parallel linears."""
    _spawn(2, TWO_RANK_CASES)


CORE = ("tp2 softmax shared pair", "ep2 all_to_all sigmoid", "ep2 all_gather, rank 1 has no tokens")
TWO_RANK_CASES = [
    dict(name="tp2 softmax shared pair", tp=2, ep=1, routing=SOFTMAX, shared="pair", linear=True),
    dict(name="tp2 gpt-oss interleaved biases", tp=2, ep=1, routing=GPT_OSS, interleaved=True,
         activation="gpt_oss"),
    dict(name="ep2 all_gather sigmoid", tp=1, ep=2, routing=SIGMOID, shared="pair"),
    dict(name="ep2 all_to_all sigmoid", tp=1, ep=2, routing=SIGMOID, shared="gated", dispatch="all_to_all"),
    dict(name="ep2 replicated", tp=1, ep=2, routing=SOFTMAX, shared="pair", dispatch="replicated"),
    dict(name="ep2 all_gather OEA", tp=1, ep=2, routing=SOFTMAX, k0=1),
    dict(name="ep2 all_to_all OEA gpt-oss biases", tp=1, ep=2, routing=GPT_OSS, k0=1, dispatch="all_to_all",
         activation="gpt_oss"),
    dict(name="ep2 all_gather, rank 1 has no tokens", tp=1, ep=2, routing=SOFTMAX, tokens=[5, 0]),
    dict(name="ep2 all_to_all, rank 0 has no tokens", tp=1, ep=2, routing=SOFTMAX, tokens=[0, 4],
         dispatch="all_to_all"),
    dict(name="ep2 all_to_all, every token on rank 0's experts", tp=1, ep=2, routing=SOFTMAX,
         one_rank_experts=(0, 1, 2, 3), dispatch="all_to_all"),
    dict(name="ep2 all_gather, every token on rank 1's experts", tp=1, ep=2, routing=SOFTMAX,
         one_rank_experts=(5, 6), shared="pair"),
    dict(name="ep2 top-6 of 8 experts: more than a rank's 4", tp=1, ep=2, routing=Routing("softmax", top_k=6),
         dispatch="all_to_all"),
    dict(name="ep2 explicit placement", tp=1, ep=2, routing=SIGMOID, dispatch="all_to_all",
         placement=[[7, 0, 3], [1, 2, 4, 5, 6]]),
]


@pytest.mark.slow
def test_four_ranks():
    """Tensor x expert parallelism (2 x 2) in each dispatch mode, and four expert-parallel ranks."""
    cases = [
        dict(name="tp2 x ep2 all_gather", tp=2, ep=2, routing=SIGMOID, shared="pair"),
        dict(name="tp2 x ep2 all_to_all", tp=2, ep=2, routing=SOFTMAX, shared="gated", dispatch="all_to_all"),
        dict(name="tp2 x ep2 replicated", tp=2, ep=2, routing=SOFTMAX, shared="pair", dispatch="replicated"),
        dict(name="ep4 all_to_all, a rank with no tokens", tp=1, ep=4, routing=SOFTMAX, tokens=[3, 0, 5, 2],
             dispatch="all_to_all", k0=1),
        dict(name="tp4", tp=4, ep=1, routing=GPT_OSS, interleaved=True, activation="gpt_oss", linear=True),
    ]
    _spawn(4, cases)


# ---------------------------------------------------------------------------------------------
# a model: its MoE blocks split over two ranks generate the tokens of the whole model


def _model_worker(rank, world, port, family, tp, ep, out_dir):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from fp4moe.distributed import shard_moe_blocks
    from fp4moe.integrations.transformers.convert import quantize_model
    from fp4moe.integrations.transformers.e2e import build_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = quantize_model(build_model(family, "tiny", seed=5))
        ids = torch.randint(1, model.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(1))
        gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            whole = model.generate(ids, **gen)
            names = shard_moe_blocks(model, make_groups(tp, ep))
            assert names and all(type(model.get_submodule(n)).__name__ == "ParallelFP4MoE" for n in names)
            split = model.generate(ids, **gen)
        torch.save({"whole": whole, "split": split}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("family,tp,ep", [("qwen3_moe", 1, 2), ("deepseek_v3", 2, 1)])
def test_model_split_two_ways_generates_the_same_tokens(family, tp, ep, tmp_path):
    pytest.importorskip("transformers")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_model_worker, args=(2, port, family, tp, ep, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["whole"].shape[1] == 9
        assert torch.equal(r["split"], r["whole"]), f"rank {rank}: {r['split'].tolist()} != {r['whole'].tolist()}"


# ---------------------------------------------------------------------------------------------
# loading: each rank reads only its own experts


def test_checkpoint_reads_only_the_experts_asked_for(tmp_path):
    """Per-expert tensors (ModelOpt) and stacked ones (gpt-oss, read by rows): a subset equals the
    same experts of the whole layer, and no other expert's bytes are read."""
    from fp4moe.checkpoints import open_checkpoint
    from fp4moe.checkpoints.safetensors_io import ShardSet
    from test_checkpoints import gpt_oss_model

    gpt_oss_model(tmp_path / "g")
    reads = []
    real = ShardSet.read

    def spy(self, name, rows=None):
        t = real(self, name, rows)
        reads.append((name, rows))
        return t

    ShardSet.read = spy
    try:
        with open_checkpoint(tmp_path / "g") as ckpt:
            prefix = ckpt.moe_layers()[0]
            whole = ckpt.experts(prefix)
            reads.clear()
            part = ckpt.experts(prefix, [3, 0, 1])
            assert all(rows is not None for _, rows in reads), reads  # row slices, never whole tensors
            for a, b in ((part.w13, whole.w13), (part.w2, whole.w2)):
                assert torch.equal(dequantize(a, torch.float32), dequantize(b, torch.float32)[[3, 0, 1]])
            assert torch.equal(part.w13_bias, whole.w13_bias[[3, 0, 1]])
            with pytest.raises(ValueError, match="distinct ids"):
                ckpt.experts(prefix, [0, 0])
            with pytest.raises(ValueError, match="distinct ids"):
                ckpt.experts(prefix, [whole.w13.shape[0]])
    finally:
        ShardSet.read = real


def _load_worker(rank, world, port, path, out_dir, tp, ep):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from fp4moe.checkpoints.safetensors_io import ShardSet
    from fp4moe.integrations.transformers import load_fp4_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        read = []
        real = ShardSet.read

        def spy(self, name, rows=None):
            read.append(name)
            return real(self, name, rows)

        ShardSet.read = spy
        groups = make_groups(tp, ep)
        model = load_fp4_model(path, device="cpu", parallel=groups)
        ShardSet.read = real
        ids = torch.randint(1, model.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            split = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        blocks = [m for m in model.modules() if isinstance(m, ParallelFP4MoE)]
        torch.save({"split": split, "read": read, "experts": [b.expert_ids.tolist() for b in blocks],
                    "w2_k": [b.w2_weight.shape[-1] * 2 for b in blocks]}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 1)])
def test_sharded_load_reads_own_experts_and_generates_the_same_tokens(qwen_checkpoint, tmp_path, tp, ep):
    import re

    from fp4moe.integrations.transformers import load_fp4_model

    path = qwen_checkpoint / "q"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_load_worker, args=(2, port, str(path), str(tmp_path), tp, ep), nprocs=2, join=True)
    whole = load_fp4_model(path, device="cpu")
    ids = torch.randint(1, whole.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = whole.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    n_experts = whole.config.num_experts
    inter = whole.config.moe_intermediate_size
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(r["split"], ref), f"rank {rank}: {r['split'].tolist()} != {ref.tolist()}"
        own = ExpertPlacement.contiguous(n_experts, ep).owners[rank // tp]
        assert all(e == list(own) for e in r["experts"])
        assert all(k == inter // tp for k in r["w2_k"])
        read_experts = {int(m.group(1)) for name in r["read"] if (m := re.search(r"\.experts\.(\d+)\.", name))}
        assert read_experts == set(own), f"rank {rank} read experts {sorted(read_experts)}, owns {own}"


# ---------------------------------------------------------------------------------------------
# the benchmark of a split layer (the code path; its numbers are the GPU's business)


def _bench_worker(rank, world, port, out_dir):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from fp4moe.bench.parallel import run_parallel_moe_bench

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rows = []
        for tp, ep, dispatch in ((1, 2, "all_gather"), (1, 2, "all_to_all"), (2, 1, "replicated")):
            rows += run_parallel_moe_bench("qwen3-30b-a3b", tp=tp, ep=ep, dispatch=dispatch, tokens=(1, 3), reps=2,
                                           warmup=1, shapes=dict(n_experts=8, hidden=64, intermediate=64))
        torch.save(rows, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_parallel_bench_runs_on_gloo(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_bench_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert [r["call_us"] for r in a] == [r["call_us"] for r in b]  # every rank reports the same rows
    assert len(a) == 6
    for row in a:
        assert row["call_us"] > 0 and row["compute_us"] > 0 and row["imbalance"] >= 1.0
        assert len(row["per_rank"]) == 2
    # all_gather hands each rank every rank's tokens (3 + 3 rows at 3 tokens per rank)
    assert next(r for r in a if r["dispatch"] == "all_gather" and r["tokens_per_rank"] == 3)["rows_computed"] == 6
