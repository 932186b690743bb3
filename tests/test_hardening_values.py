"""Silent wrong numbers, refused where they enter: FP4 weights whose scale values the kernels would
decode otherwise than ``dequantize`` (NaN or negative block scales, NaN/Inf/zero/negative global
scales, parts on different devices), checkpoints whose plain tensors have the wrong kind of dtype,
and MoE blocks with no experts or parts on different devices. Each test injects the fault."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import fp4moe.ops._runtime as runtime
from fp4moe.models import Routing
from fp4moe.nn import FP4Linear, FP4MoE, GatedMLP
from fp4moe.ops._runtime import check_fp4_values
from fp4moe.quantize import FP4Tensor, quantize, quantize_stacked

E, H, I = 4, 64, 32
ROUTING = Routing("softmax", top_k=2)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _with_scale_code(w: FP4Tensor, index: tuple[int, ...], code: int) -> FP4Tensor:
    bits = w.scales.view(torch.uint8).clone()
    bits[index] = code
    return replace(w, scales=bits.view(w.scales.dtype))


def _experts():
    g = _gen(1)
    return (torch.randn(E, H, generator=g).bfloat16(), quantize_stacked(torch.randn(E, 2 * I, H, generator=g)),
            quantize_stacked(torch.randn(E, H, I, generator=g)))


# ---------------------------------------------------------------------------------------------
# block and global scale values


@pytest.mark.parametrize("code, found", [(0x7F, r"a NaN code \(0x7f\)"), (0xFF, r"a NaN code \(0xff\)"),
                                         (0xB8, r"negative \(0xb8 = -1\.0\)")])
def test_from_fp4_refuses_bad_nvfp4_block_scales(code, found):
    w = _with_scale_code(quantize(torch.randn(32, 64, generator=_gen())), (5, 2), code)
    with pytest.raises(ValueError, match=rf"^weight: block scale at \[5, 2\] is {found}; expected "):
        FP4Linear.from_fp4(w)


def test_negative_zero_block_scale_is_zero_and_allowed():
    w = _with_scale_code(quantize(torch.randn(32, 64, generator=_gen())), (0, 0), 0x80)
    FP4Linear.from_fp4(w)  # -0 decodes to 0 in the kernels and the reference alike


def test_error_counts_every_bad_scale():
    w = quantize(torch.randn(32, 64, generator=_gen()))
    w = _with_scale_code(_with_scale_code(w, (7, 3), 0x7F), (9, 0), 0xFF)
    with pytest.raises(ValueError, match=r"block scale at \[7, 3\] is a NaN code \(0x7f\).*\(2 bad block scales"):
        FP4Linear.from_fp4(w)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -0.5])
def test_from_fp4_refuses_bad_global_scale(value):
    w = quantize(torch.randn(32, 64, generator=_gen()))
    bad = replace(w, global_scale=torch.tensor(value))
    with pytest.raises(ValueError, match=rf"^weight: global scale at \[\] is {value!r}; expected a positive finite"):
        FP4Linear.from_fp4(bad)


def test_from_fp4_refuses_mxfp4_nan_scale():
    w = _with_scale_code(quantize(torch.randn(32, 64, generator=_gen()), "mxfp4"), (1, 1), 0xFF)
    with pytest.raises(ValueError, match=r"^weight: block scale at \[1, 1\] is the E8M0 NaN code \(0xff\)"):
        FP4Linear.from_fp4(w)


def test_moe_refuses_bad_expert_scales():
    router, w13, w2 = _experts()
    with pytest.raises(ValueError, match=r"^w13: block scale at \[2, 5, 1\] is a NaN code \(0x7f\)"):
        FP4MoE(router, _with_scale_code(w13, (2, 5, 1), 0x7F), w2, ROUTING)
    with pytest.raises(ValueError, match=r"^w2: block scale at \[3, 0, 1\] is negative"):
        FP4MoE(router, w13, _with_scale_code(w2, (3, 0, 1), 0xC0), ROUTING)
    gs = w2.global_scale.clone()
    gs[1, 0] = 0.0
    with pytest.raises(ValueError, match=r"^w2: global scale at \[1, 0\] is 0\.0; expected a positive finite"):
        FP4MoE(router, w13, replace(w2, global_scale=gs), ROUTING)
    gs = w13.global_scale.clone()
    gs[3, 0] = float("inf")
    with pytest.raises(ValueError, match=r"^w13: global scale at \[3, 0\] is inf"):
        FP4MoE(router, replace(w13, global_scale=gs), w2, ROUTING)
    FP4MoE(router, w13, w2, ROUTING)  # the untouched weights are fine


def test_moe_shared_expert_from_fp4_is_checked_too():
    router, w13, w2 = _experts()
    bad = _with_scale_code(quantize(torch.randn(2 * I, H, generator=_gen())), (0, 0), 0x7F)
    with pytest.raises(ValueError, match=r"^weight: block scale at \[0, 0\] is a NaN code"):
        FP4MoE(router, w13, w2, ROUTING, shared_gate_up=FP4Linear.from_fp4(bad),
               shared_down=FP4Linear.from_fp4(quantize(torch.randn(H, I))))


def test_load_state_dict_refuses_bad_values_before_copying():
    layer = FP4Linear.from_fp4(quantize(torch.randn(32, 64, generator=_gen())))
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    bad = _with_scale_code(quantize(torch.randn(32, 64, generator=_gen(5))), (4, 1), 0x7F)
    sd = FP4Linear.from_fp4(quantize(torch.randn(32, 64, generator=_gen(5)))).state_dict()
    sd["weight_scale"] = bad.scales
    outer = torch.nn.Sequential(layer)
    with pytest.raises(ValueError, match=r"^0\.weight: block scale at \[4, 1\] is a NaN code \(0x7f\)"):
        outer.load_state_dict({f"0.{k}": v for k, v in sd.items()})
    sd["weight_scale"] = quantize(torch.randn(32, 64, generator=_gen(5))).scales
    sd["weight_scale_2"] = torch.tensor(float("nan"))
    with pytest.raises(ValueError, match=r"^weight: global scale at \[\] is nan"):
        layer.load_state_dict(sd)
    for k, v in layer.state_dict().items():  # nothing was copied
        assert torch.equal(v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v,
                           before[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn else before[k]), k
    sd["weight_scale_2"] = torch.tensor(0.5)
    layer.load_state_dict(sd)  # good values load
    assert float(layer.weight_scale_2) == 0.5


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quantizer_outputs_are_always_valid(fmt):
    g = _gen(2)
    for x in (torch.randn(16, 64, generator=g), torch.zeros(16, 64), torch.randn(16, 64, generator=g) * 1e-30,
              torch.randn(16, 64, generator=g) * 3e4, -torch.rand(16, 64, generator=g)):
        check_fp4_values(quantize(x, fmt), "x")
    check_fp4_values(quantize_stacked(torch.randn(3, 16, 64, generator=g), fmt), "x")
    if fmt == "nvfp4":  # a given global scale that saturates the block scales at 448
        check_fp4_values(quantize(torch.randn(16, 64, generator=g), fmt, global_scale=1e-6), "x")


def test_check_runs_at_construction_not_per_call(monkeypatch):
    calls = []
    real = runtime.check_fp4_values
    monkeypatch.setattr(runtime, "check_fp4_values", lambda w, name="w": (calls.append(name), real(w, name)))
    router, w13, w2 = _experts()
    block = FP4MoE(router, w13, w2, ROUTING)
    layer = FP4Linear.from_fp4(quantize(torch.randn(32, 64, generator=_gen())))
    assert calls == ["w13", "w2", "weight"]
    if torch.cuda.is_available():  # the kernels pack (and check) a weight once, on its first call
        block, layer = block.cuda(), layer.cuda()
    x = torch.randn(3, H, generator=_gen()).bfloat16().to(w13.device if not torch.cuda.is_available() else "cuda")
    for _ in range(2):
        block(x)
        layer(x)
    n = len(calls)
    block(x)
    layer(x)
    assert len(calls) == n


# ---------------------------------------------------------------------------------------------
# devices and expert count


def test_fp4_tensor_parts_on_different_devices_are_refused():
    w = quantize(torch.randn(32, 64, generator=_gen()))
    with pytest.raises(ValueError, match=r"^weight: expected data, block scales and global scale on one device, "
                                         r"found data on cpu, scales on meta, global_scale on cpu"):
        FP4Linear.from_fp4(replace(w, scales=w.scales.to("meta")))


def test_moe_parts_on_different_devices_are_refused():
    router, w13, w2 = _experts()
    with pytest.raises(ValueError, match=r"^router_weight: expected device cpu \(that of w13\), got meta"):
        FP4MoE(router.to("meta"), w13, w2, ROUTING)
    with pytest.raises(ValueError, match=r"^router_bias: expected device cpu \(that of w13\), got meta"):
        FP4MoE(router, w13, w2, ROUTING, router_bias=torch.zeros(E, device="meta"))
    with pytest.raises(ValueError, match=r"^w2: expected device cpu, got meta"):
        FP4MoE(router, w13, w2.to("meta"), ROUTING)
    with pytest.raises(ValueError, match=r"^w13: expected data, block scales and global scale on one device"):
        FP4MoE(router, replace(w13, global_scale=w13.global_scale.to("meta")), w2, ROUTING)
    lin = lambda n, k: torch.nn.Linear(k, n, bias=False, device="meta")  # noqa: E731
    with pytest.raises(ValueError, match=r"^shared_expert\.gate_proj\.weight: expected device cpu \(that of w13\), "
                                         r"got meta"):
        FP4MoE(router, w13, w2, ROUTING, shared_expert=GatedMLP(lin(I, H), lin(I, H), lin(H, I)))
    with pytest.raises(ValueError, match=r"^router_weight: expected device cpu \(that of w13\), got meta"):
        FP4MoE.from_bf16(router.to("meta"), torch.randn(E, 2 * I, H), torch.randn(E, H, I), ROUTING)


def test_zero_experts_are_refused_clearly():
    with pytest.raises(ValueError, match=r"^w13: expected at least one matrix \(E >= 1\), got shape \(0, 64, 64\)"):
        FP4MoE.from_bf16(torch.zeros(0, H).bfloat16(), torch.zeros(0, 2 * I, H), torch.zeros(0, H, I), ROUTING)
    with pytest.raises(ValueError, match=r"expected at least one matrix \(E >= 1\)"):
        quantize_stacked(torch.zeros(0, 16, 64))
    _, w13, w2 = _experts()
    empty13 = FP4Tensor(w13.data[:0], w13.scales[:0], w13.global_scale[:0], (0, 2 * I, H), w13.fmt)
    empty2 = FP4Tensor(w2.data[:0], w2.scales[:0], w2.global_scale[:0], (0, H, I), w2.fmt)
    with pytest.raises(ValueError, match=r"^w13: expected at least one expert, got \(0, 64, 64\) \(E = 0\)"):
        FP4MoE(torch.zeros(0, H).bfloat16(), empty13, empty2, ROUTING)


# ---------------------------------------------------------------------------------------------
# the transformers loader: plain tensors of the wrong kind of dtype

transformers = pytest.importorskip("transformers")

from fp4moe.checkpoints import CheckpointError  # noqa: E402
from fp4moe.checkpoints.reader import Checkpoint  # noqa: E402
from fp4moe.integrations.transformers import load_fp4_model  # noqa: E402
from checkpoint_cases import copy_with  # noqa: E402


def _no_reads(monkeypatch):
    """Fail the test if the loader reads a tensor's data (the check must come from the headers)."""
    def refuse(self, name):
        raise AssertionError(f"read {name} before refusing the checkpoint")

    monkeypatch.setattr(Checkpoint, "tensor", refuse)


@pytest.mark.parametrize("key, bad, found", [
    ("model.embed_tokens.weight", torch.zeros(128, 64, dtype=torch.int64), r"I64\[128, 64\]"),
    ("model.norm.weight", torch.ones(64, dtype=torch.int32), r"I32\[64\]"),
    ("model.layers.0.input_layernorm.weight", torch.ones(64, dtype=torch.bool), r"BOOL\[64\]"),
    ("model.layers.1.mlp.gate.weight", torch.zeros(8, 64, dtype=torch.int32), r"I32\[8, 64\]"),  # the router
])
def test_plain_tensor_of_the_wrong_dtype_kind_is_named(qwen_checkpoint, tmp_path, monkeypatch, key, bad, found):
    ckpt = copy_with(qwen_checkpoint / "q", tmp_path / "bad", add={key: bad})
    _no_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"tensor '{key}': expected a floating-point tensor \(the model's "
                                              rf"torch\.bfloat16\), found {found}"):
        load_fp4_model(ckpt, device="cpu")


def test_plain_tensor_of_another_float_dtype_is_cast(qwen_checkpoint, tmp_path):
    from safetensors.torch import load_file

    norm = load_file(qwen_checkpoint / "q" / "model.safetensors")["model.norm.weight"]
    ckpt = copy_with(qwen_checkpoint / "q", tmp_path / "f32", add={"model.norm.weight": norm.float() * 1.5})
    model = load_fp4_model(ckpt, device="cpu")
    assert model.model.norm.weight.dtype == torch.bfloat16
    assert torch.equal(model.model.norm.weight, (norm.float() * 1.5).bfloat16())


def test_moe_load_state_dict_checks_the_expert_values():
    """A state dict with a NaN-coded expert block scale is refused before anything is copied."""
    g = torch.Generator().manual_seed(0)
    E, H, I = 4, 64, 32
    block = FP4MoE.from_bf16(torch.randn(E, H, generator=g).bfloat16(), torch.randn(E, 2 * I, H, generator=g),
                             torch.randn(E, H, I, generator=g), Routing("softmax", top_k=2))
    state = {k: v.clone() for k, v in block.state_dict().items()}
    state["w2_weight_scale"].view(torch.uint8)[1, 2, 0] = 0x7F
    before = block.w2_weight_scale.clone()
    with pytest.raises(ValueError, match=r"w2_weight: block scale at \[1, 2, 0\] is a NaN code"):
        block.load_state_dict(state)
    assert torch.equal(block.w2_weight_scale.view(torch.uint8), before.view(torch.uint8))
    block.load_state_dict({k: v.clone() for k, v in block.state_dict().items()})  # a good one loads
