"""Where DeepSeek-V4.1's weights go: device maps that keep the Engram tables out of the decoder layers, and the plan
``dsv41 inspect --devices`` prints.

The two Engram tables of DeepSeek-V4.1-Flash hold ~94 GiB each (FP8 with E8M0 scales), about ten times a decoder
layer. Each layer reads only the rows its hash ids address (:meth:`~.engram.DeepseekV41Engram.lookup`), so a table
can live anywhere: on an accelerator, in host memory (pinned for asynchronous copies) or memory-mapped from the
checkpoint. Left inside its no-split decoder layer, a table drags the whole layer to CPU offload as soon as it fits
no accelerator. Here a device map is planned with transformers' own :func:`infer_auto_device_map`, either counting
the tables with their layers (they go to accelerators when everything fits there) or leaving them out of the map
(they stay in host memory, unhooked, and only gathered rows travel).

* :func:`plan_device_map` plans for a model (on the meta device to plan a config: :func:`meta_instance`): per-device
  weights, host bytes of the tables, decode cache bytes per token. With ``native=True`` weights count at the released
  storage (FP8 Linears, FP4 experts and FP8 tables with their E8M0 scales), as native loading holds them.
* ``from_pretrained``'s ``engram_tables=`` argument (``"auto"``, an accelerator, ``"cpu"``, ``"pinned"`` or
  ``"mmap"``): :func:`requested_table_placement`, :func:`engram_device_map` (a string ``device_map`` goes through the
  planner) and :func:`place_loaded_engram_tables`.
* :func:`place_engram_tables` and :func:`memory_map_engram_tables` move the tables of a loaded model.
* :func:`gather_engram_rows`: the forward's Engram lookups, each from wherever its table lives to where its layer runs
  (:func:`execution_device`).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

from configuration.configuration_dsv41 import DeepseekV41Config

from .codec import RELEASED_BLOCK_SIZE
from .safetensors_files import SAFETENSORS_DTYPES, mapped_tensor, tensor_entries

# the tables, as module names (the checkpoint keeps them inside their layers: layers.{i}.engram.embed.*)
ENGRAM_TABLE = re.compile(r"(^|\.)layers\.\d+\.engram\.embed$")
# host placements of the tables (anything else is a device)
HOST_PLACEMENTS = ("cpu", "pinned", "mmap")
# device_map strings transformers plans itself (the rest name one device)
PLANNED_DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")

# Released storage (fixtures README §7): what each of our parameters occupies per element, scales included.
# Dense Linears: FP8 e4m3 + one E8M0 byte per 32x32 block. Routed experts: packed FP4 (half a byte) + one E8M0 byte
# per row and 32 columns. Engram tables: FP8 + one E8M0 byte per row and 32 columns.
_FP8_BLOCK_LINEARS = re.compile(
    r"(^|\.)(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|engram\.wkv"
    r"|main_proj)\.weight$"
)
_FP4_EXPERTS = re.compile(r"(^|\.)(layers|mtp)\.\d+\.ffn\.experts\.(gate_up_proj|down_proj)$")
_FP8_TABLE_PARTS = re.compile(r"(^|\.)layers\.\d+\.engram\.embed\.(weight|scale)$")


def released_storage_bytes(name: str, param: torch.Tensor) -> float:
    """Bytes of ``name`` as the release stores it (and native loading holds it); other tensors as they are."""
    if _FP8_BLOCK_LINEARS.search(name):
        rows, columns = param.numel() // param.shape[-1], param.shape[-1]
        return param.numel() + math.ceil(rows / RELEASED_BLOCK_SIZE) * math.ceil(columns / RELEASED_BLOCK_SIZE)
    if _FP4_EXPERTS.search(name):
        return param.numel() * (0.5 + 1 / RELEASED_BLOCK_SIZE)
    if _FP8_TABLE_PARTS.search(name):
        if name.endswith(".scale"):  # an FP8 table module already holds its scales: counted as they are
            return param.numel() * param.element_size()
        if param.dtype == torch.float8_e4m3fn:
            return param.numel()
        return param.numel() * (1 + 1 / RELEASED_BLOCK_SIZE)
    return param.numel() * param.element_size()


# stored FP8 but dequantized by native loading: the block-diagonal `wo_a` and Engram `wkv`
# (released/native_precision.py)
_DEQUANTIZED_ON_LOAD = re.compile(r"(^|\.)(layers|mtp)\.\d+\.(attn\.wo_a|engram\.wkv)\.weight$")


def native_held_bytes(name: str, param: torch.Tensor) -> float:
    """Bytes of ``name`` once loaded natively: the released storage, but for the FP8 Linears the load dequantizes
    (held in ``param``'s dtype)."""
    if _DEQUANTIZED_ON_LOAD.search(name):
        return param.numel() * param.element_size()
    return released_storage_bytes(name, param)


def is_engram_table_tensor(name: str) -> bool:
    return bool(ENGRAM_TABLE.search(name.rsplit(".", 1)[0]))


class TensorSizes:
    """Sizes transformers' device-map planning asks for (``param_element_size``, the hook its quantizers implement):
    the released storage when ``native``, the tensors' own dtypes otherwise; ``0`` for the Engram tables when they
    stay off the map (``tables_on_map=False``)."""

    def __init__(self, native: bool, tables_on_map: bool):
        self.native, self.tables_on_map = native, tables_on_map

    def nbytes(self, name: str, param: torch.Tensor) -> float:
        return released_storage_bytes(name, param) if self.native else param.numel() * param.element_size()

    def param_element_size(self, model: nn.Module, name: str, param: torch.Tensor) -> float:
        if not self.tables_on_map and is_engram_table_tensor(name):
            return 0
        return self.nbytes(name, param) / max(param.numel(), 1)


# ---------------------------------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class DevicePlan:
    """A device map and what it costs. ``device_map`` leaves out the tables kept in host memory."""

    device_map: dict[str, int | str]
    weights: dict[int | str, int] = field(default_factory=dict)  # bytes per device (tables on the map included)
    engram_tables: dict[int, int | str] = field(default_factory=dict)  # Engram layer id → device, or "host"
    engram_host_bytes: int = 0
    cache_bytes_per_token: float = 0.0

    @property
    def fits(self) -> bool:
        """Every weight on an accelerator (the tables may be in host memory: they are read row by row)."""
        return all(device not in ("cpu", "disk") for device in self.device_map.values())


def _expand_without(device_map: dict, model: nn.Module, excluded: str) -> dict:
    """``device_map`` with module ``excluded`` off it: the entry covering it is replaced by its parts (submodules,
    own parameters and buffers) on the same device, down to ``excluded``, which is dropped."""
    device_map = dict(device_map)
    while True:
        covering = [key for key in device_map if key == "" or excluded == key or excluded.startswith(key + ".")]
        if not covering:
            return device_map
        key = max(covering, key=len)
        device = device_map.pop(key)
        if key == excluded:
            return device_map
        module = model.get_submodule(key)
        prefix = f"{key}." if key else ""
        parts = [name for name, _ in module.named_children()]
        parts += [name for name, _ in module.named_parameters(recurse=False)]
        parts += [name for name, _ in module.named_buffers(recurse=False)]
        device_map.update({prefix + name: device for name in parts})


def engram_tables_off_map(device_map: dict, model: nn.Module) -> dict:
    """``device_map`` with every Engram table left out (it then loads in host memory and is not hooked)."""
    for name, module in model.named_modules():
        if ENGRAM_TABLE.search(name):
            device_map = _expand_without(device_map, model, name)
    return device_map


@contextmanager
def _quiet_about_absent_devices(max_memory):
    """Planning for devices this machine lacks (``dsv41 inspect --devices``): accelerate warns once per device."""
    logger = logging.getLogger("accelerate.utils.modeling")
    level = logger.level
    if max_memory:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _infer(model, max_memory, sizes: TensorSizes, strategy: str) -> dict:
    with _quiet_about_absent_devices(max_memory):
        return _infer_device_map(model, max_memory, sizes, strategy)


def _infer_device_map(model, max_memory, sizes: TensorSizes, strategy: str) -> dict:
    from transformers.integrations.accelerate import get_balanced_memory, get_max_memory, infer_auto_device_map

    no_split = list(model._no_split_modules or [])
    if strategy == "sequential":
        budget = get_max_memory(dict(max_memory) if max_memory else None)
    else:
        budget = get_balanced_memory(
            model,
            max_memory=dict(max_memory) if max_memory else None,
            no_split_module_classes=no_split,
            hf_quantizer=sizes,
            low_zero=strategy == "balanced_low_0",
        )
    return infer_auto_device_map(model, max_memory=budget, no_split_module_classes=no_split, hf_quantizer=sizes)


def meta_instance(config: DeepseekV41Config, cls: type, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """``cls`` of ``config`` with every tensor on the meta device: modules kept in fp32 stay fp32, the rest take
    ``dtype``. (:func:`~modeling_dsv41.cli.inspection.build_meta_model` defaults ``cls`` to the causal LM: this module
    is imported by the model's, so it cannot name it.)"""
    from transformers import initialization as init

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"), init.no_init_weights():
            return cls(config)
    finally:
        torch.set_default_dtype(previous)


def plan_device_map(
    model: nn.Module,
    max_memory: dict[int | str, int] | None = None,
    engram_tables: str | int = "auto",
    native: bool = False,
    strategy: str = "auto",
) -> DevicePlan:
    """Place ``model`` (on the meta device for a plan without memory: :func:`meta_instance`) on the devices of
    ``max_memory`` (bytes per device, as transformers takes it; ``None`` for the visible devices).

    ``engram_tables``: ``"auto"`` counts the tables with their layers and keeps them there if every weight then fits
    an accelerator, else plans again with the tables in host memory; ``"host"`` (or ``"cpu"``/``"pinned"``/``"mmap"``)
    leaves them off the map; a device puts them on it, on top of what ``max_memory`` grants that device. ``native``
    counts released storage bytes.
    """
    if strategy not in PLANNED_DEVICE_MAPS:
        raise ValueError(f"strategy must be one of {PLANNED_DEVICE_MAPS}, got {strategy!r}")
    if engram_tables == "auto":
        device_map = _infer(model, max_memory, TensorSizes(native, tables_on_map=True), strategy)
        host = any(device in ("cpu", "disk") for device in device_map.values())
    else:
        host = engram_tables in ("host", *HOST_PLACEMENTS)
        device_map = None
    if host or device_map is None:
        device_map = _infer(model, max_memory, TensorSizes(native, tables_on_map=False), strategy)
        device_map = engram_tables_off_map(device_map, model)
        if not host:  # tables on one named device
            device_map.update({name: engram_tables for name, _ in model.named_modules() if ENGRAM_TABLE.search(name)})
    return _describe(model, device_map, TensorSizes(native, tables_on_map=True))


def _describe(model: nn.Module, device_map: dict, sizes: TensorSizes) -> DevicePlan:
    from transformers.integrations.accelerate import expand_device_map

    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    placed = expand_device_map({k: v for k, v in device_map.items()}, list(tensors))
    plan = DevicePlan(device_map=device_map)
    table_modules = [name for name, _ in model.named_modules() if ENGRAM_TABLE.search(name)]
    for name, tensor in tensors.items():
        nbytes = int(sizes.nbytes(name, tensor))
        table = next((t for t in table_modules if name.startswith(t + ".")), None)
        covered = any(name == key or name.startswith(key + ".") for key in device_map) or "" in device_map
        if table is not None and not covered:
            plan.engram_host_bytes += nbytes
            continue
        plan.weights[placed[name]] = plan.weights.get(placed[name], 0) + nbytes
    for table in table_modules:
        layer_id = int(table.split("layers.")[-1].split(".")[0])
        covering = [key for key in device_map if key == "" or table == key or table.startswith(key + ".")]
        plan.engram_tables[layer_id] = device_map[max(covering, key=len)] if covering else "host"
    plan.cache_bytes_per_token = cache_bytes_per_token(model.config, model.dtype)
    return plan


def cache_bytes_per_token(config: DeepseekV41Config, dtype: torch.dtype = torch.bfloat16) -> float:
    """Bytes a :class:`~.cache.DeepseekV41Cache` grows by per token of context, per sequence: each KV source keeps
    one compressed K=V row (``head_dim``) per ``r`` tokens, and each key owner (a KV source with an indexer) one
    index key (``index_head_dim``) per compressed row. The sliding window, the open groups and the Engram history
    are a fixed size per sequence, not counted here."""
    text = config.get_text_config()
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = 0.0
    for spec in text.layer_plan:
        if not spec.is_kv_source:
            continue
        total += text.head_dim * itemsize / spec.compress_ratio
        if spec.is_index_source:
            total += text.index_head_dim * itemsize / spec.compress_ratio
    return total


def _bytes(n: float) -> str:
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or suffix == "TiB":
            return f"{n:.1f} {suffix}" if suffix != "B" else f"{n:.0f} B"
        n /= 1024


def format_plan(plan: DevicePlan, max_memory: dict[int | str, int], native: bool) -> str:
    """The placement table ``dsv41 inspect --devices`` prints."""
    storage = "released storage (FP8 Linears, FP4 experts, FP8 Engram tables)" if native else "loaded dtypes"
    lines = [
        f'Placement with device_map="auto" ({storage}):',
        f"{'device':<10}{'weights':>14}{'capacity':>14}{'used':>8}",
    ]
    for device in sorted(max_memory, key=lambda d: (isinstance(d, str), 0 if isinstance(d, str) else d, str(d))):
        used = plan.weights.get(device, 0)
        if isinstance(device, str) and not used:
            continue
        lines.append(
            f"{device!s:<10}{_bytes(used):>14}{_bytes(max_memory[device]):>14}{used / max_memory[device]:>8.0%}"
        )
    for device, used in plan.weights.items():
        if device not in max_memory:
            lines.append(f"{device!s:<10}{_bytes(used):>14}{'-':>14}{'':>8}")
    on_devices = sum(plan.weights.values())
    lines.append(
        f"weights in all: {_bytes(on_devices + plan.engram_host_bytes)} ({_bytes(on_devices)} placed, "
        f"{_bytes(plan.engram_host_bytes)} of Engram tables in host memory)"
    )
    tables = ", ".join(
        f"layer {layer}: {where if where == 'host' else f'device {where}'}"
        for layer, where in plan.engram_tables.items()
    )
    if plan.engram_tables:
        lines.append(f"Engram tables ({tables}); host memory for Engram: {_bytes(plan.engram_host_bytes)}")
    lines.append(
        "all weights on accelerators" if plan.fits else "DOES NOT FIT: some weights would be offloaded to cpu/disk"
    )
    lines.append(
        f"decode cache: {_bytes(plan.cache_bytes_per_token)} per token of context per sequence "
        f"({_bytes(plan.cache_bytes_per_token * 2**20)} per 1M tokens), plus a fixed sliding window per sequence"
    )
    return "\n".join(lines)


# parameter styles of transformers' TP and EP plans that split a parameter (the rest replicate it or hook a forward)
_SPLITTING_STYLES = (
    "colwise",
    "colwise_gather_output",
    "colwise_rep",
    "rowwise",
    "rowwise_split_input",
    "rowwise_rep",
    "packed_colwise",
    "packed_rowwise",
    "embedding_rowwise",
    "embedding_colwise",
    "grouped_gemm",
)


@dataclass
class ParallelPlan:
    """What one rank holds under ``DistributedConfig(tp_size=tp, ep_size=ep)``: each parameter's bytes on the rank
    (its part when a plan splits it), the Engram tables (whole on every rank, kept off the accelerators) apart."""

    tp_size: int
    ep_size: int
    tensors: dict[str, tuple[float, bool]] = field(default_factory=dict)  # name → (bytes on this rank, split?)
    engram_table_bytes: float = 0.0

    @property
    def per_rank_bytes(self) -> float:
        return sum(nbytes for nbytes, _ in self.tensors.values())


def plan_parallel(model: nn.Module, tp_size: int = 1, ep_size: int = 1, native: bool = True) -> ParallelPlan:
    """Per-rank weights of ``model`` (meta or not) under the config's TP plan (``tp_size`` ranks) and EP plan
    (``ep_size``, whose rules win for the experts), sized by the released storage when ``native``. The sizes are
    checked as loading checks them (:func:`~modeling_dsv41.parallel.check_parallel_load`: whole scale blocks, whole
    experts)."""
    from transformers.distributed import DistributedConfig

    from .parallel import check_parallel_load
    from .upstream import _get_parameter_plan

    check_parallel_load(
        model.config, DistributedConfig(tp_size=tp_size, ep_size=ep_size), native=False, released=native
    )
    rules = [(ep_size, model.ep_plan if ep_size > 1 else {}), (tp_size, model.tp_plan if tp_size > 1 else {})]
    plan = ParallelPlan(tp_size=tp_size, ep_size=ep_size)
    for name, param in model.named_parameters():
        nbytes = native_held_bytes(name, param) if native else param.numel() * param.element_size()
        if is_engram_table_tensor(name):
            plan.engram_table_bytes += nbytes
            continue
        ways = next(
            (size for size, plan_rules in rules if _get_parameter_plan(name, plan_rules) in _SPLITTING_STYLES), 1
        )
        plan.tensors[name] = (nbytes / ways, ways > 1)
    return plan


# ---------------------------------------------------------------------------------------------------------------------
# Moving the tables of a loaded model
# ---------------------------------------------------------------------------------------------------------------------


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (under pipeline parallelism, this stage's: the others are placeholders)."""
    base = getattr(model, "base_model", model)
    return [layer for layer in base.layers if not isinstance(layer, PipelineIdentityLayer)]


def _engram_blocks(model: nn.Module):
    return [layer.engram for layer in _decoder_layers(model) if layer.engram is not None]


def place_engram_tables(model: nn.Module, where: str | torch.device) -> None:
    """Move every Engram table to ``where``: a device, ``"cpu"`` or ``"pinned"`` (page-locked host memory, whose
    gathered rows copy to an accelerator asynchronously). The rest of the model stays put."""
    if where == "pinned" and not torch.accelerator.is_available():
        raise ValueError("engram_tables='pinned' needs an accelerator to copy to; use 'cpu' on this machine")
    for engram in _engram_blocks(model):
        for param in engram.embed.parameters():
            if where == "pinned":
                param.data = param.data if param.data.is_pinned() else param.data.cpu().pin_memory()
            else:
                param.data = param.data.to(where)


def memory_map_engram_tables(model: nn.Module, checkpoint: str | Path) -> None:
    """Replace every Engram table of ``model`` by a memory map of the checkpoint folder ``checkpoint`` (safetensors,
    ours or the release's names): pages are read from disk only where hash ids point, and stay reclaimable page
    cache. The table must be stored as the model holds it (plain weights in our checkpoints; FP8 with scales for a
    released one loaded with ``engram_table_dtype="fp8"``)."""
    entries = tensor_entries(sorted(Path(checkpoint).glob("*.safetensors")))
    for layer in _decoder_layers(model):
        if layer.engram is None:
            continue
        for part, param in layer.engram.embed.named_parameters():
            candidates = [f"{prefix}layers.{layer.layer_id}.engram.embed.{part}" for prefix in ("model.", "")]
            key = next((k for k in candidates if k in entries), None)
            if key is None:
                raise ValueError(f"{checkpoint} holds no {candidates[0]}: cannot memory-map that Engram table")
            path, data_start, entry = entries[key]
            dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
            if tuple(entry["shape"]) != tuple(param.shape) or dtype != param.dtype:
                raise ValueError(
                    f"{key} is stored as {dtype or entry['dtype']} {tuple(entry['shape'])} but the model holds "
                    f"{param.dtype} {tuple(param.shape)}: only a table stored as it is held can be memory-mapped"
                )
            param.data = mapped_tensor(path, data_start, entry)


def hook_split_layers(model: nn.Module) -> None:
    """A decoder layer whose table is off a multi-device map has no entry of its own, hence no accelerate hook to
    bring its inputs to its device: give it one (its parts all sit on one device)."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    if len(set((getattr(model, "hf_device_map", None) or {}).values())) < 2:
        return  # not dispatched: no hooks anywhere
    for layer in _decoder_layers(model):
        if layer.engram is not None and not hasattr(layer, "_hf_hook"):
            hook = AlignDevicesHook(
                execution_device=layer.hc_attn_fn.device, skip_keys=model._skip_keys_device_placement
            )
            add_hook_to_module(layer, hook)


# ---------------------------------------------------------------------------------------------------------------------
# from_pretrained(..., engram_tables=...)
# ---------------------------------------------------------------------------------------------------------------------


def _check_placement(engram_tables) -> str | torch.device:
    if engram_tables in ("auto", *HOST_PLACEMENTS):
        return engram_tables
    try:
        return torch.device(engram_tables)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"engram_tables must be 'auto', 'cpu', 'pinned', 'mmap' or a device, got {engram_tables!r}"
        ) from None


def requested_table_placement(engram_tables, kwargs: dict, source) -> str | torch.device | None:
    """Where ``from_pretrained(source, engram_tables=engram_tables, **kwargs)`` puts the Engram tables: ``None`` when
    they load with their layers like any weight (no ``engram_tables``, and no device map to plan, or one transformers
    plans with a ``quantization_config``), else the placement, checked (``"auto"`` with a planned device map).

    ``engram_tables``: ``"auto"`` (default with a planned ``device_map``): on accelerators with their layers when every
    weight fits there, else in host memory; a device (``"cuda:0"``); ``"cpu"``; ``"pinned"`` (page-locked host memory:
    asynchronous row copies); ``"mmap"``: memory-mapped from the local checkpoint folder, read from disk only where
    addressed (the table must be stored as the model holds it; the load itself still reads it once into memory before
    the map replaces it)."""
    device_map = kwargs.get("device_map")
    planned = isinstance(device_map, str) and device_map in PLANNED_DEVICE_MAPS
    if engram_tables is None and (not planned or kwargs.get("quantization_config") is not None):
        return None
    placement = _check_placement("auto" if engram_tables is None else engram_tables)
    if placement == "mmap" and not Path(str(source)).is_dir():
        raise ValueError("engram_tables='mmap' maps the tables from a local checkpoint folder; download it first")
    return placement


def engram_device_map(
    cls: type, source, placement: str | torch.device, kwargs: dict, hub_kwargs: dict, native: Callable[[], bool]
) -> dict:
    """The device map ``cls.from_pretrained(source, **kwargs)`` loads with: planned by :func:`plan_device_map` (with
    the loaded dtypes; ``native()`` says whether the released FP8/FP4 weights stay as stored, sized so), or the
    caller's with the tables moved off it (host) or onto ``placement`` (a device). Tables kept in host memory stay off
    the map: they are not offloaded by accelerate, and only the rows the hash ids address reach the accelerators."""
    from transformers import PreTrainedConfig
    from transformers.integrations.accelerate import check_and_set_device_map

    config = kwargs.get("config")
    if not isinstance(config, PreTrainedConfig):
        config = cls.config_class.from_pretrained(config or source, **hub_kwargs)
    dtype = kwargs.get("dtype")
    probe = meta_instance(config, cls, dtype if isinstance(dtype, torch.dtype) else torch.bfloat16)
    device_map = check_and_set_device_map(kwargs["device_map"])
    tables = "auto" if placement == "auto" else "host" if placement in HOST_PLACEMENTS else str(placement)
    if isinstance(device_map, str):
        return plan_device_map(
            probe, kwargs.get("max_memory"), tables, native=native(), strategy=device_map
        ).device_map
    if placement == "auto":
        return device_map
    device_map = engram_tables_off_map(device_map, probe)
    if tables != "host":
        device_map.update({name: tables for name, _ in probe.named_modules() if ENGRAM_TABLE.search(name)})
    return device_map


def place_loaded_engram_tables(
    model: nn.Module, placement: str | torch.device, device_map_given: bool, source
) -> None:
    """Put the tables of a model just loaded where ``placement`` says, if its device map did not already."""
    if placement == "pinned" or (isinstance(placement, torch.device) and not device_map_given):
        place_engram_tables(model, placement)
    elif placement == "mmap":
        memory_map_engram_tables(model, source)


# ---------------------------------------------------------------------------------------------------------------------
# The forward's lookups
# ---------------------------------------------------------------------------------------------------------------------


def execution_device(layer: nn.Module, fallback: torch.Tensor) -> torch.device:
    """Where ``layer`` computes: accelerate's execution device when it dispatched the model, else the device of the
    layer's weights outside its Engram table (the table may live elsewhere)."""
    hook = getattr(layer, "_hf_hook", None)
    if getattr(hook, "execution_device", None) is not None:
        return torch.device(hook.execution_device)  # an int names an accelerator index
    device = layer.hc_attn_fn.device
    return fallback.device if device.type == "meta" else device


def gather_engram_rows(layers: list[nn.Module], hash_ids: torch.Tensor | None) -> dict[int, torch.Tensor]:
    """The rows every Engram layer of ``layers`` reads, gathered before the first layer runs: layer id →
    ``[B, S, n_cols·d]``.

    The hash ids follow from the input ids alone, so all the lookups are issued up front, each from wherever its table
    lives (an accelerator, host memory, pinned host memory or a memory-mapped checkpoint) to the device its layer runs
    on. Only the addressed rows move; from a pinned table the copy is asynchronous for the host, which goes on to
    launch the layers (it is queued on the current stream, ahead of them: no side stream). Cost: the rows of every
    Engram layer are held at once, ``n_engram_layers × n_cols × engram_head_dim`` values per token (24 KiB per token in
    bf16 for DeepSeek-V4.1-Flash). A table whose weights exist whole only while its layer runs is looked up by its
    layer instead: offloaded by accelerate (on the meta device until then) or sharded by FSDP2 (a DTensor shard until
    the layer's pre-forward all-gather).
    """
    if hash_ids is None:
        return {}
    rows = {}
    for layer in layers:
        engram = layer.engram
        if engram is None or engram.table_device.type == "meta" or isinstance(engram.embed.weight, DTensor):
            continue
        rows[layer.layer_id] = engram.lookup(hash_ids[:, :, engram.hash_index], execution_device(layer, hash_ids))
    return rows


__all__ = [
    "DevicePlan",
    "ENGRAM_TABLE",
    "ParallelPlan",
    "TensorSizes",
    "meta_instance",
    "cache_bytes_per_token",
    "engram_device_map",
    "engram_tables_off_map",
    "execution_device",
    "gather_engram_rows",
    "hook_split_layers",
    "format_plan",
    "memory_map_engram_tables",
    "place_engram_tables",
    "place_loaded_engram_tables",
    "requested_table_placement",
    "plan_device_map",
    "native_held_bytes",
    "plan_parallel",
    "released_storage_bytes",
]
