"""MixedOptimizer on sharded parameters: 2 gloo processes on CPU, spawned from pytest, against one process.

The measure is the relative error of the parameter *change* over 3 steps, per kind:
``‖Δ_sharded − Δ_single‖ / ‖Δ_single‖``. Both runs see the same full-batch gradient (FSDP2 averages the two
half-batch gradients), so what remains is float32 summation order, amplified by bfloat16 Newton–Schulz;
0.02 (the issue's bound) is far above it, while the shard-local updates the issue measured are at 0.023-0.37.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_processes import WORLD, spawn
from torch import nn

from modeling_dsv41.optim import MixedOptimizer

MAX_RELATIVE_ERROR = 0.02
STEPS = 3


class Toy(nn.Module):
    """One parameter of every kind and layout the optimizer distinguishes, all on the loss path."""

    def __init__(self, vocab: int = 11, dim: int = 8, heads: int = 3, head_dim: int = 4, experts: int = 3):
        super().__init__()
        self.embed = nn.Parameter(torch.randn(vocab, dim))  # sinkhorn, rows sharded (11 rows: 6 + 5)
        self.table = nn.Parameter(torch.randn(vocab, dim))  # sinkhorn, columns sharded (owner rank)
        self.wq_b = nn.Parameter(torch.randn(heads * head_dim, dim) / dim**0.5)  # head-wise; shards cut head 1
        self.w1 = nn.Parameter(torch.randn(16, dim) / dim**0.5)  # muon, rows sharded
        self.w2 = nn.Parameter(torch.randn(dim, 16) / 4)  # muon, columns sharded
        # fused gate_up [E, 2I, D] (head-wise: gate and up each whole), expert dim sharded: local, no communication
        self.experts = nn.Parameter(torch.randn(experts, 6, dim) / dim**0.5)
        self.experts_rows = nn.Parameter(torch.randn(experts, 6, dim) / dim**0.5)  # muon, each expert's rows split
        self.norm = nn.Parameter(torch.ones(dim))  # adamw
        self.bias = nn.Parameter(torch.zeros(16))  # adamw
        self.heads = heads

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed[ids] + 0.5 * self.table[ids]  # [B, S, D]
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        q = (h @ self.wq_b.T).unflatten(-1, (self.heads, -1))  # [B, S, H, hd]
        h = h + torch.tanh(q).mean(-2).sum(-1, keepdim=True)
        h = h + torch.relu(h @ self.w1.T + self.bias) @ self.w2.T
        gate = torch.softmax(h[..., : self.experts.shape[0]], dim=-1)  # [B, S, E]
        routed = torch.einsum("bsd,eid->bsei", h, self.experts).tanh()
        routed = torch.einsum("bsei,eid->bsed", routed, self.experts_rows)
        h = h + torch.einsum("bse,bsed->bsd", gate, routed)
        return (h @ self.embed.T).logsumexp(-1).mean()


PLACEMENT_DIM = {"table": 1, "w2": 1, "experts_rows": 1}  # everything else: FSDP2's default Shard(0)


def groups_for(model: Toy) -> list[dict]:
    return [
        {"kind": "sinkhorn", "params": [model.embed, model.table], "lr": 0.05},
        {"kind": "muon_headwise", "params": [model.wq_b], "num_heads": model.heads, "lr": 0.05},
        {"kind": "muon_headwise", "params": [model.experts], "num_heads": (1, 1), "split_sizes": (3, 3), "lr": 0.05},
        {"kind": "muon", "params": [model.w1, model.w2, model.experts_rows], "lr": 0.05},
        {"kind": "adamw", "params": [model.norm, model.bias], "lr": 0.05},
    ]


KIND_OF = {"embed": "sinkhorn", "table": "sinkhorn", "wq_b": "muon_headwise", "experts": "muon_headwise"}
KIND_OF.update(norm="adamw", bias="adamw")


def batches(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 11, (4, 5), generator=g) for _ in range(STEPS)]


def train(model: nn.Module, optimizer: MixedOptimizer, ids: list[torch.Tensor]) -> None:
    for batch in ids:
        model(batch).backward()
        optimizer.step()
        optimizer.zero_grad()


def shard(model: Toy, mesh) -> Toy:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    names = {id(p): n for n, p in model.named_parameters()}
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(PLACEMENT_DIM.get(names[id(p)], 0)))
    return model


def relative_errors(initial: Toy, single: Toy, sharded: Toy) -> dict[str, float]:
    """Per kind: ‖Δ_sharded − Δ_single‖ / ‖Δ_single‖ over the kind's parameters."""
    diff, norm = {}, {}
    for (name, p0), p1, p2 in zip(initial.named_parameters(), single.parameters(), sharded.parameters()):
        kind = KIND_OF.get(name, "muon")
        delta = p1.detach() - p0.detach()
        diff[kind] = diff.get(kind, 0.0) + (p2.full_tensor() - p1.detach()).pow(2).sum().item()
        norm[kind] = norm.get(kind, 0.0) + delta.pow(2).sum().item()
    return {kind: (diff[kind] / norm[kind]) ** 0.5 for kind in diff}


# ----------------------------------------------------------------------------- workers


def _fsdp_matches_single_process_and_resumes(rank: int, tmp: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    initial = Toy()
    ids = batches()
    single = copy.deepcopy(initial)
    train(single, MixedOptimizer(groups_for(single)), ids)

    mesh = init_device_mesh("cpu", (WORLD,))
    half = slice(rank * 2, rank * 2 + 2)  # each rank half of the batch; FSDP2 averages the gradients
    sharded = shard(copy.deepcopy(initial), mesh)
    optimizer = MixedOptimizer(groups_for(sharded))
    train(sharded, optimizer, [b[half] for b in ids[:2]])
    dcp.save(dict(zip(("model", "optim"), get_state_dict(sharded, optimizer))), checkpoint_id=tmp / "ckpt")
    train(sharded, optimizer, [ids[2][half]])

    errors = relative_errors(initial, single, sharded)
    assert set(errors) == {"muon", "muon_headwise", "sinkhorn", "adamw"}
    assert all(error <= MAX_RELATIVE_ERROR for error in errors.values()), errors
    if rank == 0:
        (tmp / "errors.txt").write_text(repr(errors))

    resumed = shard(Toy(), mesh)  # other initial weights: everything must come from the checkpoint
    resumed_optimizer = MixedOptimizer(groups_for(resumed))
    model_state, optim_state = get_state_dict(resumed, resumed_optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=tmp / "ckpt")
    set_state_dict(resumed, resumed_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train(resumed, resumed_optimizer, [ids[2][half]])
    for (name, p), q in zip(sharded.named_parameters(), resumed.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), f"{name} differs after resuming"


def _two_dim_mesh_layouts(rank: int, tmp: Path) -> None:
    """A ("dp", "tp") mesh: Shard/Replicate on either mesh dim, rows or columns, vs one process; a strided
    shard (FSDP2 over tensor parallelism) takes DTensor's all-gather fallback."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    shapes = [(12, 8), (8, 12), (3, 6, 8), (11, 8), (8, 12)]
    kinds = ["muon_headwise", "muon", "muon", "sinkhorn", "muon"]
    placements = [
        (Replicate(), Shard(0)),
        (Replicate(), Shard(1)),
        (Shard(0), Shard(1)),
        (Replicate(), Shard(0)),
        (Replicate(), _StridedShard(0, split_factor=2)),
    ]
    weights = [torch.randn(shape, generator=g) for shape in shapes]
    grads = [[torch.randn(shape, generator=g) for shape in shapes] for _ in range(STEPS)]

    def make(params):
        extra = {"muon_headwise": {"num_heads": 3}}
        return MixedOptimizer([{"kind": k, "params": [p], **extra.get(k, {})} for k, p in zip(kinds, params)], lr=0.05)

    single = [nn.Parameter(w.clone()) for w in weights]
    sharded = [nn.Parameter(distribute_tensor(w.clone(), mesh, pl)) for w, pl in zip(weights, placements)]
    for params, to in ((single, lambda t, i: t), (sharded, lambda t, i: distribute_tensor(t, mesh, placements[i]))):
        optimizer = make(params)
        for step_grads in grads:
            for i, (p, grad) in enumerate(zip(params, step_grads)):
                p.grad = to(grad.clone(), i)
            optimizer.step()
    for kind, w, p1, p2 in zip(kinds, weights, single, sharded):
        delta = p1.detach() - w
        error = ((p2.detach().full_tensor() - p1.detach()).norm() / delta.norm()).item()
        assert error <= MAX_RELATIVE_ERROR, (kind, tuple(w.shape), p2.placements, error)
    strided_rows = nn.Parameter(distribute_tensor(weights[0], mesh, placements[4]))
    with pytest.raises(ValueError, match="head-wise Muon needs rows sharded with Shard"):
        MixedOptimizer([{"kind": "muon_headwise", "params": [strided_rows], "num_heads": 3}])


@pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")
def test_fsdp2_three_steps_match_one_process_per_kind_and_dcp_resume_is_exact(tmp_path):
    spawn(_fsdp_matches_single_process_and_resumes, tmp_path)
    print((tmp_path / "errors.txt").read_text())


@pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")
def test_two_dim_mesh_row_and_column_shards_match_one_process(tmp_path):
    spawn(_two_dim_mesh_layouts, tmp_path)
