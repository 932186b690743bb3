"""The fp4moe command: info, gpus and demo run on a CPU-only machine and speak JSON on request."""

import json

import pytest
from typer.testing import CliRunner

from fp4moe.cli import app

runner = CliRunner()


def test_help_lists_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in ("info", "gpus", "demo"):
        assert name in result.output


def test_info_without_gpu_says_so():
    result = runner.invoke(app, ["info"])
    assert result.exit_code == 0, result.output
    assert "no GPU" in result.output and "triton" in result.output


def test_info_json_for_a_catalogue_gpu():
    result = runner.invoke(app, ["info", "--gpu", "rtx pro 6000", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["detected"] is None
    assert report["catalogue_gpu"]["sm_count"] == 188
    assert report["catalogue_arch"]["smem_per_block_optin"] == 101376
    assert report["versions"]["torch"]


def test_info_unknown_gpu_is_a_clear_error():
    result = runner.invoke(app, ["info", "--gpu", "voodoo 5"])
    assert result.exit_code != 0
    assert "voodoo 5" in result.output


def test_gpus_json_has_the_catalogue():
    result = runner.invoke(app, ["gpus", "--json"])
    assert result.exit_code == 0
    table = json.loads(result.output)
    assert {"H200", "B200"} <= set(table)


def test_demo_reports_round_trip_error():
    result = runner.invoke(app, ["demo", "--rows", "8", "--cols", "64", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert 0 < out["nvfp4"]["relative_rms_error"] < 0.2
    assert out["nvfp4"]["bits_per_element"] == 4.5  # 4 bits + one 8-bit scale per 16
    assert out["mxfp4"]["bits_per_element"] == 4.25


@pytest.mark.slow  # cross-compilation or many interpreter runs: .ci/run runs it
def test_plan_glm5_on_rtx_pro_6000_fits_and_uses_fp4_mma(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4MOE_CACHE_DIR", str(tmp_path))
    result = runner.invoke(app, ["plan", "--gpu", "rtx pro 6000", "--model", "glm-5", "--tp", "8", "--tokens", "16",
                                 "--mode", "w4a4", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["target"] == "sm120" and report["gpu"] == "RTX PRO 6000 Blackwell"
    gemms = [r for r in report["rows"] if r["kernel"] in ("fp4_linear", "fp4_moe_gemm")]
    assert {r["op"] for r in gemms} >= {"experts.w13 (gate+up)", "experts.w2 (down)", "shared.w13", "dense.w2"}
    grouped = {r["op"]: r for r in gemms if r["kernel"] == "fp4_moe_gemm"}  # the routed experts: grouped GEMMs
    assert set(grouped) == {"experts.w13 (gate+up)", "experts.w2 (down)"}
    assert all(r["variant"] == "w4a4_native" and r["count_per_layer"] == 1 for r in grouped.values()), grouped
    for r in report["rows"]:
        assert r["config"] is not None, r
        assert r["proven"] and r["shared_compiled"] <= 101376, r
    for r in gemms:
        assert "kind::mxf4nvf4" in r["mma"], r  # native FP4 MMA, never a silent fallback


def test_plan_bad_input():
    both = runner.invoke(app, ["plan", "--gpu", "h200", "--model", "glm-5", "--config", "x.json"])
    assert both.exit_code != 0 and "exactly one of --model and --config" in both.output
    gpu = runner.invoke(app, ["plan", "--gpu", "voodoo 5", "--model", "glm-5"])
    assert gpu.exit_code != 0 and "voodoo" in gpu.output and "RTX PRO 6000" in gpu.output
    tp = runner.invoke(app, ["plan", "--arch", "sm90", "--model", "glm-5", "--tp", "7"])
    assert tp.exit_code != 0 and "not divisible by 7" in tp.output


def test_demo_refuses_e2e_options_without_e2e():
    result = runner.invoke(app, ["demo", "--family", "gpt_oss", "--timing"])
    assert result.exit_code == 2
    assert "--family, --timing apply to --e2e only" in " ".join(result.output.split())


def test_gpus_table_is_not_squeezed_in_a_pipe():
    result = runner.invoke(app, ["gpus"])  # CliRunner's output is not a terminal
    assert result.exit_code == 0 and "smem/block (opt-in)" in result.output
