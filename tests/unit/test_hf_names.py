"""Expert slices (GPT-OSS's stacked experts, one megatron expert at a time) and their stacking."""

from __future__ import annotations

import pytest
import torch

from moe_rl.common.hf_names import ExpertStacker, expert_slice, split_expert_slice, stack_expert_slices


def test_slices_stack_back_in_expert_order_whatever_order_they_come_in():
    full = torch.randn(4, 3, 5)
    order = torch.randperm(4).tolist()
    items = [(expert_slice("m.experts.down_proj", e, 4), full[e]) for e in order] + [("m.norm.weight", full[0, 0])]
    out = stack_expert_slices(items)
    assert sorted(out) == ["m.experts.down_proj", "m.norm.weight"]
    assert torch.equal(out["m.experts.down_proj"], full)
    assert split_expert_slice("m.experts.down_proj@3/4") == ("m.experts.down_proj", 3, 4)
    assert split_expert_slice("m.layers.0.weight") is None


def test_a_stack_returns_when_whole_and_a_missing_slice_is_named():
    s = ExpertStacker()
    assert s.add(expert_slice("a", 0, 2), torch.zeros(2)) == []
    assert s.add("plain", torch.ones(1))[0][0] == "plain"
    assert s.add(expert_slice("b", 0, 2), torch.zeros(2)) == []
    [(name, t)] = s.add(expert_slice("a", 1, 2), torch.ones(2))
    assert name == "a" and torch.equal(t, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    with pytest.raises(ValueError, match=r"'b': \[1\]"):
        s.finish()
