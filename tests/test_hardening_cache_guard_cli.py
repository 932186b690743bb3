"""Faults injected into the plan cache, the numerical guard's switch and the command line's inputs:
each is detected and reported in the user's terms, never a crash or a silent wrong answer."""

import json
import warnings
from dataclasses import asdict

import pytest
from typer.testing import CliRunner

import fp4moe.plan.cache as cache_mod
import fp4moe.plan.crosscompile as cc_mod
from fp4moe import guard
from fp4moe import target as arch
from fp4moe.cli import _check_workdir, app, cli_terms
from fp4moe.plan.cache import FORMAT, CompileCache
from fp4moe.plan.crosscompile import CompiledKernel, cross_compile
from fp4moe.target.compile_request import CompileRequest

runner = CliRunner()

# ------------------------------------------------------------------------------ plan cache

REQUEST = CompileRequest(kernel="fp4moe.kernels.linear:fp4_linear_kernel", signature={"M": "i32"}, constexprs={},
                         cc=120)
RESULT = CompiledKernel(cc=120, ok=True, shared=49152, registers=128, spill_bytes=0,
                        mma=("mma.sync.aligned.m16n8k64",), ptxas_log="ok", smem_buffers=("2x64x128xi8",),
                        compile_s=1.25, loop_spill_ops=0)


@pytest.fixture
def fake_compiler(monkeypatch):
    """cross_compile's workers replaced by a counter: what a rebuild costs, without a compiler."""
    calls = []

    def run_workers(requests, jobs, timeout_s, progress=None):
        calls.extend(requests)
        return [RESULT for _ in requests]

    monkeypatch.setattr(cc_mod, "_run_workers", run_workers)
    return calls


def _stored(store: CompileCache) -> dict:
    return json.loads(store.path(REQUEST).read_text())


def _resealed(record: dict) -> dict:
    """An entry edited consistently, checksum recomputed: only the schema can catch it."""
    record = dict(record)
    record["checksum"] = cache_mod._checksum(record)
    return record


def _whole() -> dict:
    return {"format": FORMAT, "kernel": REQUEST.kernel, "cc": REQUEST.cc, "result": asdict(RESULT)}


BAD_ENTRIES = {
    "empty array": (b"[]", "expected a JSON object, found an array"),
    "null": (b"null", "expected a JSON object, found null"),
    "a number": (b"3", "expected a JSON object, found an integer"),
    "empty file": (b"", "not JSON (empty file)"),
    "truncated": (None, "not JSON"),
    "not UTF-8": (b'{"format": 4, "kernel": "\xff\xfe"}', "not UTF-8 text: byte"),
    "missing result": (_resealed({k: v for k, v in _whole().items() if k != "result"}), "no 'result' field"),
    "missing result field": (_resealed({**_whole(), "result": {k: v for k, v in asdict(RESULT).items() if k != "ok"}}),
                             "no 'result.ok' field"),
    "wrong field type": (_resealed({**_whole(), "result": {**asdict(RESULT), "shared": "49152"}}),
                         "'result.shared' is a string, expected int or null"),
    "bool for an int": (_resealed({**_whole(), "cc": True}), "'cc' is a boolean, expected an integer"),
    "list of non-strings": (_resealed({**_whole(), "result": {**asdict(RESULT), "mma": [1]}}),
                            "'result.mma' is an array, expected list[str]"),
    "no checksum": ({k: v for k, v in _whole().items()}, "no 'checksum' field"),
    "hand-edited": ("edit", "does not match its checksum"),
    "old format": (_resealed({**_whole(), "format": FORMAT - 1}), f"format {FORMAT - 1}, expected {FORMAT}"),
    "another request's entry": (_resealed({**_whole(), "cc": 90, "result": {**asdict(RESULT), "cc": 90}}),
                                "not the requested"),
}


@pytest.mark.parametrize("case", list(BAD_ENTRIES))
def test_bad_cache_entry_is_rebuilt_with_one_warning_naming_it(case, tmp_path, fake_compiler):
    store = CompileCache(tmp_path)
    (first,) = cross_compile([REQUEST], cache=store)
    assert first == RESULT and len(fake_compiler) == 1
    path = store.path(REQUEST)
    content, why = BAD_ENTRIES[case]
    if content is None:  # a write cut short
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    elif content == "edit":  # the shared memory lowered by hand, checksum left as it was
        path.write_text(json.dumps({**_stored(store), "result": {**asdict(RESULT), "shared": 1024}}))
    elif isinstance(content, dict):
        path.write_text(json.dumps(content))
    else:
        path.write_bytes(content)
    with pytest.warns(RuntimeWarning) as caught:
        (again,) = cross_compile([REQUEST], cache=store)
        (third,) = cross_compile([REQUEST], cache=store)  # rewritten: a hit, no second warning
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert str(path) in messages[0] and why in messages[0] and "compiling again" in messages[0], messages[0]
    assert again == RESULT and third == RESULT
    assert len(fake_compiler) == 2  # recompiled once, then served from the rewritten entry
    assert store.hits == 1 and store.misses == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.get(REQUEST) == RESULT
    assert _stored(store)["checksum"] == cache_mod._checksum(_stored(store))


def test_bad_entry_warns_once_per_file_per_process(tmp_path, fake_compiler):
    store = CompileCache(tmp_path)
    cross_compile([REQUEST], cache=store)
    path = store.path(REQUEST)
    with pytest.warns(RuntimeWarning, match="ignoring corrupt entry"):
        path.write_text("[]")
        assert store.get(REQUEST) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path.write_text("null")  # the same file again: ignored, not reported twice
        assert store.get(REQUEST) is None
    other = CompileRequest(**{**asdict(REQUEST), "cc": 90})
    store.put(other, CompiledKernel(cc=90, ok=False, error="no"))
    store.path(other).write_text("[]")
    with pytest.warns(RuntimeWarning, match=str(store.path(other).name)):  # another file: its own warning
        assert store.get(other) is None


def test_cache_entry_round_trips_and_write_is_atomic(tmp_path, monkeypatch):
    store = CompileCache(tmp_path)
    store.put(REQUEST, RESULT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.get(REQUEST) == RESULT
    record = _stored(store)
    assert record["format"] == FORMAT and len(record["checksum"]) == 64
    # a write that fails half-way leaves the previous entry whole and no temporary file
    def broken_dump(obj, f):
        f.write('{"format": ')
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache_mod.json, "dump", broken_dump)
    with pytest.warns(RuntimeWarning, match="cannot write"):
        store.put(REQUEST, CompiledKernel(cc=120, ok=False, error="x"))
    monkeypatch.undo()
    assert not list(store.path(REQUEST).parent.glob(".tmp-*"))
    assert store.get(REQUEST) == RESULT


def test_plan_command_survives_a_wrong_shape_entry(tmp_path, monkeypatch, fake_compiler):
    """What `fp4moe plan` meets: every entry in its cache replaced by valid JSON of the wrong shape."""
    from fp4moe.plan import cli as plan_cli

    monkeypatch.setenv("FP4MOE_CACHE_DIR", str(tmp_path))
    calls = []

    def plan_model(spec, **kwargs):
        store = CompileCache()
        store.put(REQUEST, RESULT)
        store.path(REQUEST).write_text("[]")
        calls.append(cross_compile([REQUEST], cache=store))
        return []

    monkeypatch.setattr(plan_cli, "plan_model", plan_model)
    with pytest.warns(RuntimeWarning, match="ignoring corrupt entry"):
        result = runner.invoke(app, ["plan", "--arch", "sm120", "--model", "glm-5", "--tokens", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert calls == [[RESULT]]


# ------------------------------------------------------------------------------ guard switch


def test_guard_off_warns_once_per_process(monkeypatch):
    monkeypatch.setattr(guard, "_warned_off", False)
    key = guard.GuardKey("fp4_linear", "test-config", "cpu (Triton interpreter)")
    monkeypatch.setenv("FP4MOE_GUARD", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert guard.mode() == "raise"  # on: nothing said
    monkeypatch.setenv("FP4MOE_GUARD", "0")
    with pytest.warns(RuntimeWarning) as caught:
        assert guard.should_check(key) is False  # off: nothing probed, as before
        assert guard.should_check(key) is False
        assert guard.mode() == "off"
    messages = [str(w.message) for w in caught]
    assert messages == ["fp4moe guard is off (FP4MOE_GUARD=0): kernels run unchecked"]


def test_guard_off_spelt_otherwise_names_the_setting(monkeypatch):
    monkeypatch.setattr(guard, "_warned_off", False)
    monkeypatch.setenv("FP4MOE_GUARD", "off")
    with pytest.warns(RuntimeWarning, match=r"fp4moe guard is off \(FP4MOE_GUARD=off\): kernels run unchecked"):
        assert guard.mode() == "off"


# ------------------------------------------------------------------------------ command line


@pytest.fixture
def no_e2e_run(monkeypatch):
    """demo --e2e must refuse before any work: building a model here fails the test."""
    pytest.importorskip("transformers")
    from fp4moe.integrations.transformers import e2e

    def run_e2e(*args, **kwargs):
        raise AssertionError("demo --e2e started work on a --workdir it should have refused")

    monkeypatch.setattr(e2e, "run_e2e", run_e2e)


def _error_text(result) -> str:
    return " ".join(result.output.replace("│", " ").split())


def test_demo_workdir_that_is_a_file_is_a_clear_error(tmp_path, no_e2e_run):
    path = tmp_path / "notes.txt"
    path.write_text("x")
    result = runner.invoke(app, ["demo", "--e2e", "--workdir", str(path)])
    text = _error_text(result)
    assert result.exit_code == 2, text
    assert "Invalid value for --workdir" in text and "exists and is not a folder" in text, text
    assert "Traceback" not in result.output
    under = runner.invoke(app, ["demo", "--e2e", "--workdir", str(path / "sub")])
    assert under.exit_code == 2 and "is not a folder" in _error_text(under), _error_text(under)


@pytest.mark.parametrize("marker", ["config.json", "model.safetensors"])
def test_demo_workdir_that_is_a_model_folder_is_refused_untouched(tmp_path, marker, no_e2e_run):
    (tmp_path / marker).write_text("{}")
    result = runner.invoke(app, ["demo", "--e2e", "--workdir", str(tmp_path)])
    text = _error_text(result)
    assert result.exit_code == 2, text
    assert "Invalid value for --workdir" in text and "is a model folder" in text and marker in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == [marker]  # no bf16/ or modelopt/ written


def test_demo_workdir_checks_accept_new_and_reused_folders(tmp_path):
    import typer

    _check_workdir(str(tmp_path / "new" / "deeper"), "modelopt")  # created later
    _check_workdir(str(tmp_path), "modelopt")  # empty
    (tmp_path / "bf16").mkdir()
    (tmp_path / "bf16" / "config.json").write_text("{}")
    (tmp_path / "modelopt").mkdir()
    (tmp_path / "modelopt" / "config.json").write_text("{}")
    _check_workdir(str(tmp_path), "modelopt")  # a previous run's folder: its checkpoint is replaced
    (tmp_path / "compressed-tensors").mkdir()
    (tmp_path / "compressed-tensors" / "mine.txt").write_text("keep")
    with pytest.raises(typer.BadParameter, match="no config.json"):
        _check_workdir(str(tmp_path), "compressed-tensors")
    with pytest.raises(typer.BadParameter, match="empty path"):
        _check_workdir("", "modelopt")


def test_cli_reports_library_errors_in_its_own_terms():
    for args in (["info", "--gpu", ""], ["info", "--gpu", "voodoo 5"], ["info", "--gpu", "h100 pcie"],
                 ["plan", "--gpu", "", "--model", "glm-5", "--no-compile"],
                 ["plan", "--arch", "sm42", "--model", "glm-5", "--no-compile"],
                 ["plan", "--arch", "sm90", "--gpu", "h100", "--model", "glm-5", "--no-compile"],
                 ["plan", "--model", "glm-5", "--no-compile"]):
        result = runner.invoke(app, args)
        text = _error_text(result)
        assert result.exit_code == 2, (args, text)
        for python_term in ("find_gpu", "get_arch", "resolve_target", "argument '", "gpu=", "arch=", "(12, 0)"):
            assert python_term not in text, (args, python_term, text)
        assert "--gpu" in text or "--arch" in text, (args, text)
    assert "expected a GPU name, got ''" in _error_text(runner.invoke(app, ["info", "--gpu", ""]))
    assert "fp4moe plan --arch sm90" in _error_text(runner.invoke(app, ["info", "--gpu", "h100 pcie"]))
    both = _error_text(runner.invoke(app, ["plan", "--arch", "sm90", "--gpu", "h100", "--model", "glm-5"]))
    assert "give exactly one of --gpu and --arch" in both
    # the library keeps its own terms for library users
    with pytest.raises(ValueError, match="find_gpu: argument 'text' must name a GPU"):
        arch.find_gpu("", strict=True)


def test_cli_terms_rewrites_python_arguments():
    assert cli_terms("out: exists and is not empty; pass overwrite=True (--overwrite) to replace it") == \
        "out: exists and is not empty; pass --overwrite to replace it"
    assert cli_terms("pass max_shard_size=True to split") == "pass --max-shard-size to split"
    assert cli_terms("nothing Python-level here") == "nothing Python-level here"
