"""No host synchronisation in a training step (forward and backward) or a decode step on an accelerator, where each
value read back (``.item()``, ``.tolist()``, ``nonzero``, a data-dependent shape) stalls the device until every
queued kernel has run. The models run on the meta device, which holds shapes but no values: every branch taken is
the one for a device other than the CPU, and benchmarks/op_counts.py's counter records each op that reads a value
back (``.tolist()`` and copies to the host raise there outright)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.op_counts import StepCounter
from modeling_dsv41.generation.cache import DeepseekV41StaticCache
from modeling_dsv41.moe import grouped_experts_forward, routed_experts_forward
from modeling_dsv41.validation import check_on_device
from tests.tiny_models import tiny_model, tiny_training_model


def read_backs(step) -> dict[str, int]:
    with StepCounter() as counter:
        step()
    return dict(counter.count.syncs)


def test_a_training_step_reads_no_value_back():
    model = tiny_training_model(3).to("meta", torch.bfloat16)
    ids = torch.zeros(2, 24, dtype=torch.long, device="meta")  # 48 tokens × top-2 > 4 experts: the grouped path

    def step():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()

    assert read_backs(step) == {}
    assert model.model.layers[0].ffn.experts.gate_up_proj.grad is not None


@torch.no_grad()
def test_a_decode_step_reads_no_value_back():
    model = tiny_model().to("meta", torch.bfloat16)  # Engram and the ViT's model (text-only inputs here)
    ids = torch.zeros(2, 13, dtype=torch.long, device="meta")
    mask = torch.ones_like(ids)
    prefill = model(input_ids=ids[:, :10], attention_mask=mask[:, :10], use_cache=True)
    cache = prefill.cache
    model(input_ids=ids[:, 10:11], attention_mask=mask[:, :11], cache=cache)

    def step():
        for t in (11, 12):  # the second steps after a prefill: one of them completes a compressed group
            model(input_ids=ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache)

    assert read_backs(step) == {}


@torch.no_grad()
def test_a_static_cache_decode_step_reads_no_value_back():
    """The static cache's column count, which its overflow check and ``generate`` read, is kept on the host too."""
    model = tiny_model().to("meta", torch.bfloat16)
    ids = torch.zeros(2, 13, dtype=torch.long, device="meta")
    mask = torch.ones_like(ids)
    cache = DeepseekV41StaticCache(model.config, max_cache_len=16)
    model(input_ids=ids[:, :10], attention_mask=mask[:, :10], cache=cache)
    model(input_ids=ids[:, 10:11], attention_mask=mask[:, :11], cache=cache)

    def step():
        for t in (11, 12):
            model(input_ids=ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache)
        assert cache.get_seq_length() == 13

    assert read_backs(step) == {}


def test_a_device_side_check_carries_its_message():
    """``check_on_device`` asserts without reading back; the CPU kernel of the same assertion raises at once."""
    check_on_device(torch.tensor(True), "never shown")
    with pytest.raises(RuntimeError, match="input_ids hold"):
        check_on_device(torch.tensor(False), "input_ids hold token ids outside [0, 8)")


@pytest.mark.parametrize("off_rank_slots", [False, True], ids=["all experts local", "expert-parallel off-rank slots"])
def test_the_grouped_experts_compute_the_loop(off_rank_slots):
    """The grouped products (the experts on an accelerator in bf16, and compiled) against the reference's loop over
    the experts with tokens, in fp32: outputs and the gradients of inputs, weights and routing weights. Off-rank
    slots (id = the local expert count, weight 0) add nothing in either."""
    torch.manual_seed(0)
    num_tokens, top_k, experts, dim, inter = 40, 3, 5, 16, 8
    x = torch.randn(num_tokens, dim, requires_grad=True)
    index = torch.stack([torch.randperm(experts)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k)
    if off_rank_slots:
        off = torch.rand(num_tokens, top_k) < 0.3
        index, weights = index.masked_fill(off, experts), weights.masked_fill(off, 0)
    weights.requires_grad_(True)
    gate_up = (torch.randn(experts, 2 * inter, dim) / dim**0.5).requires_grad_(True)
    down = (torch.randn(experts, dim, inter) / inter**0.5).requires_grad_(True)
    inputs = (x, weights, gate_up, down)

    grouped = grouped_experts_forward(x, index, weights, gate_up, down, swiglu_limit=7.0)
    gate_ups, downs = gate_up.unbind(0), down.unbind(0)
    loop = routed_experts_forward(x, index, weights, experts, 7.0, lambda e: (gate_ups[e], downs[e]))
    # fp32 GEMMs of different shapes (one grouped product vs one per expert) sum in different orders
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)
    probe = torch.randn_like(loop)
    grads_grouped = torch.autograd.grad((grouped * probe).sum(), inputs)
    grads_loop = torch.autograd.grad((loop * probe).sum(), inputs)
    for name, a, b in zip(("input", "routing weights", "gate_up_proj", "down_proj"), grads_grouped, grads_loop):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
