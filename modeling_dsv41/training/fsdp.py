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

A model loaded in the released precision (FP8 Linears with E8M0 scales, packed FP4 experts as int8 bytes, frozen)
shards as it is stored. FSDP2 all-gathers a unit's parameters of several dtypes as bytes, so mixed dtypes in one
unit are fine; but it counts ``float8_e4m3fn`` and ``float8_e8m0fnu`` as floating point and would cast them to a
low-precision ``param_dtype`` (int8 it leaves alone). Under such a policy every module holding quantized parameters
(``FP8Linear``, ``FP8Experts``) becomes its own unit that casts nothing; a PEFT adapter around it stays in its
layer's unit, under the layer's policy.

Frozen Engram tables (FP8 as stored, or any table under LoRA) are left out of sharding: each rank keeps its table
where it is (host memory, pinned or memory-mapped) and the model looks up only the rows its hash ids address before
the layers run (:meth:`~modeling_dsv41.modeling_dsv41.DeepseekV41Model.gather_engram_rows`); sharded, a table
would be all-gathered whole at every forward of its layer. A trainable table is sharded with its layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..placement import ENGRAM_TABLE
from .offload import offload_checkpointed_inputs

try:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
except ImportError:  # torch built without distributed
    FSDPModule = MixedPrecisionPolicy = OffloadPolicy = fully_shard = None


# the dtypes the release stores weights in: FP8 e4m3 values, E8M0 scales, FP4 pairs packed in int8
QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8)


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules to shard one by one, innermost first: every instance of the model's ``_no_split_modules``."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    if not classes:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules: no FSDP units to shard")
    return [module for module in model.modules() if type(module).__name__ in classes]


# FSDP2 shards parameters of integer dtypes (the packed FP4 experts) from torch 2.12 on (pytorch PR 177948); before,
# fully_shard wraps every shard in a Parameter that requires gradients, which an integer tensor cannot
FSDP2_INTEGER_PARAMETERS = (2, 12)


def _check_fsdp2_takes(
    model: nn.Module, torch_version: str | None = None, whole_on_each_rank: bool = False
) -> set[nn.Parameter]:
    """The parameters to hold out of FSDP2 because this torch's FSDP2 cannot shard them; refuse, with the reason,
    a model where that would cost a whole model's experts per rank.

    Before torch 2.12 the modules holding integer parameters (the packed FP4 experts, with their E8M0 scales) are
    held out, each rank keeping them whole, where that costs nothing (``whole_on_each_rank``: one rank, or the
    backbone's experts split by expert over every rank) and for the DSpark draft blocks' experts (data parallel:
    replicated, a few layers' worth). ``torch_version``: the running torch's by default."""
    torch_version = torch_version or torch.__version__
    major, minor = (int(part) for part in torch_version.split(".")[:2])
    if (major, minor) >= FSDP2_INTEGER_PARAMETERS:
        return set()
    held, refused = set(), []
    for name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        integer = [key for key, p in own.items() if not (p.is_floating_point() or p.is_complex())]
        if not integer:
            continue
        if not (whole_on_each_rank or ".mtp." in f".{name}."):
            refused += [f"{name}.{key}".lstrip(".") for key in integer]
        trainable = [key for key, p in own.items() if p.requires_grad]
        if trainable:
            raise ValueError(
                f"{name}.{trainable[0]} trains next to the packed FP4 bytes that torch {torch_version}'s FSDP2 cannot "
                f"shard: freeze it, or upgrade torch to {'.'.join(map(str, FSDP2_INTEGER_PARAMETERS))}"
            )
        held.update(own.values())
    if refused:
        raise ValueError(
            f"torch {torch_version}'s FSDP2 cannot shard parameters of integer dtypes (here {refused[0]}, "
            f"{model.get_parameter(refused[0]).dtype}: the packed FP4 experts of a native load; "
            f"{len(refused)} in all): fully_shard makes every shard require gradients. On this torch shard_model "
            "keeps them whole on each process, out of FSDP2, where each process holds its experts whole anyway: "
            "one process, or expert_parallel_size equal to the number of processes. Otherwise upgrade torch to "
            f"{'.'.join(map(str, FSDP2_INTEGER_PARAMETERS))} or newer, or load with "
            "FineGrainedFP8Config(dequantize=True)"
        )
    return held


def fp32_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters the model keeps in fp32 whatever its dtype (see :func:`_kept_fp32`)."""
    return [p for p in _kept_fp32(model) if p.requires_grad]


def _kept_fp32(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter ``from_pretrained`` keeps fp32 (``_keep_in_fp32_modules_strict``, matched as transformers'
    loader matches it), frozen ones too: under LoRA the mHC and head weights do not train but still compute in fp32."""
    from transformers import PreTrainedModel
    from transformers.core_model_loading import build_glob_alternation

    base = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)  # under a PEFT wrapper too
    patterns = list(getattr(base, "_keep_in_fp32_modules_strict", None) or ())
    if not patterns:
        return []
    matcher = build_glob_alternation(patterns)[0]
    return [p for name, p in base.named_parameters() if matcher.search(name)]


def shard_model(
    model: nn.Module,
    mesh=None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    offload_policy: OffloadPolicy | None = None,
    expert_parallel_size: int = 1,
    offload_activations: bool = False,
) -> nn.Module:
    """``fully_shard`` the decoder layers and ViT blocks, then the whole model, in place; returns ``model``.

    Args:
        model: a DeepSeek-V4.1 model (or a PEFT wrapper around one) with its weights loaded.
        mesh: the 1-D data-parallel ``DeviceMesh`` (default: every rank of the default group).
        mp_policy: FSDP2 mixed precision; with a ``param_dtype`` other than fp32 the fp32-kept parameters stay
            fp32 and replicated, and the quantized modules (natively loaded FP8 / FP4) are units that cast
            nothing (see the module docstring). Frozen Engram tables are never sharded.
        reshard_after_forward, offload_policy: as in ``fully_shard`` (``CPUOffloadPolicy()`` keeps the shards,
            their gradients and the optimizer step on the CPU).
        expert_parallel_size: above 1, the routed experts of every decoder layer are split by expert over that many
            neighbouring ranks, tokens dispatched to them by all-to-all, and FSDP2-sharded over the rest of the world;
            everything else is sharded over every rank (see :mod:`~.expert_parallel`). Not with ``mesh``. Trains
            every weight of a model in plain precision, or LoRA adapters of the natively loaded release (its FP4
            experts split by expert as stored, frozen; their adapters' factors stay with the layer, over every rank).
        offload_activations: keep the inputs of the checkpointed decoder layers in host memory until their backward
            (:func:`~.offload.offload_checkpointed_inputs`; gradient checkpointing must be enabled).
    """
    if fully_shard is None or not dist.is_initialized():
        raise ValueError("shard_model needs torch.distributed initialized (init_process_group) before sharding")
    world = mesh.size() if mesh is not None else dist.get_world_size()
    whole = world == 1 or expert_parallel_size == world  # each rank holds its experts whole
    _check_fsdp2_takes(model, whole_on_each_rank=whole)  # refuses before anything changes
    if offload_activations:
        offload_checkpointed_inputs(model)
    mp_policy = mp_policy or MixedPrecisionPolicy()
    kwargs = {"reshard_after_forward": reshard_after_forward, "offload_policy": offload_policy or OffloadPolicy()}
    training, expert_units = None, []
    if expert_parallel_size > 1:
        training, expert_units = _shard_experts(model, mesh, mp_policy, expert_parallel_size, kwargs, whole)
        mesh = training.data
    held_out = _check_fsdp2_takes(model, whole_on_each_rank=whole)  # as they are now (split by expert)
    _move_to(held_out, _default_device())
    kwargs["mesh"] = mesh
    tables = frozen_engram_tables(model)
    own_units, replicated = [], set()
    if mp_policy.param_dtype not in (None, torch.float32):
        own_units, replicated = _split_fp32(model)
        sharded = {id(unit) for unit in expert_units}  # the FP4 experts, units of the expert-parallel mesh already
        own_units += [
            m
            for m in quantized_modules(model)
            if id(m) not in sharded and not (tables | held_out) & set(m.parameters(recurse=False))
        ]
    no_cast = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None, output_dtype=None)
    for unit in own_units:
        fully_shard(unit, mp_policy=no_cast, **kwargs)
    ignored = replicated | tables | held_out
    for unit in fsdp_units(model):
        fully_shard(unit, mp_policy=mp_policy, ignored_params=ignored, **kwargs)
    # the root's output is the model's: fp32 loss and logits (the LM head is fp32), whatever `output_dtype` says
    root_policy = dataclasses.replace(mp_policy, output_dtype=None)
    fully_shard(model, mp_policy=root_policy, ignored_params=ignored, **kwargs)
    group = None if mesh is None else mesh.get_group()
    for param in (p for p in replicated if p.requires_grad):  # frozen ones have no gradient to average
        param.register_post_accumulate_grad_hook(lambda p: _average_over_ranks(p.grad, group))
    if training is not None:
        from .expert_parallel import EPGroupFirstReduceScatter

        experts = {id(unit) for unit in expert_units}
        for unit in model.modules():  # every unit sharded over all ranks sums its gradients EP group first
            if isinstance(unit, FSDPModule) and id(unit) not in experts:
                unit.set_custom_reduce_scatter(EPGroupFirstReduceScatter(training))
                unit.set_force_sum_reduction_for_comms(True)
    return model


def _shard_experts(model: nn.Module, mesh, mp_policy: MixedPrecisionPolicy, ep_size: int, kwargs: dict, whole: bool):
    """Split the backbone's routed experts over the EP ranks and FSDP2-shard them over ``ep_shard``, each layer's
    experts their own unit, but those this torch's FSDP2 cannot shard (left whole on their EP rank, see
    :func:`_check_fsdp2_takes`); returns the :class:`~.expert_parallel.TrainingMesh` and the units sharded."""
    from .expert_parallel import (
        EP_SHARD,
        NATIVE_EXPERTS,
        check_expert_parallel_model,
        distribute_experts,
        training_mesh,
    )
    from .router_balancing import is_adapter_model

    if mesh is not None:
        raise ValueError(
            "shard_model builds the expert-parallel mesh itself: give expert_parallel_size or mesh, not both"
        )
    check_expert_parallel_model(model)
    if not is_adapter_model(model) and quantized_modules(model):
        raise ValueError(
            "the natively loaded FP8/FP4 weights are frozen: expert_parallel_size trains LoRA adapters on them "
            "(PEFT), or every weight of the model loaded with FineGrainedFP8Config(dequantize=True) (full fine-tuning)"
        )
    training = training_mesh(ep_size, _default_device().type)
    # the experts' inputs arrive in the layer's compute dtype; their fp32 routing weights must stay fp32; the FP4
    # bytes and E8M0 scales are kept as stored (nothing cast)
    policy = dataclasses.replace(mp_policy, cast_forward_inputs=False)
    as_stored = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None, output_dtype=None, cast_forward_inputs=False)
    units = distribute_experts(model, training)
    held_out = _check_fsdp2_takes(model, whole_on_each_rank=whole)
    units = [experts for experts in units if not held_out & set(experts.parameters())]
    for experts in units:
        native = isinstance(experts, NATIVE_EXPERTS)
        fully_shard(experts, mesh=training.experts[EP_SHARD], mp_policy=as_stored if native else policy, **kwargs)
        experts.set_gradient_divide_factor(float(dist.get_world_size()))  # the mean over every rank's micro-batch
        # gloo has no pre-multiplied sum: sum, then divide; not on a 1-rank ep_shard, where FSDP2 (torch 2.13) would
        # divide its copy of the gradient and then divide again
        experts.set_force_sum_reduction_for_comms(training.ep_shard_size > 1)
    return training, units


def load_sharded_weights(
    model: nn.Module, folder: str | Path, device: torch.device | str | None = None, adapter_seed: int = 0
) -> None:
    """Fill a model sharded by :func:`shard_model` while its parameters were on the meta device with a safetensors
    checkpoint: each rank reads only its shards, so no process ever holds the whole model. Frozen Engram tables
    (left out of sharding) are memory-mapped from the folder instead, as ``from_pretrained(..., engram_tables="mmap")``
    maps them: a node's processes share one page cache.

    - our layout (``save_pretrained(save_original_format=False)``, ``dsv41 convert``): ``torch.distributed.checkpoint``
      with its Hugging Face reader;
    - the released names with plain weights (``save_pretrained``'s default): the rows of the rank's shards read from
      the safetensors files through the layout conversions, as below;
    - DeepSeek's released storage, the model built by :func:`~modeling_dsv41.released.loading.empty_native_model`
      (FP8 Linears, FP4 experts kept as stored): the rows of the rank's shards read from the safetensors files,
      through the conversions ``from_pretrained`` applies (:mod:`~modeling_dsv41.released.sharded_reading`); the
      values equal those of ``from_pretrained`` followed by :func:`shard_model`, bit for bit. Engram tables kept FP8
      (``engram_table_dtype="fp8"``) are memory-mapped; dequantized ones are read whole by every rank.

    Build the model with its parameters on the meta device and its buffers real (accelerate's
    ``init_empty_weights()`` keeps buffers: the Engram hasher's are computed, not stored), shard it, then call this.
    The persistent buffers (router biases, the Engram token map) are read from the checkpoint too. PEFT adapters
    added on the meta device are initialized as PEFT initializes them (``reset_lora_parameters``), drawn from
    ``adapter_seed`` one whole factor at a time, so any number of processes starts from the same adapters.
    The model may also be unsharded (one process): then it holds every weight.
    """
    from ..placement import is_engram_table_tensor, memory_map_engram_tables
    from ..released.conversions import storage_conversions_registered
    from ..released.reading import stores_released_names, stores_scales

    if not any(p.is_meta for p in model.parameters()):
        raise ValueError("load_sharded_weights fills a model sharded on the meta device; this one holds its weights")
    device = torch.device(device) if device is not None else _default_device()
    released = stores_scales(folder)
    buffers = {name: b for name, b in model.named_buffers() if not b.is_meta}  # computed in __init__ (hasher)
    tables = {id(t) for t in frozen_engram_tables(model)}
    mapped = {
        name
        for name, t in model.named_parameters()
        if id(t) in tables and (not released or any(p.dtype == torch.float8_e4m3fn for p in _siblings(model, t)))
    }
    placeheld = {id(t) for name, t in model.named_parameters() if name in mapped}
    # Module.to_empty, but a frozen table becomes a host placeholder of its shape holding one element (an empty table
    # on the device would not fit) until it is mapped; a dequantized one is read whole into host memory
    model._apply(
        lambda t: (
            _placeholder(t) if id(t) in placeheld else torch.empty_like(t, device="cpu" if id(t) in tables else device)
        )
    )
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name])
    if mapped:
        memory_map_engram_tables(_pretrained(model), folder)
    if released or stores_released_names(folder):
        # the scales' conversions only for the storage (from_pretrained registers them the same way)
        model_type = _pretrained(model).config.model_type
        with storage_conversions_registered(model_type) if released else nullcontext():
            _read_released(model, folder, skip={id(t) for n, t in model.named_parameters() if n in mapped})
    else:
        _read_ours(model, folder, bool(mapped), is_engram_table_tensor)
    _initialize_adapters(model, adapter_seed)


def _pretrained(model: nn.Module) -> nn.Module:
    """The ``PreTrainedModel`` in ``model`` (itself, or the one under a PEFT wrapper)."""
    from transformers import PreTrainedModel

    return next(m for m in model.modules() if isinstance(m, PreTrainedModel))


def _siblings(model: nn.Module, param: nn.Parameter) -> list[nn.Parameter]:
    """The parameters of the module holding ``param`` (an Engram table: its weight and, kept FP8, its scales)."""
    module = next(m for m in model.modules() if any(p is param for p in m.parameters(recurse=False)))
    return list(module.parameters(recurse=False))


def _read_ours(model: nn.Module, folder, tables_mapped: bool, is_table: Callable[[str], bool]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    state = {k: v for k, v in get_model_state_dict(model).items() if not (tables_mapped and is_table(k))}
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(folder)))
    set_model_state_dict(model, state, options=StateDictOptions(strict=not tables_mapped))


def _read_released(model: nn.Module, folder, skip: set[int]) -> None:
    """Each rank's shards of the released checkpoint; every base parameter must be found there."""
    from ..released.sharded_reading import read_released_shards, unwrapped_state

    base = _pretrained(model)
    adapters = {id(p) for p in _adapter_parameters(model)}
    wanted = {n: t for n, t in unwrapped_state(base).items() if id(t) not in skip and id(t) not in adapters}
    filled = read_released_shards(base, folder, wanted)
    parameters = {id(p) for p in base.parameters()}
    missing = sorted(n for n, t in wanted.items() if n not in filled and id(t) in parameters)
    if missing:
        raise ValueError(f"{folder} does not store {len(missing)} parameters of the model: {', '.join(missing[:8])}")


def _adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters PEFT's adapter layers add (``lora_A``, ``lora_B``, ...), not those of the layers they wrap."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return []
    found = {}  # id → parameter: nested wrappers (both expert parameters adapted) list the inner one's again
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            wrapped = {id(p) for p in module.get_base_layer().parameters()}
            found.update({id(p): p for p in module.parameters() if id(p) not in wrapped})
    return list(found.values())


@torch.no_grad()
def _initialize_adapters(model: nn.Module, seed: int) -> None:
    """PEFT's own initialization of every adapter (``reset_lora_parameters``), on whole factors on the CPU drawn from
    ``seed`` in module order, then each rank's shard copied in: the same adapters on any number of processes."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return
    from torch.distributed.tensor import DTensor

    from ..released.sharded_reading import local_box

    configs = getattr(model, "peft_config", None) or {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for layer in (m for m in model.modules() if isinstance(m, BaseTunerLayer)):
            for adapter in getattr(layer, "lora_A", {}):
                factors = [layer.lora_A[adapter], layer.lora_B[adapter]]
                sharded = [f.weight for f in factors]
                for factor, weight in zip(factors, sharded):
                    factor.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype), requires_grad=False)
                init = getattr(configs.get(adapter), "init_lora_weights", True)
                layer.reset_lora_parameters(adapter, init)
                for factor, weight in zip(factors, sharded):
                    whole = factor.weight.data
                    factor.weight = weight
                    local = weight.to_local() if isinstance(weight, DTensor) else weight
                    box = local_box(weight)
                    local.copy_(whole[tuple(slice(a, b) for a, b in box)])


@torch.no_grad()
def _move_to(params: set[nn.Parameter], device: torch.device) -> None:
    """Parameters kept out of FSDP2 onto the device it computes on (FSDP2 moves only those it manages)."""
    for param in params:
        if not param.is_meta and param.device != device:
            param.data = param.data.to(device)


def _placeholder(tensor: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)


def _default_device() -> torch.device:
    if (dist.is_initialized() and dist.get_backend() == "gloo") or not torch.accelerator.is_available():
        return torch.device("cpu")
    return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())


@torch.no_grad()
def clip_sharded_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (2-norm) for sharded gradients, with a norm that does not depend on how they
    are sharded: each rank's sum of squares of its shards in fp64 (each square exact), summed over the ranks that
    split them (a replicated gradient counted once), square-rooted and rounded once to fp32. A run on another mesh
    (4 processes resumed on 2) then clips by the same factor, to the last bit. Returns the norm before clipping."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    by_groups: dict[tuple, torch.Tensor] = {}
    for grad in grads:
        groups = ()
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh
            groups = tuple(mesh.get_group(i) for i, pl in enumerate(grad.placements) if not pl.is_replicate())
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        square = local.detach().double().square().sum()
        by_groups[groups] = by_groups.get(groups, 0) + square
    total = torch.zeros((), dtype=torch.float64)
    for groups, squares in by_groups.items():
        squares = torch.as_tensor(squares, dtype=torch.float64)
        for group in groups:
            dist.all_reduce(squares, group=group)
        total = total + squares.cpu()
    norm = total.sqrt().float()
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as clip_grads_with_norm_ computes it
    for grad in grads:
        (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(coefficient.to(grad.device))
    return norm


def quantized_modules(model: nn.Module) -> list[nn.Module]:
    """The modules holding parameters in a stored quantized dtype (FP8 e4m3 weights, E8M0 scales, packed FP4 bytes):
    the natively loaded ``FP8Linear`` / ``FP8Experts``, and FP8 Engram tables."""
    return [
        module
        for module in model.modules()
        if any(p.dtype in QUANTIZED_DTYPES for p in module.parameters(recurse=False))
    ]


def frozen_engram_tables(model: nn.Module) -> set[nn.Parameter]:
    """The parameters of the Engram tables that do not train (FP8 ones always; any under LoRA)."""
    return {
        param
        for name, module in model.named_modules()
        if ENGRAM_TABLE.search(name)
        for param in module.parameters()
        if not param.requires_grad
    }


def _split_fp32(model: nn.Module) -> tuple[list[nn.Module], set[nn.Parameter]]:
    """fp32-kept parameters as (modules made only of them: their own fp32 units, the rest: replicated)."""
    kept = set(_kept_fp32(model))
    units, replicated = [], set()
    for module in model.modules():
        own = list(module.parameters(recurse=False))
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


__all__ = [
    "QUANTIZED_DTYPES",
    "clip_sharded_grad_norm_",
    "fp32_parameters",
    "load_sharded_weights",
    "frozen_engram_tables",
    "fsdp_units",
    "quantized_modules",
    "shard_model",
]
