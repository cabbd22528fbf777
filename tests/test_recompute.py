"""The regions recomputed in the backward (modeling_dsv41/recompute.py: mHC's mixes, RMSNorm, the clamped SwiGLU,
Engram's gate): the same bits as autograd of the regions themselves, forward and gradients, for less saved memory."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_training_model

from modeling_dsv41 import engram, hyper_connections, moe, norms
from modeling_dsv41.numerics import reference_numerics
from modeling_dsv41.recompute import recomputed

REGION_MODULES = (engram, hyper_connections, moe, norms)


def plain_call(region, *inputs):
    return region(*inputs)


def training_step(dtype, numerics, experts="eager", monkeypatch=None):
    """Logits, every parameter's gradient and the bytes autograd saved (each storage once) of one step of the tiny
    model (Engram, window-only, ratio-2 and ratio-1 layers). With ``monkeypatch``, the bytes leave out what mHC's
    Sinkhorn function keeps (its normalisers: not a recomputed region, the same in either run)."""
    model = tiny_training_model(6).to(dtype).train()
    model.set_experts_implementation(experts)
    ids = torch.randint(3, 500, (2, 70), generator=torch.Generator().manual_seed(0))
    storages, sinkhorn_storages = {}, set()
    if monkeypatch is not None:
        sinkhorn_forward = hyper_connections._Sinkhorn.forward

        def tagged_forward(ctx, *args):
            out = sinkhorn_forward(ctx, *args)
            sinkhorn_storages.update(t.untyped_storage().data_ptr() for t in ctx.to_save)  # packed after forward
            return out

        monkeypatch.setattr(hyper_connections._Sinkhorn, "forward", staticmethod(tagged_forward))

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in sinkhorn_storages:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), reference_numerics(numerics):
        out = model(ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads, sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numerics", [False, True], ids=["plain", "reference numerics"])
def test_recomputed_regions_give_autograds_bits_for_less_memory(monkeypatch, dtype, numerics):
    """Bit for bit: the regions' backward differentiates the same ops on the same values, in the numerics of the
    forward (the engine runs a backward without the forward's modes; reference numerics is re-entered)."""
    logits, grads, saved = training_step(dtype, numerics, monkeypatch=monkeypatch)
    for module in REGION_MODULES:
        monkeypatch.setattr(module, "recomputed", plain_call)
    logits_before, grads_before, saved_before = training_step(dtype, numerics, monkeypatch=monkeypatch)
    assert torch.equal(logits, logits_before)
    assert grads.keys() == grads_before.keys()
    for name, grad in grads_before.items():
        assert torch.equal(grads[name], grad), name
    # what the regions avoid keeping, mostly fp32 copies of their inputs: 17% of this fp32 tiny model's saved bytes
    # (25-42% in bf16 or reference numerics); a region saving its inputs' whole graph again would be about 0%
    assert saved < 0.85 * saved_before, (saved, saved_before)


def test_the_grouped_expert_kernels_recompute_their_swiglu_too(monkeypatch):
    """``experts_implementation="batched_mm"`` goes through the experts' ``_apply_gate``: the same bits either way.
    One thread: with two, the gradient of the gathered expert weights (an index_add) sums in a run-dependent order."""
    torch.set_num_threads(1)
    logits, grads, _ = training_step(torch.float32, False, "batched_mm")
    monkeypatch.setattr(moe, "recomputed", plain_call)
    logits_before, grads_before, _ = training_step(torch.float32, False, "batched_mm")
    assert torch.equal(logits, logits_before)
    for name, grad in grads_before.items():
        assert torch.equal(grads[name], grad), name


def test_a_region_runs_plainly_without_a_gradient_to_track():
    """No graph, no saved inputs: in inference (or on inputs that need no gradient) the region is a plain call."""
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert recomputed(torch.exp, x.requires_grad_()).grad_fn is None
    assert recomputed(torch.exp, torch.randn(3)).grad_fn is None
    a, b = torch.randn(3, requires_grad=True), torch.randn(3)
    product, total = recomputed(lambda a, b: (a * b, a + b), a, b)
    assert product.grad_fn is not None and total.grad_fn is not None
    total.sum().backward()  # one output's gradient only
    assert torch.equal(a.grad, torch.ones(3))
