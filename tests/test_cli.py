"""The fp4moe command: info, gpus and demo run on a CPU-only machine and speak JSON on request."""

import json

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
