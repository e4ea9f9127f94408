"""The target's fp32 products on oneDNN's prepacked weights: the same products as F.linear."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from decoding.packed import PackedLinear, pack_linears, packs


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_equals_f_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(2, rows, 96)  # [B, T, K]
    out = PackedLinear(linear)(x)
    assert out.shape == (2, rows, 200)
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_packed_weight_reads_back_dense():
    linear = nn.Linear(16, 8)
    assert torch.equal(PackedLinear(linear).weight, linear.weight.detach())


def test_pack_linears_keeps_a_tiny_target_s_logits(tiny_target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    ids = torch.randint(3, 1000, (2, 7))
    with torch.no_grad():
        before = model(ids).logits
        count = sum(type(m) is nn.Linear for m in model.modules())
        assert count > 0 and pack_linears(model) == count
        assert not any(type(m) is nn.Linear for m in model.modules())
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-4)


def test_pack_linears_leaves_bf16_alone():
    model = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
    assert not packs(model) and pack_linears(model) == 0
    assert type(model[0]) is nn.Linear


def test_tuned_linear_takes_the_product_its_table_names_for_the_rows(monkeypatch):
    from decoding.packed import TUNED_ROWS, TunedLinear

    torch.manual_seed(0)
    linear = nn.Linear(32, 48)
    packed_for = [False] + [rows % 2 == 1 for rows in range(1, TUNED_ROWS + 1)]
    tuned = TunedLinear(linear, packed_for)
    used = []
    monkeypatch.setattr(PackedLinear, "forward",
                        lambda self, x: used.append("packed") or F.linear(x, linear.weight,
                                                                           linear.bias))
    for rows in (1, 2, 3, TUNED_ROWS + 5):
        x = torch.randn(1, rows, 32)
        torch.testing.assert_close(tuned(x), F.linear(x, linear.weight, linear.bias))
    # rows 1 and 3 are odd (packed), 2 even, beyond the table the choice at TUNED_ROWS (even)
    assert used == ["packed", "packed"]
    assert tuned.weight is linear.weight


def test_tune_linears_times_each_shape_once_and_keeps_the_logits(tiny_target, monkeypatch):
    from transformers import AutoModelForCausalLM

    import decoding.packed as packed
    from decoding.packed import TUNED_ROWS, TunedLinear, describe_choices, tune_linears

    timed = []
    real = packed.faster_kernels
    monkeypatch.setattr(packed, "faster_kernels",
                        lambda linear: timed.append(tuple(linear.weight.shape)) or real(linear, 1))
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    ids = torch.randint(3, 1000, (1, 7))
    with torch.no_grad():
        before = model(ids).logits
        choices = tune_linears(model)
        assert sorted(timed) == sorted(set(timed)) and set(choices) == {
            (o, i) for o, i in timed}
        assert all(len(c) == TUNED_ROWS + 1 for c in choices.values())
        assert not any(type(m) is nn.Linear and not isinstance(p, TunedLinear)
                       for p in model.modules() for m in p.children())
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-4)
    assert all(f"{o}x{i}: " in describe_choices(choices) for o, i in choices)


def test_describe_choices_names_runs_of_rows():
    from decoding.packed import TUNED_ROWS, describe_choices

    packed_for = [False, True, True] + [False] * (TUNED_ROWS - 2)
    assert describe_choices({(8, 4): packed_for}) == (
        f"8x4: packed at 1-2, torch at 3-{TUNED_ROWS}")


def test_known_choices_are_taken_without_timing(monkeypatch):
    import decoding.packed as packed
    from decoding.packed import TUNED_ROWS, tune_linears

    monkeypatch.setattr(packed, "faster_kernels", lambda linear: [False] * (TUNED_ROWS + 1))
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    known = {(16, 8): [False] + [True] * TUNED_ROWS}  # the same CPU's earlier choice
    choices = tune_linears(model, known)
    assert choices[(16, 8)] == known[(16, 8)] and choices[(8, 16)] == [False] * (TUNED_ROWS + 1)
    assert model[0].packed_for == known[(16, 8)]
