"""What a new user meets first: help that reads as a command line (flags as flags, OEA explained),
errors in the command line's terms, start-up without the compiler, and ``fp4moe plan`` in a pipe."""

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import fp4moe.plan.crosscompile as cc_mod
from fp4moe.cli import app
from fp4moe.plan.cli import _option_of
from fp4moe.plan.crosscompile import CompiledKernel, cross_compile
from fp4moe.plan.planner import plan_many, smem_breakdown
from fp4moe.plan.space import LinearProblem
from fp4moe.target.compile_request import CompileRequest
from fp4moe.target.smem import SmemBreakdown, SmemTerm

runner = CliRunner()

#: every command's help page, as ``fp4moe ... --help`` prints it
HELP_PAGES = ([], ["plan"], ["quantize"], ["info"], ["gpus"], ["demo"], ["bench"], ["bench", "linear"],
              ["bench", "moe"], ["bench", "calls"], ["bench", "model"])


def _text(result) -> str:
    return " ".join(result.output.split())


@pytest.mark.parametrize("words", HELP_PAGES, ids=lambda w: " ".join(w) or "fp4moe")
def test_help_shows_flags_as_flags(words):
    result = runner.invoke(app, [*words, "--help"])
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output  # a flag takes no value
    assert "--help" in result.output


def test_boolean_options_read_as_switches():
    assert "--explain / --no-explain" in runner.invoke(app, ["plan", "--help"]).output
    quantize = runner.invoke(app, ["quantize", "--help"]).output
    assert "--overwrite / --no-overwrite" in quantize and "--progress / --no-progress" in quantize


def test_command_list_is_not_cut_off():
    output = runner.invoke(app, ["--help"]).output
    commands = output.split("Commands:")[1]
    assert "..." not in commands
    for name in ("quantize", "plan", "info", "gpus", "demo", "bench"):
        assert f"  {name} " in output


def test_bench_moe_help_says_what_oea_is():
    text = _text(runner.invoke(app, ["bench", "moe", "--help"]))
    assert "opportunistic expert activation" in text
    assert "--oea-k0" in text


@pytest.mark.parametrize("args, option, absent", [
    # the presets' names, not a Python list and not the function's argument name
    (["plan", "--arch", "sm120", "--model", "bogus", "--no-compile"], "--model", (" model:", "['")),
    (["plan", "--arch", "sm120", "--config", "/no/such/config.json", "--no-compile"], "--config", (" config:",)),
    # a layer the parallel degree cannot split
    (["plan", "--arch", "sm120", "--model", "glm-5", "--tp", "3", "--no-compile"], "--tp", (" tp:",)),
    (["plan", "--arch", "sm120", "--model", "glm-5", "--ep", "7", "--no-compile"], "--ep", (" ep:",)),
    (["plan", "--arch", "sm120", "--model", "glm-5", "--mode", "w8a8", "--no-compile"], "--mode", ()),
    (["plan", "--gpu", "rtx 9999", "--model", "glm-5", "--no-compile"], "--gpu", ("find_gpu", "argument '")),
    (["bench", "moe", "--model", "bogus"], "--model", (" model:", "['")),
])
def test_errors_name_the_option_in_the_command_lines_terms(args, option, absent):
    result = runner.invoke(app, args)
    text = _text(result)
    assert result.exit_code == 2, text
    assert option in text, text
    for python_term in absent:
        assert python_term not in text, (python_term, text)


def test_expected_presets_are_listed_plainly():
    text = _text(runner.invoke(app, ["plan", "--arch", "sm120", "--model", "bogus", "--no-compile"]))
    assert "expected one of deepseek-v3, glm-5" in text


def test_option_of_a_library_message():
    assert _option_of("tp: glm-5's expert intermediate 2048 is not divisible by 3") == \
        ("--tp", "glm-5's expert intermediate 2048 is not divisible by 3")
    assert _option_of("plan: gpu H100 is sm90, not sm120") == (None, "plan: gpu H100 is sm90, not sm120")


def test_breakdown_is_printed_only_with_content():
    assert smem_breakdown(SmemBreakdown((SmemTerm("x ring", 1024, 2),))) == "x ring 2 x 1,024 B = 2,048 B"
    # only the epilogue: its terms, not "nothing = 0 B; epilogue ..."
    epilogue = smem_breakdown(SmemBreakdown((SmemTerm("partials", 512, 8, phase="epilogue"),)))
    assert epilogue == "partials 8 x 512 B = 4,096 B (epilogue)"
    for extra in ([], ["--explain"]):
        result = runner.invoke(app, ["plan", "--arch", "sm120", "--model", "qwen3-30b-a3b", "--tokens", "1,4096",
                                     "--no-compile", *extra])
        assert result.exit_code == 0, result.output
        assert "nothing" not in result.output


def test_cli_start_up_imports_no_compiler():
    """Help and usage errors need neither Triton nor the kernels; the package itself imports torch
    (``fp4moe.quantize``), the command line adds nothing heavy."""
    code = ("import sys, fp4moe.cli; heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('triton', 'transformers', 'safetensors') or m.startswith(('fp4moe.ops', 'fp4moe.kernels', "
            "'fp4moe.plan.planner', 'fp4moe.plan.space'))); print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_plan_prints_its_table_into_a_pipe(tmp_path):
    env = {**os.environ, "FP4MOE_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "fp4moe.cli", "plan", "--arch", "sm120", "--model", "qwen3-30b-a3b",
                             "--tokens", "1", "--no-compile"], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert "configuration" in result.stdout and "planned" in result.stdout
    assert "qwen3-30b-a3b on" in result.stdout


def test_plan_many_reports_compilations_done_of_total(monkeypatch, tmp_path):
    """``progress(done, total)`` over the distinct compilations, as the workers finish them."""
    seen = []

    def run_workers(requests, jobs, timeout_s, progress=None):
        out = []
        for i, req in enumerate(requests, 1):
            out.append(CompiledKernel(cc=req.cc, ok=True, shared=0, registers=32, spill_bytes=0, mma=(),
                                      loop_spill_ops=0))
            progress(i, len(requests))
        return out

    monkeypatch.setattr(cc_mod, "_run_workers", run_workers)
    items = [("fp4_linear", LinearProblem(M=16, N=512, K=1024)), ("fp4_linear", LinearProblem(M=64, N=512, K=1024))]
    plan_many(items, "sm80", compile=True, cache=False, progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1]
    assert [d for d, _ in seen] == list(range(1, len(seen) + 1))  # one report per compilation, in order


_TINY_KERNEL = """
import triton
import triton.language as tl


@triton.jit
def tiny(x_ptr, n):
    offs = tl.arange(0, 64)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2.0, mask=offs < n)
"""


def test_workers_take_requests_as_they_free_up_and_report_each(tmp_path, monkeypatch):
    """Two workers share three requests; every result comes back with the registers of the ptxas
    run that built it, and progress counts each."""
    (tmp_path / "tinykernel.py").write_text(_TINY_KERNEL)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    requests = [CompileRequest(kernel="tinykernel:tiny", signature={"x_ptr": "*fp32", "n": "i32"}, constexprs={},
                               cc=cc, num_warps=1) for cc in (80, 90, 120)]
    seen = []
    results = cross_compile(requests, jobs=2, progress=lambda done, total: seen.append((done, total)))
    assert [r.ok for r in results] == [True, True, True], [r.error for r in results]
    assert all(r.registers and r.spill_bytes == 0 for r in results)
    assert seen == [(1, 3), (2, 3), (3, 3)]

