"""Expert-parallel training on the 2-D mesh (2 EP × 2 data-parallel ranks: 4 gloo processes on CPU, spawned from
pytest, bounded in time): :func:`shard_model` with ``expert_parallel_size``, the mixed optimizer and router balancing,
against one process.

Models are the tiny preset cut to 4 decoder layers (4 routed experts, top 2: each EP rank holds 2, each rank 1),
QDQ emulation off, gradient checkpointing on. Every step takes 4 micro-batches, one per rank, each of a text row and
a row with an image (real pixels through the ViT). One process runs the same micro-batches and sums their gradients
in the order the mesh does, EP group by EP group: (g0 + g1) + (g2 + g3) (see modeling_dsv41/training/expert_parallel.py;
summed in another order the gradients differ in their last bits, and so would the parameters).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_processes import spawn
from tiny_models import tiny_training_model

from modeling_dsv41.numerics import reference_numerics
from modeling_dsv41.optim import MixedOptimizer, assign_kinds, build_param_groups, freeze_default_parameters
from modeling_dsv41.training.router_balancing import RouterBiasBalancer

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")

WORLD, EP_SIZE = 4, 2
EP_GROUPS = ((0, 1), (2, 3))  # the ranks of each EP group (ep is the inner mesh dimension)
STEPS = 3
SEQ = 16
LR = 1e-2
SPEED = 0.25  # a power of two: biases stay exact in fp32
IMAGE_SPAN = [0, 1, 1, 2, 1, 1, 2, 3]  # a 6×6-patch image: start, 2 rows of (2 tokens + newline), end
IMAGE_TOKEN_ID = 510


def tiny_model(seed: int = 0):
    model = tiny_training_model(num_hidden_layers=4, seed=seed)
    freeze_default_parameters(model)
    model.gradient_checkpointing_enable()
    return model


def micro_batch(seed: int) -> dict[str, torch.Tensor]:
    """A text row and a row with an image at position 3 (its positions unlabelled): every micro-batch has as many
    label tokens as the others, so the mean of their losses is the loss of the whole step's batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (2, SEQ), generator=g)
    types = torch.full((2, SEQ), -1)
    types[1, 3 : 3 + len(IMAGE_SPAN)] = torch.tensor(IMAGE_SPAN)
    ids = ids.masked_fill(types != -1, IMAGE_TOKEN_ID)
    return {
        "input_ids": ids, "labels": ids.masked_fill(types != -1, -100), "attention_mask": torch.ones_like(ids),
        "image_token_types": types, "pixel_values": torch.rand(36, 3, 14, 14, generator=g) * 2 - 1,
        "image_grid_hw": torch.tensor([[6, 6]]),
    }


def step_batches(steps: int = STEPS) -> list[list[dict[str, torch.Tensor]]]:
    return [[micro_batch(100 * step + rank) for rank in range(WORLD)] for step in range(steps)]


def optimizer_step(model, optimizer, balancer) -> None:
    with reference_numerics():  # Newton–Schulz's bf16 products rounded once: the same bits at any batch of matrices
        optimizer.step()
    optimizer.zero_grad()
    balancer.step()


def train_one_process(model, optimizer, balancer, steps) -> None:
    """One process, every rank's micro-batch of each step, the gradients summed EP group by EP group."""
    for micro_batches in steps:
        groups = []
        for ranks in EP_GROUPS:
            for rank in ranks:
                (model(**micro_batches[rank]).loss / WORLD).backward()
            groups.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
            model.zero_grad(set_to_none=True)
        for name, param in model.named_parameters():
            if name in groups[0]:
                param.grad = groups[0][name] + groups[1][name]
        optimizer_step(model, optimizer, balancer)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def assert_experts_step_without_communication(model) -> None:
    """A MixedOptimizer step over the routed experts alone calls no collective: each rank's experts are whole."""
    names = [name for name, _ in model.named_parameters() if ".ffn.experts." in name]
    groups = []
    for group in build_param_groups(model, lr=LR):
        members = [(n, p) for n, p in zip(group["param_names"], group["params"]) if n in names]
        if members:
            groups.append({**group, "param_names": [n for n, _ in members], "params": [p for _, p in members]})
    assert {g["kind"] for g in groups} == {"muon", "muon_headwise"}  # down_proj, gate_up_proj (w1 | w3 head-wise)
    assert sum(len(g["params"]) for g in groups) == len(names) == 8
    optimizer = MixedOptimizer(groups)
    for group in groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    calls = []
    collectives = ("all_to_all_single", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                   "broadcast")
    originals = {name: getattr(dist, name) for name in collectives}
    try:
        for name in collectives:
            setattr(dist, name, lambda *args, _name=name, **kwargs: calls.append(_name))
        optimizer.step()
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)
    model.zero_grad(set_to_none=True)
    assert not calls, calls


# ----------------------------------------------------------------------------- workers


def _mesh_matches_one_process(rank: int, tmp: Path) -> None:
    from modeling_dsv41.training.fsdp import shard_model

    steps = step_batches()
    model = shard_model(tiny_model(), expert_parallel_size=EP_SIZE)
    experts = model.model.layers[0].ffn.experts
    assert tuple(experts.gate_up_proj.shape) == (4, 64, 64)  # the whole tensor, as checkpoints hold it
    assert tuple(experts.gate_up_proj.to_local().shape) == (1, 64, 64)  # this rank's expert, whole
    optimizer = MixedOptimizer(build_param_groups(model, lr=LR))
    balancer = RouterBiasBalancer(model, SPEED)
    model.train()
    for step, micro_batches in enumerate(steps):
        loss = model(**micro_batches[rank]).loss
        loss.backward()
        optimizer_step(model, optimizer, balancer)
    parameters = {name: whole(p.detach()) for name, p in model.named_parameters()}  # collective: every rank
    biases = {name: b for name, b in model.named_buffers() if ".gate.bias" in name}
    for name, bias in biases.items():  # the balancer's buffers: identical on every rank
        gathered = [torch.empty_like(bias) for _ in range(WORLD)]
        dist.all_gather(gathered, bias)
        assert all(torch.equal(gathered[0], other) for other in gathered), name
    assert_experts_step_without_communication(model)
    if rank:
        return
    single = torch.load(tmp / "single.pt")
    kinds = single["kinds"]
    diff, norm = {}, {}
    for name, param in single["parameters"].items():
        kind = kinds[name]
        diff[kind] = diff.get(kind, 0.0) + (parameters[name] - param).pow(2).sum().item()
        norm[kind] = norm.get(kind, 0.0) + param.pow(2).sum().item()
    errors = {kind: (diff[kind] / norm[kind]) ** 0.5 for kind in diff if kind != "frozen"}
    (tmp / "errors.txt").write_text(repr(errors))
    assert set(errors) == {"muon", "muon_headwise", "sinkhorn", "adamw"}, errors
    differing = [name for name, param in single["parameters"].items() if not torch.equal(parameters[name], param)]
    assert not differing, f"{len(differing)} parameters differ from one process's, e.g. {differing[:5]}; {errors}"
    assert any(bias.any() for bias in biases.values())
    for name, bias in biases.items():
        assert torch.equal(bias, single["biases"][name]), name


def one_process_reference(path: Path) -> None:
    """Train one process on every rank's micro-batches (before any process group exists: its balancer counts
    alone) and save its parameters, biases and optimizer kinds."""
    single = tiny_model()
    single_optimizer = MixedOptimizer(build_param_groups(single, lr=LR))
    train_one_process(single, single_optimizer, RouterBiasBalancer(single, SPEED), step_batches())
    torch.save({
        "parameters": {name: p.detach() for name, p in single.named_parameters()},
        "biases": {name: b for name, b in single.named_buffers() if ".gate.bias" in name},
        "kinds": assign_kinds(single),
    }, path)


def test_2x2_mesh_three_steps_equal_one_process_bit_for_bit(tmp_path):
    """Relative difference 0 per optimizer kind (every parameter equal), biases identical everywhere and to one
    process's, on text and image batches, with gradient checkpointing."""
    one_process_reference(tmp_path / "single.pt")
    spawn(_mesh_matches_one_process, tmp_path, world_size=WORLD, timeout_s=300)
    print((tmp_path / "errors.txt").read_text())
