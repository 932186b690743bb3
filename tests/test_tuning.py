"""fp4moe.tuning: the ops' tuning records and their one override API."""

import threading

import pytest

from fp4moe.tuning import (DispatchTuning, LinearTuning, MoETuning, QuantizeTuning, Tuning, current_tuning,
                           set_tuning, tuning)


def test_defaults_are_hashable_and_equal():
    assert Tuning() == Tuning() and hash(Tuning()) == hash(Tuning())
    assert current_tuning() == Tuning()
    assert Tuning().moe.fused_swiglu is True and Tuning().dispatch.place_max_blocks == 64


@pytest.mark.parametrize("cls,field,bad", [
    (MoETuning, "word_order", "zigzag"),
    (MoETuning, "few_pairs", (16, 8)),  # the second bound below the first
    (MoETuning, "fused_swiglu", 1),  # a bool, not an int
    (MoETuning, "pair_rows", "fp16"),
    (LinearTuning, "pack_rows", 0),
    (LinearTuning, "x_ring_prefetch_steps", 9),
    (DispatchTuning, "tiles_per_program", 100),  # not a power of two
    (QuantizeTuning, "max_absmax_partials", -1),
])
def test_validation_names_the_field(cls, field, bad):
    with pytest.raises(ValueError, match=f"{cls.__name__}.{field}"):
        cls(**{field: bad})


def test_override_nested_and_whole_records():
    before = current_tuning()
    with tuning(moe=dict(fused_swiglu=False)) as t:
        assert current_tuning() is t and t.moe.fused_swiglu is False
        assert t.linear == before.linear and t.moe.pair_rows == before.moe.pair_rows
        with tuning(moe=dict(pair_rows="fp32")):  # nested blocks change the record in force
            assert current_tuning().moe.fused_swiglu is False and current_tuning().moe.pair_rows == "fp32"
        assert current_tuning() is t
    assert current_tuning() is before
    with tuning(dispatch=DispatchTuning(place_max_blocks=0)):
        assert current_tuning().dispatch.place_max_blocks == 0
    with tuning(Tuning(quantize=QuantizeTuning(absmax_row_steps=4))):
        assert current_tuning().quantize.absmax_row_steps == 4 and current_tuning().moe == MoETuning()
    assert current_tuning() is before


def test_override_errors():
    with pytest.raises(TypeError, match="no family 'mo'"):
        with tuning(mo=dict(fused_swiglu=False)):
            pass
    with pytest.raises(TypeError, match="MoETuning has no field 'fused'"):
        with tuning(moe=dict(fused=False)):
            pass
    with pytest.raises(TypeError, match="expected a Tuning"):
        set_tuning("fast")
    with pytest.raises(TypeError, match="Tuning.moe: expected a MoETuning"):
        Tuning(moe=LinearTuning())
    assert current_tuning() == Tuning()


def test_set_tuning_is_process_wide():
    old = set_tuning(linear=dict(split_pdl=False))
    try:
        seen = []
        t = threading.Thread(target=lambda: seen.append(current_tuning().linear.split_pdl))
        t.start()
        t.join()
        assert seen == [False]
    finally:
        assert set_tuning(old).linear.split_pdl is False
    assert current_tuning() is old
