"""Expert parallelism for training: the routed experts sharded by expert over an ``ep`` mesh dimension, tokens sent to
the ranks that hold their experts and back with all-to-all, everything else FSDP2 over every rank.

The mesh is 2-D, ``(ep_shard, ep)`` over all ``world = ep_shard × ep`` ranks, ``ep`` the inner (contiguous) one, so an
EP group is a node's worth of neighbouring ranks (NeMo Automodel's layout):

* every rank trains on its own micro-batch (data parallelism over all ranks);
* the experts of every decoder layer are split by expert over ``ep``: EP rank ``c`` holds experts
  ``[c·E/ep, (c+1)·E/ep)``, as a DTensor ``Shard(0)`` of the whole ``[E, ...]`` tensor, and FSDP2 shards those again
  over ``ep_shard`` (the ranks that hold the same experts: NeMo's ``ep_shard``). Each rank keeps whole expert
  matrices, so Muon orthogonalizes each of its experts where it lives, with no communication;
* everything else (attention, shared experts, routers, mHC, embeddings, the ViT) is FSDP2-sharded over all ranks,
  as :func:`~.fsdp.shard_model` shards it without expert parallelism.

One MoE layer, on every rank (:class:`ExpertParallel`): the router chooses ``k`` experts per local token; the
``N·k`` slots, grouped by expert, go to the EP ranks that hold their experts (one ``all_to_all`` of their counts,
one of the token vectors, one of the routing weights); each rank runs its experts on what it received, one source
rank after another; the fp32 outputs go back by the reverse ``all_to_all`` and every token sums its experts' outputs
in ascending expert order. The all-to-alls are autograd functions (the backward is the reverse exchange), so the
gradients come back the same way, under gradient checkpointing too (the recomputed forward exchanges again).

Exactness. A rank runs each expert on each source's tokens separately, with the routing weight applied where the
single-process loop applies it, so every product is the one a single process computes for that micro-batch, and
its output, input gradient and weight gradient are the same bits. An expert's weight gradient is then the sum over
the sources of its EP group (autograd sums them on the rank), then over ``ep_shard`` (FSDP2's reduce-scatter over the
ranks that hold it). The gradients of everything else are reduced in the same order, EP group first
(:class:`EPGroupFirstReduceScatter`), so that every gradient is ``Σ_groups (Σ_ranks of the group g)``; on a 2 × 2
mesh each of those sums adds two terms, which floating point adds the same way in either order, and one process that
accumulates the two EP groups' micro-batches separately and adds the two gets the same bits (tested).

LoRA of the natively loaded release. The FP4 experts (packed bytes and E8M0 scales, frozen) are split by expert as
above; each rank runs its experts weight-only with its adapters' factors. PEFT's expert factors hold every expert
(``lora_A`` [E·r, in], ``lora_B`` [out, r·E], expert ``e`` in the columns ``j·E + e``: not a contiguous block, so
not a ``Shard`` of the ``ep`` dimension); they are small next to the experts (``r·(in + out)`` values per expert
against ``in·out/2`` bytes) and stay in their layer's FSDP2 unit, sharded over every rank. Each rank takes its
experts' slices of the gathered factors; their gradient is zero on the other ranks of the EP group, so the EP-group
sum gives the holder's own, and the order of every sum is the experts' (tested against one process).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize

from ..bnb_experts import BnbExperts
from ..moe import DeepseekV41Experts, DeepseekV41MoE, add_rows, routed_experts_forward
from ..released.native_precision import (
    FP4_EXPERT_TENSORS,
    ExpertFactors,
    FP4KernelExperts,
    WeightOnlyFP4Experts,
    fp4_expert_weights,
)

try:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter  # set_custom_reduce_scatter's interface
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # torch built without distributed
    CPUOffloadPolicy = DeviceMesh = init_device_mesh = DTensor = Shard = None
    ReduceScatter = object

EP, EP_SHARD = "ep", "ep_shard"
# the routed experts as the release stores them (packed FP4 + E8M0 scales, frozen), natively loaded
NATIVE_EXPERTS = (WeightOnlyFP4Experts, FP4KernelExperts)


@dataclass(frozen=True)
class TrainingMesh:
    """The meshes of expert-parallel training: ``experts`` is the 2-D ``(ep_shard, ep)`` mesh the routed experts
    live on, ``data`` the 1-D mesh over every rank (same rank order) that shards everything else."""

    experts: DeviceMesh
    data: DeviceMesh

    @property
    def ep_size(self) -> int:
        return self.experts[EP].size()

    @property
    def ep_shard_size(self) -> int:
        return self.experts[EP_SHARD].size()


def training_mesh(ep_size: int, device_type: str | None = None) -> TrainingMesh:
    """The :class:`TrainingMesh` for ``ep_size``-way expert parallelism over every rank of the default group."""
    if not dist.is_initialized():
        raise ValueError("expert parallelism needs torch.distributed initialized (init_process_group) first")
    world = dist.get_world_size()
    if ep_size < 1 or world % ep_size:
        sizes = [size for size in range(1, world + 1) if world % size == 0]
        raise ValueError(f"expert_parallel_size={ep_size} must divide the world size {world}: use one of {sizes}")
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    experts = init_device_mesh(device_type, (world // ep_size, ep_size), mesh_dim_names=(EP_SHARD, EP))
    data = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    return TrainingMesh(experts, data)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 whose backward is the reverse exchange (the gradients go back)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad, out_splits, in_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows ``in_splits[p]`` of ``x`` to rank ``p`` of ``group``, ``out_splits[p]`` rows from it; differentiable."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class ExpertParallel:
    """Token dispatch and combine of one layer's routed experts over an EP process group (see the module docstring).

    Installed on a :class:`~..moe.DeepseekV41Experts` (or the natively loaded FP4 experts) by
    :func:`distribute_experts`, it replaces that module's forward: same inputs (the local tokens and their global
    expert choices; for FP4 experts, the LoRA factors of the adapters around them, by global expert), same fp32 output,
    the experts computed on the ranks that hold them. The local experts run the reference (eager) loop; FP4 ones
    weight-only (:func:`~..released.native_precision.fp4_expert_weights`), as adapted FP4 experts run anyway.
    """

    def __init__(self, group: dist.ProcessGroup, num_experts: int):
        self.group = group
        self.size = dist.get_world_size(group)
        if num_experts % self.size:
            raise ValueError(
                f"expert parallelism over {self.size} ranks needs whole experts per rank: "
                f"{num_experts} experts do not split {self.size} ways"
            )
        self.num_experts = num_experts
        self.num_local = num_experts // self.size
        self.first = dist.get_rank(group) * self.num_local  # the global id of this rank's first expert

    def __call__(
        self,
        experts: nn.Module,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        adapters: Mapping[str, ExpertFactors] | None = None,
    ) -> torch.Tensor:
        """hidden_states [N, D], top_k_index / top_k_weights [N, k] (global expert ids) → fp32 [N, D]; ``adapters``:
        as the FP4 experts' forward takes them (:mod:`~..released.native_lora`)."""
        num_tokens, top_k = top_k_index.shape
        expert_ids = top_k_index.flatten()
        order = expert_ids.argsort(stable=True)  # slots grouped by expert, tokens ascending within each
        sent = torch.bincount(expert_ids, minlength=self.num_experts).view(self.size, self.num_local)
        received = torch.empty_like(sent)  # [source rank, local expert]: slots each source sends each expert
        dist.all_to_all_single(received, sent, group=self.group)
        send_splits, recv_splits = sent.sum(1).tolist(), received.sum(1).tolist()  # one host sync
        slot_tokens = order // top_k
        x = all_to_all(hidden_states.index_select(0, slot_tokens), recv_splits, send_splits, self.group)
        weights = all_to_all(top_k_weights.flatten()[order], recv_splits, send_splits, self.group)
        out = self._local_experts(experts, x, weights, received, adapters)
        out = all_to_all(out, send_splits, recv_splits, self.group)  # [N·k, D] fp32, in `order`
        return add_rows(out.new_zeros(num_tokens, out.shape[-1]), slot_tokens, out)

    def _local_experts(
        self,
        experts: nn.Module,
        x: torch.Tensor,
        weights: torch.Tensor,
        received: torch.Tensor,
        adapters: Mapping[str, ExpertFactors] | None,
    ) -> torch.Tensor:
        """Each received slot's weighted expert output [M, D] fp32. The slots come grouped by (source, expert); each
        (source, expert) group is its own product: a *virtual* expert ``source · E_local + expert`` of the loop."""
        held, swiglu_limit = self._held_experts(experts, adapters)
        virtual = torch.repeat_interleave(torch.arange(received.numel(), device=x.device), received.flatten())
        return routed_experts_forward(
            x,
            virtual.unsqueeze(1),
            weights.unsqueeze(1),
            received.numel(),
            swiglu_limit,
            lambda v: held(v % self.num_local),
        )

    def _held_experts(
        self, experts: nn.Module, adapters: Mapping[str, ExpertFactors] | None
    ) -> tuple[Callable, float]:
        """This rank's experts: local expert → (gate_up, down) as the loop applies them, and the SwiGLU clamp."""
        if isinstance(experts, NATIVE_EXPERTS):
            stored = {name: _local(getattr(experts, name)) for name in FP4_EXPERT_TENSORS}
            return fp4_expert_weights(stored, adapters, self.first), experts.limit or 0.0
        if adapters:
            raise ValueError(f"{type(experts).__name__} takes no adapter factors: only the FP4 experts do")
        gate_ups = _local(experts.gate_up_proj).unbind(0)  # one unbind: its backward stacks the gradients once
        downs = _local(experts.down_proj).unbind(0)
        return (lambda e: (gate_ups[e], downs[e])), experts.swiglu_limit


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def expert_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The backbone's routed experts (``layers.N.ffn.experts``, under their adapters if any; the DSpark draft blocks'
    stay data parallel). Expert parallelism splits bf16 or natively loaded FP4 ones; any other is an error."""
    for name, moe in model.named_modules():
        if not isinstance(moe, DeepseekV41MoE) or ".mtp." in f".{name}":
            continue
        experts = moe.experts
        while hasattr(experts, "base_layer"):  # PEFT's wrappers
            experts = experts.base_layer
        if isinstance(experts, BnbExperts) or not isinstance(experts, (DeepseekV41Experts, *NATIVE_EXPERTS)):
            raise ValueError(
                "expert parallelism splits plain (bf16, fp32) or natively loaded FP4 routed experts; "
                f"{name}.experts is {type(experts).__name__}: shard with expert_parallel_size=1"
            )
        yield f"{name}.experts", experts


def check_expert_parallel_model(model: nn.Module) -> None:
    """What expert parallelism trains: every weight of a model in plain precision, or LoRA adapters (PEFT) of the
    natively loaded release, whose FP4 experts take their adapters' factors by expert on the ranks that hold them.
    PEFT's own expert adapters (a parametrization of the bf16 ``[E, out, in]`` parameter) build every expert's delta
    in one tensor, which cannot be split by expert."""
    from .router_balancing import is_adapter_model

    if is_adapter_model(model) and not all(isinstance(m, NATIVE_EXPERTS) for _, m in expert_modules(model)):
        raise ValueError(
            "expert_parallel_size trains LoRA adapters on the natively loaded release only (its routed experts FP4 as "
            "stored, their adapters applied expert by expert); this model's routed experts are not natively loaded: "
            "load the release with from_pretrained (or released.loading.empty_native_model), fine-tune every weight "
            "of the dequantized model without adapters, or shard with shard_model(model) (FSDP2 alone, "
            "expert_parallel_size=1)"
        )


def distribute_experts(model: nn.Module, mesh: TrainingMesh) -> list[nn.Module]:
    """Split every backbone layer's routed experts by expert over ``mesh``'s ``ep`` dimension, in place: each
    parameter becomes a DTensor ``Shard(0)`` of the whole ``[E, ...]`` tensor (checkpoints hold the whole tensor, so
    they load on any mesh), and the module's forward dispatches its tokens (:class:`ExpertParallel`). Returns them."""
    modules = []
    group = mesh.experts[EP].get_group()
    for name, experts in expert_modules(model):
        implementation = getattr(experts.config, "_experts_implementation", None) or "eager"
        if parametrize.is_parametrized(experts):
            raise ValueError(
                f"{name} carries a parametrization (such as PEFT's own target_parameters adapter, built on the stored "
                "tensor): expert parallelism splits the stored tensors by expert; load the release with "
                "from_pretrained or released.loading.empty_native_model, whose PEFT dispatch builds expert adapters "
                "applied by expert"
            )
        if implementation != "eager" and not isinstance(experts, NATIVE_EXPERTS):
            raise ValueError(
                f"expert-parallel training runs the reference (eager) experts loop on each rank's experts; {name} "
                f"uses experts_implementation={implementation!r}: load the model with experts_implementation='eager'"
            )
        parallel = ExpertParallel(group, experts.num_experts)
        rank = mesh.experts[EP].get_local_rank()
        for param_name, param in list(experts.named_parameters(recurse=False)):
            # every rank holds the whole tensor (or a meta one, to load later): keep this rank's experts, no exchange
            mine = param.data.chunk(parallel.size)[rank]
            shard = DTensor.from_local(mine, mesh.experts[EP], [Shard(0)], shape=param.shape, stride=param.stride())
            experts.register_parameter(param_name, nn.Parameter(shard, requires_grad=param.requires_grad))
        experts.forward = _ParallelForward(parallel, experts)
        modules.append(experts)
    return modules


class _ParallelForward:
    """``experts.forward`` under expert parallelism (an instance attribute, so FSDP2's hooks still wrap the call)."""

    def __init__(self, parallel: ExpertParallel, experts: nn.Module):
        self.parallel, self.experts = parallel, experts

    def __call__(self, hidden_states, top_k_index, top_k_weights, adapters=None):
        return self.parallel(self.experts, hidden_states, top_k_index, top_k_weights, adapters)


class EPGroupFirstReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter over every rank, summed EP group by EP group and then across the groups, the
    order the experts' gradients take (see the module docstring). Two reduce-scatters: within the EP group (a node),
    then over ``ep_shard``, on ``1/ep`` of the data; FSDP2 divides by the world size afterwards."""

    def __init__(self, mesh: TrainingMesh):
        self.ep_group = mesh.experts[EP].get_group()
        self.ep_shard_group = mesh.experts[EP_SHARD].get_group()
        self.ep, self.ep_shard = mesh.ep_size, mesh.ep_shard_size

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"EPGroupFirstReduceScatter sums (FSDP2 divides afterwards), got {op}")
        # input: one chunk per rank r = i·ep + c; EP rank c first gets the chunks of ranks (·, c)
        chunks = input_tensor.view(self.ep_shard, self.ep, -1).transpose(0, 1).contiguous()
        partial = input_tensor.new_empty(chunks[0].numel())
        dist.reduce_scatter_tensor(partial, chunks.view(-1), group=self.ep_group)
        return dist.reduce_scatter_tensor(output_tensor, partial, group=self.ep_shard_group, async_op=async_op)


def check_expert_parallel_arguments(args) -> None:
    """``DeepseekV41TrainingArguments.expert_parallel_size``: at least 1; above 1, gradient accumulation
    reduce-scatters every micro-batch (accelerate's ``sync_each_batch``): FSDP2's ``no_sync`` would hold every
    layer's unsharded gradients until the last micro-batch, which full fine-tuning of the release has no room for,
    and would sum the experts' and the other gradients in different orders."""
    size = args.expert_parallel_size
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"expert_parallel_size must be an integer >= 1, got {size!r}")
    if size == 1:
        return
    if args.train_dspark_head:
        raise ValueError(
            "train_dspark_head trains the DSpark draft head alone (its experts stay data parallel): train it with "
            "FSDP2 or DDP and expert_parallel_size=1; expert_parallel_size is for training the backbone"
        )
    kwargs = dict(args.accelerator_config.gradient_accumulation_kwargs or {})
    if kwargs.get("sync_each_batch") is False:
        raise ValueError(
            "expert_parallel_size reduce-scatters the gradients after every micro-batch: leave "
            "accelerator_config.gradient_accumulation_kwargs.sync_each_batch unset (or true)"
        )
    args.accelerator_config.gradient_accumulation_kwargs = {**kwargs, "sync_each_batch": True}


def check_expert_parallel_trainer(trainer) -> None:
    """Refuse, once accelerate decided the strategy, what ``expert_parallel_size > 1`` cannot run with, naming what
    it runs with: accelerate's FSDP2 plugin over a data-parallel world, full fine-tuning or LoRA of the natively
    loaded release (:func:`check_expert_parallel_model`)."""
    size = trainer.args.expert_parallel_size
    if size == 1:
        return
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if not trainer.is_fsdp_enabled or getattr(plugin, "fsdp_version", 1) != 2:
        raise ValueError(
            f"expert_parallel_size={size} runs under FSDP2 (the experts sharded by expert, everything else by FSDP2); "
            f"accelerate runs this as {trainer.accelerator.state.distributed_type.value}: launch with an FSDP2 config "
            "(fsdp_version: 2, e.g. examples/accelerate/fsdp2_ep.yaml)"
        )
    config = getattr(trainer.accelerator, "parallelism_config", None)
    others = {k: getattr(config, k, 1) or 1 for k in ("tp_size", "cp_size", "sp_size", "dp_replicate_size")}
    if any(value > 1 for value in others.values()):
        raise ValueError(
            f"expert_parallel_size runs on a data-parallel world (every process its own micro-batch, dp_shard only); "
            f"the parallelism config asks for {', '.join(f'{k}={v}' for k, v in others.items() if v > 1)}: leave "
            "those at 1"
        )
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        raise ValueError("expert_parallel_size keeps the experts on the devices: set fsdp_offload_params: false")
    check_expert_parallel_model(trainer.model)
    world, experts = trainer.args.world_size, trainer.model.config.get_text_config().n_routed_experts
    if world % size or experts % size:
        sizes = [n for n in range(2, world + 1) if world % n == 0 and experts % n == 0]
        raise ValueError(
            f"expert_parallel_size={size} must divide the {world} processes and the {experts} routed experts "
            f"(whole experts per process): use one of {sizes or [1]}"
        )


__all__ = [
    "EP",
    "EP_SHARD",
    "EPGroupFirstReduceScatter",
    "ExpertParallel",
    "NATIVE_EXPERTS",
    "TrainingMesh",
    "all_to_all",
    "check_expert_parallel_arguments",
    "check_expert_parallel_model",
    "check_expert_parallel_trainer",
    "distribute_experts",
    "expert_modules",
    "training_mesh",
]
