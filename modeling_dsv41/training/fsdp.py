"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for DeepSeek-V4.1: which modules to shard as units, and why.

The units are the decoder layers and the ViT blocks (``_no_split_modules``), then the root. Finer units give a
silently different forward: a compressed attention layer *publishes* its compressed KV, index keys and top-k
selection for the layers below by writing them into the :class:`~.attention.CompressedContext` it is handed, and
FSDP2's pre-forward hook of a sharded module rebuilds dataclass arguments that hold tensors requiring grad
(``dataclasses.replace``, to attach its post-backward hook), so writes made inside a sharded attention land on a
copy and the next layers read stale KV. A decoder layer returns its context, so sharding at the layer is exact.

Mixed precision keeps the model's fp32 modules fp32 (``_keep_in_fp32_modules_strict``: mHC, attention sinks,
ratio-2 compressors, LM head, ViT norms). FSDP2 casts every parameter of a unit to one ``param_dtype``, so under a
low-precision ``param_dtype`` a module made only of fp32-kept parameters (``lm_head``, the compressor projections,
ViT norms) becomes its own unit with an fp32 policy, and those that sit next to low-precision matrices in one
module (``hc_*`` on the decoder layer, ``attn_sink``) are left out of sharding: each rank keeps a full fp32 copy
(vectors and ``[mix, hc·D]`` matrices: small) and their gradients are averaged over the mesh after backward, as
FSDP2 averages the sharded ones.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

try:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
except ImportError:  # torch built without distributed
    FSDPModule = MixedPrecisionPolicy = OffloadPolicy = fully_shard = None


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules to shard one by one, innermost first: every instance of the model's ``_no_split_modules``."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    if not classes:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules: no FSDP units to shard")
    return [module for module in model.modules() if type(module).__name__ in classes]


def fp32_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters the model keeps in fp32 whatever its dtype: those ``from_pretrained`` keeps fp32
    (``_keep_in_fp32_modules_strict``, matched as transformers' loader matches it)."""
    from transformers import PreTrainedModel
    from transformers.core_model_loading import build_glob_alternation

    base = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)  # under a PEFT wrapper too
    patterns = list(getattr(base, "_keep_in_fp32_modules_strict", None) or ())
    if not patterns:
        return []
    matcher = build_glob_alternation(patterns)[0]
    return [p for name, p in base.named_parameters() if p.requires_grad and matcher.search(name)]


def shard_model(
    model: nn.Module,
    mesh=None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    offload_policy: OffloadPolicy | None = None,
) -> nn.Module:
    """``fully_shard`` the decoder layers and ViT blocks, then the whole model, in place; returns ``model``.

    Args:
        model: a DeepSeek-V4.1 model (or a PEFT wrapper around one) with its weights loaded.
        mesh: the 1-D data-parallel ``DeviceMesh`` (default: every rank of the default group).
        mp_policy: FSDP2 mixed precision; with a ``param_dtype`` other than fp32 the fp32-kept parameters stay
            fp32 and replicated (see the module docstring).
        reshard_after_forward, offload_policy: as in ``fully_shard`` (``CPUOffloadPolicy()`` keeps the shards,
            their gradients and the optimizer step on the CPU).
    """
    if fully_shard is None or not dist.is_initialized():
        raise ValueError("shard_model needs torch.distributed initialized (init_process_group) before sharding")
    mp_policy = mp_policy or MixedPrecisionPolicy()
    kwargs = {
        "mesh": mesh, "reshard_after_forward": reshard_after_forward, "offload_policy": offload_policy or OffloadPolicy(),
    }
    fp32_units, replicated = [], set()
    if mp_policy.param_dtype not in (None, torch.float32):
        fp32_units, replicated = _split_fp32(model)
    fp32_policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None, output_dtype=None)
    for unit in fp32_units:
        fully_shard(unit, mp_policy=fp32_policy, **kwargs)
    for unit in fsdp_units(model):
        fully_shard(unit, mp_policy=mp_policy, ignored_params=replicated, **kwargs)
    # the root's output is the model's: fp32 loss and logits (the LM head is fp32), whatever `output_dtype` says
    root_policy = dataclasses.replace(mp_policy, output_dtype=None)
    fully_shard(model, mp_policy=root_policy, ignored_params=replicated, **kwargs)
    group = None if mesh is None else mesh.get_group()
    for param in replicated:
        param.register_post_accumulate_grad_hook(lambda p: _average_over_ranks(p.grad, group))
    return model


def _split_fp32(model: nn.Module) -> tuple[list[nn.Module], set[nn.Parameter]]:
    """fp32-kept parameters as (modules made only of them: their own fp32 units, the rest: replicated)."""
    kept = set(fp32_parameters(model))
    units, replicated = [], set()
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        mine = [p for p in own if p in kept]
        if mine and len(mine) == len(own) and not any(True for _ in module.children()):
            units.append(module)  # e.g. lm_head, the ratio-2 compressor projections, ViT norms
        else:
            replicated.update(mine)  # e.g. mHC's hc_* next to the layer's matrices, attention sinks
    return units, replicated


def _average_over_ranks(grad: torch.Tensor, group) -> None:
    """Mean of ``grad`` over the ranks, in place (SUM then divide: gloo has no AVG). Under gradient accumulation
    it runs after every micro-batch; the part already averaged is equal on all ranks, so the result stays the mean."""
    dist.all_reduce(grad, group=group)
    grad.div_(dist.get_world_size(group))


__all__ = ["fp32_parameters", "fsdp_units", "shard_model"]
