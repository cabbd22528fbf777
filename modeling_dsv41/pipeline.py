"""Pipeline parallelism (``DistributedConfig(pp_size=N)``) for DeepSeek-V4.1, on transformers' pipeline stages.

transformers' naive pipeline hands one [B, S, D] tensor from stage to stage as ``inputs_embeds``. Our residual
stream between blocks is more than that (:class:`~.residual_stream.ResidualStream`, the model's pipeline plan): the
``hc_mult`` copies [B, S, hc, D], the mHC weights ``pre_mix`` [B, S, hc] the next block collapses them with, and the
compressed context that compressed layers hand up the stack (compressed K=V, index keys, top-k selection, candidate
blocks: any may be None). Engram layers hash n-grams of the input ids, which every stage keeps. So the split keeps
transformers' :class:`PipelineStage` (layer ranges, point-to-point ``communicate``, ``broadcast_from_last`` of the
logits, checkpoint key ownership) and its ``pp`` mesh, and the model's forward receives / sends that stream itself
(:func:`stream_from_previous_stage`, :func:`hand_on_to_next_stage`) around the slice of layers it runs
(:func:`stage_layers`):

* stage 0: ``embed`` (and the vision tower) → its layers → sends the stream;
* a middle stage: receives the stream → its layers → sends it;
* the last stage: receives the stream → its layers → hc collapse → ``norm`` → ``lm_head``; the logits are
  broadcast to every stage, so ``generate`` runs unchanged on every rank, each stage caching its own layers.

Inference only: there is no backward across stages, so ``labels`` and training mode are refused. Every rank runs
``generate`` on the same logits, so sampling needs the same seed on every rank (greedy and beam search need nothing);
each forward checks that every stage was given the same inputs, so a rank that drifted is an error, not garbage.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from transformers.distributed.pipeline_parallel import PipelineIdentityLayer, PipelineStage

from .residual_stream import ResidualStream

# what a stream header can name (its index is the code sent); -1 sends None
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool)
_MAX_NDIM = 4  # [B, S, hc, D] is the largest tensor of the stream
# modules of the backbone that only the first stage holds and loads: `embed` (transformers' stage knows only
# `embed_tokens`), the vision tower and its aligner
_FIRST_STAGE_MODULES = ("embed", "vision", "aligner")


class DeepseekV41PipelineStage(PipelineStage):
    """transformers' stage, plus the layers it runs and the exchange of our residual stream."""

    def __init__(self, pp_mesh, num_layers: int):
        super().__init__(pp_mesh)
        self.layer_range = range(*self.layer_range_for_rank(self.pp_rank, num_layers))

    def find_rank_for_key(self, key: str, num_layers: int, base_model_prefix: str) -> int | None:
        """The stage that loads a checkpoint key (None: every stage). transformers' rule knows ``layers``, ``norm``
        and ``lm_head``; ours adds ``embed`` and the vision tower, so other stages neither load nor report them."""
        if key.startswith(tuple(f"{base_model_prefix}.{name}." for name in _FIRST_STAGE_MODULES)):
            return 0
        return super().find_rank_for_key(key, num_layers, base_model_prefix)

    def send_stream(self, stream: ResidualStream) -> None:
        """Send the stream to the next stage: a header [n, 2 + _MAX_NDIM] (dtype code or -1 for None, ndim, shape),
        then each tensor, at its own dtype (``pre_mix`` is fp32 whatever the model dtype; selections are ids)."""
        tensors = stream.tensors()
        header = torch.full((len(tensors), 2 + _MAX_NDIM), -1, dtype=torch.long)
        for row, tensor in zip(header, tensors):
            if tensor is None:
                continue
            if tensor.dtype not in _DTYPES or tensor.ndim > _MAX_NDIM:
                raise ValueError(f"cannot send a {tensor.dtype} tensor of shape {tuple(tensor.shape)} between stages")
            row[0], row[1] = _DTYPES.index(tensor.dtype), tensor.ndim
            row[2 : 2 + tensor.ndim] = torch.tensor(tensor.shape)
        device = next(tensor.device for tensor in tensors if tensor is not None)  # NCCL sends from the accelerator
        self.communicate("send_forward", device=device, dtype=torch.long, tensor=header)
        for tensor in tensors:
            if tensor is not None:
                self.communicate("send_forward", device=tensor.device, dtype=tensor.dtype, tensor=tensor)

    def recv_stream(self, device: torch.device) -> ResidualStream:
        """Receive the stream :meth:`send_stream` sent from the previous stage, onto ``device``."""
        receive = partial(self.communicate, "recv_forward", device=device)
        header = receive(dtype=torch.long, shape=(len(ResidualStream.TENSORS), 2 + _MAX_NDIM))
        return ResidualStream.from_tensors(
            *[
                None if code < 0 else receive(dtype=_DTYPES[code], shape=shape[:ndim])
                for code, ndim, *shape in header.tolist()
            ]
        )


def stage_layers(layers: Sequence[nn.Module], stage: DeepseekV41PipelineStage | None) -> list[nn.Module]:
    """The slice of ``layers`` this rank runs: all of them without pipeline parallelism, else its stage's range
    (the others are :class:`PipelineIdentityLayer` placeholders)."""
    return list(layers) if stage is None else [layers[i] for i in stage.layer_range]


def stream_from_previous_stage(stage: DeepseekV41PipelineStage | None, device: torch.device) -> ResidualStream | None:
    """The stream the previous pipeline stage handed on, received onto ``device``; None where the model embeds its
    inputs itself (without pipeline parallelism, and on the first stage)."""
    if stage is None or stage.pp_is_first_stage:
        return None
    return stage.recv_stream(device)


def hand_on_to_next_stage(stage: DeepseekV41PipelineStage | None, stream: ResidualStream) -> bool:
    """Send ``stream`` to the next pipeline stage, which goes on from it; False where the model ends the forward
    itself (without pipeline parallelism, and on the last stage)."""
    if stage is None or stage.pp_is_last_stage:
        return False
    stage.send_stream(stream)
    return True


def maybe_distribute_model(distribute: Callable, model: nn.Module, distributed_config, mesh_manager) -> nn.Module:
    """transformers' ``maybe_distribute_model`` (``distribute``), with our pipeline split in place of its naive one:
    TP, EP and FSDP are still transformers' own, applied to the modules this stage keeps."""
    if mesh_manager is None or distributed_config.pp_size <= 1:
        return distribute(model, distributed_config, mesh_manager)
    if distributed_config.ep_size > 1:  # as transformers refuses token dispatch under pipeline parallelism
        raise ValueError("pipeline parallelism cannot be combined with expert parallelism (ep_size > 1) yet")
    split_into_stage(model, mesh_manager.get_mesh("pp"))
    without_pipeline = copy.copy(distributed_config)  # not dataclasses.replace: that would derive tp_size anew
    without_pipeline.pp_size = 1
    model = distribute(model, without_pipeline, mesh_manager)
    model.config.distributed_config = distributed_config
    return model


def split_into_stage(model: nn.Module, pp_mesh) -> DeepseekV41PipelineStage:
    """Keep on ``model`` (a :class:`DeepseekV41ForCausalLM`, still on the meta device) what this rank's stage runs;
    the rest becomes :class:`PipelineIdentityLayer`, so its weights are neither allocated nor loaded."""
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        raise ValueError(f"pipeline parallelism splits DeepseekV41ForCausalLM, not {type(model).__name__}")
    base = getattr(model, model.base_model_prefix)
    stage = DeepseekV41PipelineStage(pp_mesh, len(base.layers))
    if len(stage.layer_range) == 0:
        raise ValueError(
            f"pp_size={stage.pp_size} leaves stage {stage.pp_rank} without layers ({len(base.layers)} in all)"
        )
    for index in range(len(base.layers)):
        if index not in stage.layer_range:
            base.layers[index] = PipelineIdentityLayer()
    if not stage.pp_is_first_stage:
        for name in _FIRST_STAGE_MODULES:
            if hasattr(base, name):
                setattr(base, name, PipelineIdentityLayer())
    if not stage.pp_is_last_stage:
        base.norm = PipelineIdentityLayer()
        model.lm_head = PipelineIdentityLayer()
    model._pp_stage = base._pp_stage = stage  # the loader reads the top model's (key ownership), the backbone its own
    return stage


def check_pipeline_call(
    stage: PipelineStage | None, inputs: torch.Tensor, labels, training: bool, **outputs: bool | None
) -> None:
    """Refuse what a pipeline-parallel forward cannot compute whole, and inputs that differ between the stages
    (:func:`check_same_inputs`); nothing to check without pipeline parallelism (``stage`` None)."""
    if stage is None:
        return
    if labels is not None or training:
        raise ValueError(
            "pipeline parallelism runs inference only (no backward across stages): call it in eval mode, "
            "without labels"
        )
    if asked := [name for name, flag in outputs.items() if flag]:
        raise ValueError(
            f"{', '.join(asked)}: not returned under pipeline parallelism (each stage sees only its own layers)"
        )
    check_same_inputs(stage, inputs)


def logits_on_every_stage(stage: PipelineStage | None, logits: torch.Tensor | None, device: torch.device):
    """The last stage's logits, on every stage (``generate`` runs on every rank); ``logits`` themselves without
    pipeline parallelism."""
    if stage is None:
        return logits
    return stage.broadcast_from_last(logits, dtype=torch.float32, device=device)


def check_same_inputs(stage: PipelineStage, inputs: torch.Tensor) -> None:
    """Refuse a forward whose stages were given different input ids (or embeddings): each stage would run its layers
    on another sequence (e.g. ``generate(do_sample=True)`` seeded differently per rank) and the logits would be
    garbage. One all-gather of a 3-number digest (size, sum, position-weighted sum) per forward."""
    flat = inputs.detach().flatten().double()
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    digest = torch.stack([flat.new_tensor(float(flat.numel())), flat.sum(), (flat * weights).sum()])
    digest = digest.to("cpu" if stage.comm_on_cpu else flat.device)
    gathered = [torch.empty_like(digest) for _ in range(stage.pp_size)]
    dist.all_gather(gathered, digest, group=stage.pp_group)
    if any(not torch.equal(other, gathered[0]) for other in gathered[1:]):
        raise ValueError(
            "the pipeline stages were given different inputs: every rank must call the model (or generate) with the "
            "same input ids, and sampling needs the same seed on every rank"
        )
