"""The benchmark harness on CPU: roofline arithmetic, timing statistics, reports, the CLI.

Timing itself needs CUDA events and graphs: those tests are marked gpu.
"""

import json

import pytest
import torch
import typer
from typer.testing import CliRunner

from fp4moe.target import roofline as rl
from fp4moe.bench.cli import NO_GPU, bench_app, parse_ms, parse_modes, parse_shapes
from fp4moe.bench.linear import linear_metrics
from fp4moe.bench.report import environment, gpu_slug, markdown, one_line, write_results
from fp4moe.bench.timing import rotating, rotation_count, summarize

# ------------------------------------------------------------------------------------------
# roofline (numbers checked by hand)


def test_fp4_weight_bytes_glm5_shape():
    # 12288*6144 = 75,497,472 elements: half a byte each, plus one scale per 16 (NVFP4) or 32 (MXFP4)
    assert rl.fp4_weight_bytes(12288, 6144, "nvfp4") == 37_748_736 + 4_718_592
    assert rl.fp4_weight_bytes(12288, 6144, "mxfp4") == 37_748_736 + 2_359_296


def test_fp4_weight_bytes_rejects_partial_blocks():
    with pytest.raises(ValueError, match="block size 32"):
        rl.fp4_weight_bytes(16, 48, "mxfp4")


def test_linear_flops_and_bytes():
    assert rl.linear_flops(16, 12288, 6144) == 2 * 16 * 12288 * 6144
    # weight + x (bf16 [16, 6144]) + y (bf16 [16, 12288])
    assert rl.linear_bytes(16, 12288, 6144, "nvfp4") == 42_467_328 + 196_608 + 393_216


def test_roofline_takes_the_larger_term():
    # 1 GB at 1000 GB/s = 1000 µs; 1 TFLOP at 500 TFLOP/s = 2000 µs
    assert rl.roofline_us(1e9, 1e12, 1000, 500) == pytest.approx(2000)
    assert rl.roofline_us(4e9, 1e12, 1000, 500) == pytest.approx(4000)
    with pytest.raises(ValueError):
        rl.roofline_us(1, 1, 0, 1)


def test_fraction_gbs_tflops():
    assert rl.fraction(200.0, 100.0) == 0.5
    assert rl.gbs(4.8e9, 1e3) == pytest.approx(4800)  # 4.8 GB in one millisecond
    assert rl.tflops(1e12, 1e6) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="positive time"):
        rl.fraction(0.0, 1.0)


def test_linear_metrics():
    ceilings = {"copy_gbs": 4000.0, "bf16_tflops": 800.0, "fp4_tflops_datasheet": None}
    weight = 42_467_328
    m = linear_metrics(1, 12288, 6144, "nvfp4", "w4a16", us=20.0, ceilings=ceilings, torch_us=40.0)
    assert m["weight_gbs"] == pytest.approx(weight / 20e3)
    assert m["frac_weight_bound"] == pytest.approx(weight / 4e6 / 20)
    assert m["speedup"] == 2.0
    # at M=16384 the bf16 peak bounds: 2.47 TFLOP / 800 TFLOP/s = 3092 µs
    big = linear_metrics(16384, 12288, 6144, "nvfp4", "w4a4", us=6184.0, ceilings=ceilings)
    assert big["frac_roofline"] == pytest.approx(2 * 16384 * 12288 * 6144 / 800e6 / 6184)
    assert big["speedup"] is None
    # a chip with FP4 MMA: W4A4 is held against the datasheet FP4 peak
    fp4 = linear_metrics(16384, 12288, 6144, "nvfp4", "w4a4", us=6184.0,
                         ceilings={**ceilings, "fp4_tflops_datasheet": 1600.0})
    assert fp4["frac_roofline"] == pytest.approx(big["frac_roofline"] / 2)


# ------------------------------------------------------------------------------------------
# timing helpers that need no GPU


def test_summarize_percentiles():
    r = summarize([5.0, 1.0, 3.0, 2.0, 4.0], graph=False)
    assert (r.median_us, r.p10_us, r.p90_us, r.n, r.graph) == (3.0, 1.4, 4.6, 5, False)
    with pytest.raises(ValueError):
        summarize([])


def test_rotation_count():
    l2 = 50 * 2**20
    assert rotation_count(42_467_328, l2) == 5  # 5 sets = 212 MB > 4 x 52 MB
    assert rotation_count(300 * 2**20, l2) == 1  # one set is already > 4 x L2
    assert rotation_count(2**30, l2, cap_bytes=2**30) == 1
    assert rotation_count(2**20, l2, cap_bytes=16 * 2**20) == 16  # capped by memory
    assert rotation_count(7 * 2**20, l2) * 7 * 2**20 > 4 * l2


def test_rotating_cycles_through_the_sets():
    call = rotating(lambda a, b: a + b, [(1, 10), (2, 20), (3, 30)])
    assert [call() for _ in range(7)] == [11, 22, 33, 11, 22, 33, 11]
    with pytest.raises(ValueError):
        rotating(print, [])


# ------------------------------------------------------------------------------------------
# reports


def _rows():
    return [
        {"kind": "linear", "shape": "12288x6144", "M": 1, "mode": "w4a16", "us": 12.345, "error": None},
        {"kind": "linear", "shape": "12288x6144", "M": 4, "mode": "w4a4", "us": None, "error": "error: boom | bad"},
        {"kind": "quantize", "shape": "16384x6144", "M": 16384, "global_scale": "given", "us": 50.0},
    ]


def test_environment_stamp():
    env = environment()
    for key in ("gpu", "driver", "torch", "triton", "fp4moe", "commit", "dirty", "timestamp_utc", "command", "argv"):
        assert key in env
    assert env["commit"] == "unknown" or len(env["commit"]) == 40
    json.dumps(env)


def test_gpu_slug():
    assert gpu_slug("NVIDIA H200") == "h200"
    assert gpu_slug("NVIDIA RTX PRO 6000 Blackwell Workstation Edition") == "rtx-pro-6000-blackwell-workstation-edition"
    assert gpu_slug(None) == "cpu"


def test_write_results(tmp_path):
    env = {**environment(), "gpu": "NVIDIA H200", "command": "fp4moe bench linear --m 1,4"}
    ceilings = {"copy_gbs": 4300.0, "bf16_tflops": 790.0}
    json_path, md_path = write_results("linear", env, _rows(), tmp_path / "benchmarks", ceilings=ceilings)
    assert json_path.name == "linear-h200.json" and md_path.name == "linear-h200.md"
    data = json.loads(json_path.read_text())
    assert data["ceilings"] == ceilings and data["rows"] == _rows()
    assert data["environment"]["command"] == "fp4moe bench linear --m 1,4"
    md = md_path.read_text()
    assert "| shape | M | mode | us | error |" in md
    assert "| 12288x6144 | 1 | w4a16 | 12.35 | — |" in md
    assert "error: boom \\| bad" in md  # a | in a cell must not split the table
    assert "## quantize" in md and "| shape | M | global_scale | us |" in md
    assert "`fp4moe bench linear --m 1,4`" in md and "copy_gbs: 4300" in md
    write_results("linear", env, _rows()[:1], tmp_path / "benchmarks", ceilings=ceilings)  # overwrites
    assert len(json.loads(json_path.read_text())["rows"]) == 1
    assert "FP4MOE_ARCH" not in md


def test_write_results_of_another_architectures_kernels(tmp_path):
    """A run under FP4MOE_ARCH is written beside the GPU's own results, never over them, and says so."""
    env = {**environment(), "gpu": "NVIDIA H200", "kernels_arch": "sm80"}
    json_path, md_path = write_results("linear", env, _rows(), tmp_path)
    assert json_path.name == "linear-h200-sm80-kernels.json" and md_path.name == "linear-h200-sm80-kernels.md"
    assert "- kernels: sm80's (FP4MOE_ARCH)" in md_path.read_text()


def test_one_line():
    assert one_line("error: RuntimeError: boom\nat line 3") == "error: RuntimeError: boom"
    assert one_line("x" * 100, 10) == "x" * 9 + "…"


def test_markdown_without_rows():
    assert "- none" in markdown("x", {}, {}, [])


# ------------------------------------------------------------------------------------------
# the command line

runner = CliRunner()


def test_parse_options():
    assert parse_ms("1, 16,256") == (1, 16, 256)
    assert parse_shapes("12288x6144, 4096X6144,6144×2048") == ((12288, 6144), (4096, 6144), (6144, 2048))
    assert parse_modes("w4a4") == ("w4a4",)
    for bad in ("", "1,,4", "0", "-1", "1.5", "a"):
        with pytest.raises(typer.BadParameter, match="positive integers"):
            parse_ms(bad)
    for bad in ("12288", "12288x", "x6144", "12288x6144x2", "0x16", "12288x6144,"):
        with pytest.raises(typer.BadParameter, match="NxK"):
            parse_shapes(bad)
    with pytest.raises(typer.BadParameter, match="w4a16, w4a4"):
        parse_modes("w4a8")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--m", "1,x"], "positive integers"),
        (["--shapes", "12288by6144"], "NxK"),
        (["--modes", "w8a8"], "w4a16"),
        (["--fmt", "int4"], "nvfp4"),
        (["--shapes", "128x40"], "block size 16"),  # K not a whole number of NVFP4 blocks
    ],
)
def test_cli_rejects_bad_options(args, message):
    result = runner.invoke(bench_app, ["linear", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_cli_without_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = runner.invoke(bench_app, ["linear", "--m", "1,4", "--shapes", "256x512", "--quick"])
    assert result.exit_code == 2
    assert NO_GPU in result.output


@pytest.mark.parametrize("args, message", [
    (["calls", "--models", "glm-6"], "glm-6"),
    (["calls", "--m", "0"], "positive integers"),
    (["model", "--model", "gpt-oss-120b"], "gpt-oss-120b"),
    (["model", "--batches", "1,x"], "positive integers"),
    (["model", "--layers", "0"], "greater than or equal to 1"),
])
def test_calls_and_model_reject_bad_options(args, message):
    result = runner.invoke(bench_app, args)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


@pytest.mark.parametrize("command", [["calls"], ["model"]])
def test_calls_and_model_without_gpu(monkeypatch, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = runner.invoke(bench_app, command)
    assert result.exit_code == 2 and NO_GPU in result.output


def test_model_bench_sizes_its_layers_to_the_memory():
    """One dense layer and as many MoE layers as fit beside the headroom (bf16 sizes on the meta device),
    never more than the model has; too little memory is a clear error."""
    pytest.importorskip("transformers")
    from fp4moe.bench.model import auto_layers, bench_config, bf16_step_bytes

    assert auto_layers("glm-5", 80 * 2**30) == 4  # an H100: three GLM-5 MoE layers of 18 GiB
    assert auto_layers("glm-5", 141 * 2**30) == 7
    assert auto_layers("qwen3-30b-a3b", 141 * 2**30) == 48  # all of its layers: no dense one
    with pytest.raises(ValueError, match="do not fit"):
        auto_layers("glm-5", 20 * 2**30)
    cfg = bench_config("glm-5", 4)
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts) == (6144, 2048, 256)
    # one token, 8 experts per MoE layer: the touched experts, not all 256
    full, one = bf16_step_bytes("glm-5", 4, 1, 256), bf16_step_bytes("glm-5", 4, 1, 8)
    expert = 3 * 2048 * 6144 * 2
    assert full - one == 3 * (256 - 8) * expert


def test_clock_monitor_without_nvml_is_empty(monkeypatch):
    """Without NVML (this CPU machine, or no pynvml) the monitor is a no-op context, not an error."""
    import sys

    from fp4moe.bench.timing import ClockMonitor, time_cuda_graphs

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    with ClockMonitor() as monitor:
        pass
    assert monitor.summary() == {}
    with pytest.raises(ValueError, match="at least one"):
        time_cuda_graphs({})


def test_joint_timing_falls_back_to_one_call_at_a_time(monkeypatch):
    """Where timing the calls together fails, each is timed alone and the rows say "separate"; a
    call that fails alone keeps its error without costing the others their times."""
    import sys

    from fp4moe.bench import linear as bl
    from fp4moe.bench.timing import TimingResult

    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML here: no clock context

    def joint(calls, **kw):
        raise RuntimeError("capture ran out of memory")

    def alone(call, **kw):
        return call()

    monkeypatch.setattr(bl, "time_cuda_graphs", joint)
    monkeypatch.setattr(bl, "time_cuda_graph", alone)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)  # nothing to free without a GPU
    ok = TimingResult(median_us=5.0, p10_us=4.0, p90_us=6.0, n=3)

    def broken():
        raise MemoryError("baseline")

    times, clocks, how = bl._time_together({"w4a16": lambda: ok, "torch": broken}, {"reps": 3})
    assert how == "separate" and clocks == {}
    assert times["w4a16"] is ok and isinstance(times["torch"], MemoryError)
    monkeypatch.setattr(bl, "time_cuda_graphs", lambda calls, **kw: {k: ok for k in calls})
    times, _, how = bl._time_together({"w4a16": lambda: ok}, {"reps": 3})
    assert how == "interleaved" and times == {"w4a16": ok}


# ------------------------------------------------------------------------------------------
# on a GPU


@pytest.mark.gpu
def test_time_cuda_graph_and_ceilings():
    from fp4moe.bench.timing import measure_bf16_peak, measure_copy_bandwidth, time_cuda_graph

    a = torch.randn(1024, 1024, device="cuda")
    r = time_cuda_graph(lambda: a @ a, iters_per_graph=4, reps=5)
    assert r.graph and r.n == 5 and 0 < r.p10_us <= r.median_us <= r.p90_us
    eager = time_cuda_graph(lambda: a.sum().item(), iters_per_graph=2, reps=3)  # .item() cannot be captured
    assert not eager.graph and eager.median_us > 0
    torch.randn(4, device="cuda")  # the default generator is usable after a failed capture
    assert measure_copy_bandwidth(2**26) > 50
    assert measure_bf16_peak(1024) > 1


@pytest.mark.gpu
def test_time_cuda_graphs_interleaves_and_keeps_each_time():
    """Each function keeps its own time (a 4x larger product takes longer), a function that cannot
    be captured is timed eagerly beside captured ones, and the clock monitor reports where NVML is."""
    from fp4moe.bench.timing import ClockMonitor, time_cuda_graphs

    a, b = torch.randn(512, 512, device="cuda"), torch.randn(2048, 2048, device="cuda")
    with ClockMonitor(period_s=0.001) as monitor:
        r = time_cuda_graphs({"small": lambda: a @ a, "large": lambda: b @ b, "eager": lambda: a.sum().item()},
                             iters_per_graph=4, reps=6)
    assert set(r) == {"small", "large", "eager"} and all(t.n == 6 for t in r.values())
    assert r["small"].graph and r["large"].graph and not r["eager"].graph
    assert r["large"].median_us > r["small"].median_us
    summary = monitor.summary()
    if summary:  # pynvml present
        assert summary["sm_mhz"] > 0 and summary["power_w"] > 0 and 0 <= summary["power_capped"] <= 1


@pytest.mark.gpu
def test_run_linear_bench_small(tmp_path):
    from fp4moe.bench.linear import run_linear_bench, run_quantize_bench

    ceilings = {"copy_gbs": 1000.0, "bf16_tflops": 100.0, "l2_bytes": 2**20, "fp4_tflops_datasheet": None}
    rows = run_linear_bench([(256, 512)], [1, 16], ["w4a16", "w4a4"], "nvfp4", ceilings=ceilings, reps=3,
                            iters_per_graph=2)
    rows += run_quantize_bench(256, 512, ceilings=ceilings, reps=3, iters_per_graph=2)
    assert len(rows) == 6
    for row in rows:  # a row either has a time or says why not
        assert (row["us"] is not None) != bool(row["error"]), row
    assert all(r["torch_us"] for r in rows if r["kind"] == "linear")  # the baseline does not depend on fp4
    write_results("linear-test", environment(), rows, tmp_path, ceilings=ceilings)


def test_random_experts_are_the_seeded_stacked_weights():
    """``bench.moe.random_experts`` (the benchmark's and the MoE scripts' weights): w13 [E, 2I, H] then
    w2 [E, H, I] drawn in that order from the generator, quantized expert by expert, one global scale
    per expert; the same seed gives the same bytes."""
    from fp4moe.bench.moe import random_experts
    from fp4moe.quantize import quantize_stacked

    E, H, I = 3, 64, 32
    w13, w2 = random_experts(E, H, I, "nvfp4", torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(5)
    ref13 = quantize_stacked(torch.randn(E, 2 * I, H, dtype=torch.bfloat16, generator=gen), "nvfp4")
    ref2 = quantize_stacked(torch.randn(E, H, I, dtype=torch.bfloat16, generator=gen), "nvfp4")
    assert tuple(w13.shape) == (E, 2 * I, H) and tuple(w2.shape) == (E, H, I)
    for got, ref in ((w13, ref13), (w2, ref2)):
        assert torch.equal(got.data, ref.data) and torch.equal(got.scales, ref.scales)
        assert torch.equal(got.global_scale, ref.global_scale) and got.global_scale.numel() == E


@pytest.mark.gpu
def test_run_moe_bench_small():
    """The MoE bench on Qwen3-30B-A3B's small experts: the layer and the grouped_mm baseline timed
    together, exact routing and OEA, every row a time or an error."""
    from fp4moe.bench.moe import run_moe_bench

    ceilings = {"copy_gbs": 1000.0, "bf16_tflops": 100.0, "l2_bytes": 2**20, "fp4_tflops_datasheet": None}
    rows = run_moe_bench("qwen3-30b-a3b", ms=[4], routings=("uniform",), oea_ms=(8,), ceilings=ceilings)
    assert len(rows) == 3
    for row in rows:
        assert row["us"] is not None and not row["error"], row
    exact = [r for r in rows if r["oea_k0"] is None]
    assert all(r["torch_us"] and r["speedup"] for r in exact)  # timed beside the layer
    assert all(r["torch_us"] is None for r in rows if r["oea_k0"] is not None)


def test_plain_call_timing_on_cpu_runs_before_each_repetition():
    """``time_plain_calls`` on a CPU device: host time for both numbers, ``before`` once per repetition
    and never inside the timed calls."""
    from fp4moe.bench.timing import time_plain_calls

    log = []
    stream, host = time_plain_calls(lambda: log.append("call"), calls=2, reps=3, before=lambda: log.append("before"),
                                    device="cpu")
    assert log == ["before", "call", "call"] * 3
    assert stream.n == host.n == 3 and stream.median_us == host.median_us >= 0
