"""PEFT LoRA adapters of our model written in the layout vLLM's DeepSeek-V4 LoRA serves, and read back
(``dsv41 export --format vllm-lora``, docs/serving.md).

vLLM strips ``base_model.model.`` from an adapter's keys and finds each module by the release's checkpoint names:
``layers.{i}.attn.wq_a``, and every routed expert as its own ``layers.{L}.ffn.experts.{e}.w1`` /
``w3`` / ``w2`` with the factors of an ``[out, in]`` matrix. It takes no LoRA on the token embedding or the LM head,
so an adapter of those is refused. Inside our backbone the module names already are the
release's (docs/design.md §3) but the experts are fused: PEFT adapts ``gate_up_proj`` [E, 2·I, D] and ``down_proj``
[E, D, I] (``target_parameters``) with one factor pair per tensor, lora_A [r·E, in] whose expert e is
``A.view(E, r, in)[e]`` and lora_B [out, r·E] whose expert e is ``B.view(out, r, E)[..., e]`` (PEFT's
``ParamWrapper.get_delta_weight``); expert e's ``w1`` is rows [:I] of its gate_up B and ``w3`` rows [I:], both with
its A (``gate_up_proj`` holds each expert's ``w1`` rows, then its ``w3`` rows).

vLLM reads ``r``, ``lora_alpha``, ``use_rslora`` and ``target_modules`` and applies one scale to every module, so a
module whose PEFT scale differs (``rank_pattern`` / ``alpha_pattern``) has that ratio folded into its lora_B. It
stacks the modules it fuses (``wq_a`` + ``wkv``, ``w1`` + ``w3``, the compressor's ``wkv`` + ``wgate``) and a layer's
routed experts into one LoRA slot, which takes one rank. It refuses DoRA and ``modules_to_save`` and skips the DSpark
draft head (``mtp.*``), which the export leaves out with a warning.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from peft.tuners.lora import LoraLayer, ParamWrapper
from safetensors.torch import load_file, save_file
from torch import nn

from configuration import DeepseekV41Config

from ..modeling_dsv41 import DeepseekV41ForCausalLM
from ..placement import meta_instance
from ..released.native_precision import quantization_method

logger = logging.getLogger(__name__)

FORMAT = "vllm-deepseek-v4-lora"
FORMAT_VERSION = 1
FORMAT_FIELD = "dsv41_export"  # the extra adapter_config.json field naming the format (vLLM ignores unknown fields)
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_SKIPPED_PREFIX = "mtp."  # vLLM's lora_skip_prefixes: the DSpark draft head
# what vLLM fuses with its siblings of the same parent (packed_modules_mapping: attention wq_a + wkv, the
# compressor's wkv + wgate, w1 + w3) into one LoRA slot, of one rank
_PACKED = ("wq_a", "wkv", "wgate", "w1", "w3")
_EXPERT_KEY = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])$")
# ours → vLLM's: modules vLLM's DeepSeek-V4 model takes no LoRA on (no `embedding_modules`, and its
# VocabParallelEmbedding / ParallelLMHead are not the Linear layers it adapts; its weights mapper renames only
# `embed.weight` / `head.weight`)
_UNSERVED = {"model.embed": "model.embed_tokens", "lm_head": "lm_head"}


@dataclass
class _Factors:
    """One adapted module of our model: its factors, rank and PEFT scale; ``parameter`` names the fused experts'
    tensor for a ``target_parameters`` adapter."""

    name: str  # ours, e.g. "model.layers.0.attn.wq_a", "lm_head", "model.layers.0.ffn.experts"
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    rank: int
    scaling: float
    parameter: str | None = None


def export_serving_adapter(
    adapter: PeftModel | str | os.PathLike,
    out_dir: str | os.PathLike,
    base: DeepseekV41Config | None = None,
) -> dict[str, int | list[str]]:
    """Write ``adapter`` (a PEFT LoRA of :class:`DeepseekV41ForCausalLM`, bf16 or natively loaded: a ``PeftModel`` or
    a folder that ``save_pretrained`` wrote) to ``out_dir`` in the layout vLLM's DeepSeek-V4 LoRA reads: the
    release's module names, per-expert ``[out, in]`` factors, one scale, an ``adapter_config.json`` naming the format.

    ``base``: the config the adapter was trained on, checked against every factor's shape; by default the
    ``PeftModel``'s own, or the ``config.json`` in the adapter's ``base_model_name_or_path`` folder. Returns the
    counts of tensors and modules written and the modules left out. Raises ValueError for what vLLM cannot serve
    the same way (DoRA, ``modules_to_save``, LoRA bias, ranks that differ inside one of vLLM's slots, the embedding
    or the LM head adapted), a bitsandbytes
    base, a non-LoRA adapter, or an adapter of another model.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder: give a new (or empty) folder")
    if isinstance(adapter, PeftModel):
        adapter_name = adapter.active_adapter
        config = adapter.peft_config[adapter_name]
        base = base if base is not None else adapter.get_base_model().config
        source = f"the PeftModel's adapter {adapter_name!r}"
        _check_config(config, base, source)
        tree = adapter
        state = get_peft_model_state_dict(adapter, adapter_name=adapter_name, save_embedding_layers=False)
    else:
        folder, adapter_name = Path(adapter), "default"
        config = _read_peft_config(folder)
        base = base if base is not None else _base_config(config, folder)
        source = str(folder)
        _check_config(config, base, source)
        tree, state = _meta_peft_model(config, base, source), _read_weights(folder)
    factors = _factors(tree, state, adapter_name, source)
    skipped = sorted(_describe((f.name, f.parameter)) for f in factors if f.name.startswith(_SKIPPED_PREFIX))
    if skipped:
        logger.warning(
            "left out the DSpark draft head (%d adapted modules under mtp.*): vLLM's DeepSeek-V4 LoRA "
            "skips it (served, it drafts without the adapter)",
            len(skipped),
        )
    factors = [f for f in factors if not f.name.startswith(_SKIPPED_PREFIX)]
    unserved = sorted(f.name for f in factors if f.name in _UNSERVED)
    if unserved:
        raise ValueError(
            f"{source} adapts {' and '.join(unserved)}: vLLM's DeepSeek-V4 LoRA serves no adapter on the token "
            f"embedding or the LM head ({', '.join(_UNSERVED[n] for n in unserved)} there take no LoRA). Train the "
            "adapter without them (target the attention and the experts), or merge it (merge_and_unload) and serve "
            "the merged model"
        )
    if not factors:
        raise ValueError(f"{source} adapts only the DSpark draft head (mtp.*), which vLLM skips: nothing to export")
    _check_slot_ranks(factors, source)
    rank = max(f.rank for f in factors)
    scaling = _scaling(config.lora_alpha, rank, config.use_rslora)
    tensors = {}
    for f in factors:
        tensors.update(_serving_tensors(f, f.scaling / scaling, base.get_text_config().moe_intermediate_size))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / WEIGHTS_FILE, metadata={"format": "pt"})
    targets = sorted({key.removeprefix(_PEFT_PREFIX).split(".lora_")[0].rpartition(".")[2] for key in tensors})
    serving_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": config.lora_alpha,
        "use_rslora": config.use_rslora,
        "target_modules": targets,
        "bias": "none",
        "use_dora": False,
        "modules_to_save": None,
        "lora_dropout": config.lora_dropout,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": config.base_model_name_or_path,
        "task_type": config.task_type,
        FORMAT_FIELD: {"format": FORMAT, "version": FORMAT_VERSION, "skipped": skipped},
    }
    (out / CONFIG_FILE).write_text(json.dumps(serving_config, indent=2) + "\n")
    return {"tensors": len(tensors), "modules": len(factors), "skipped": skipped}


def load_serving_adapter(
    model: DeepseekV41ForCausalLM, adapter_dir: str | os.PathLike, adapter_name: str = "default"
) -> PeftModel:
    """``model`` with the adapter of a folder :func:`export_serving_adapter` wrote (or any adapter in that layout),
    as a PEFT LoRA in our layout: the experts' factors fused back into ``target_parameters`` adapters. It computes
    what the exported adapter did (the same factors; a folded scale makes the B factors differ by one rounding).
    Raises for a model that is not ours or is bitsandbytes-quantized, and for an adapter of another base."""
    if not isinstance(model, DeepseekV41ForCausalLM):
        raise TypeError(
            f"load_serving_adapter takes a DeepseekV41ForCausalLM (the base the adapter was exported from), got "
            f"{type(model).__name__}"
        )
    if quantization_method(model.config) == "bitsandbytes":
        raise ValueError(
            "the model is bitsandbytes-quantized (NF4 / int8): an adapter in the serving layout adapts the release's "
            "FP8 / FP4 (or bf16) weights, not NF4 / int8 ones. Load the base in bf16 or natively (from_pretrained "
            "of the released folder) and the adapter onto it"
        )
    folder = Path(adapter_dir)
    serving = _read_json(folder / CONFIG_FILE)
    marker = serving.get(FORMAT_FIELD) or {}
    if marker and (marker.get("format") != FORMAT or marker.get("version", 0) > FORMAT_VERSION):
        raise ValueError(
            f"{folder} is in format {marker.get('format')!r} version {marker.get('version')}; this "
            f"version of dsv41 reads {FORMAT!r} up to version {FORMAT_VERSION}: upgrade dsv41"
        )
    if serving.get("peft_type", "LORA") != "LORA" or not {"r", "lora_alpha"} <= serving.keys():
        raise ValueError(f"{folder / CONFIG_FILE} is not a LoRA adapter config (needs peft_type LORA, r, lora_alpha)")
    text = model.config.get_text_config()
    ours = _our_factors(_read_weights(folder), text.n_routed_experts, folder)
    rslora = bool(serving.get("use_rslora", False))
    scaling = _scaling(serving["lora_alpha"], serving["r"], rslora)
    ranks = {key: a.shape[0] // (text.n_routed_experts if key[1] else 1) for key, (a, _) in ours.items()}
    patterns = {
        re.escape(f"{name}.{parameter}" if parameter else name): rank
        for (name, parameter), rank in ranks.items()
        if rank != serving["r"]
    }
    config = LoraConfig(
        r=serving["r"],
        lora_alpha=serving["lora_alpha"],
        use_rslora=rslora,
        target_modules=sorted({name for name, parameter in ours if parameter is None}) or None,
        target_parameters=sorted({f"{name}.{parameter}" for name, parameter in ours if parameter}) or None,
        rank_pattern=patterns,
        alpha_pattern={key: scaling * (math.sqrt(rank) if rslora else rank) for key, rank in patterns.items()},
        base_model_name_or_path=serving.get("base_model_name_or_path"),
        task_type=serving.get("task_type"),
    )
    try:
        peft_model = get_peft_model(model, config, adapter_name=adapter_name)
    except ValueError as error:  # PEFT's "Target modules ... not found in the base model"
        raise ValueError(
            f"{folder} does not fit {type(model).__name__} ({error}): the adapter is for another base"
        ) from None
    loaded = set()
    with torch.no_grad():
        for module_name, module in peft_model.named_modules():
            if not isinstance(module, LoraLayer) or adapter_name not in module.r:
                continue
            key = (_our_name(module_name), module.parameter_name if isinstance(module, ParamWrapper) else None)
            lora_a, lora_b = ours[key]
            own_a, own_b = _own_factors(module, adapter_name)
            if own_a.shape != lora_a.shape or own_b.shape != lora_b.shape:
                raise ValueError(
                    f"{folder}: {_describe(key)} has factors {tuple(lora_a.shape)}, "
                    f"{tuple(lora_b.shape)}; {type(model).__name__} of this config takes "
                    f"{tuple(own_a.shape)}, {tuple(own_b.shape)}: the adapter is for another base"
                )
            own_a.copy_(lora_a)
            own_b.copy_(lora_b)
            loaded.add(key)
    if loaded != ours.keys():
        raise ValueError(
            f"{folder}: {len(ours.keys() - loaded)} modules of the adapter are not in the model, e.g. "
            f"{_describe(sorted(ours.keys() - loaded, key=str)[0])}: the adapter is for another base"
        )
    return peft_model


# ---------------------------------------------------------------------------------------------------------------
# what the adapter is, checked
# ---------------------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"no {path.name} in {path.parent}: give a folder that save_pretrained wrote")
    try:
        return json.loads(path.read_bytes())
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None


def _read_peft_config(folder: Path) -> LoraConfig:
    config = _read_json(folder / CONFIG_FILE)
    if config.get("peft_type") != "LORA":
        raise ValueError(
            f"{folder} is a {config.get('peft_type')} adapter: vLLM's DeepSeek-V4 LoRA serves LoRA "
            "adapters only (peft_type LORA); train one with peft.LoraConfig"
        )
    return LoraConfig.from_pretrained(str(folder))


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    if not (folder / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in {folder}: save the adapter with save_pretrained (safetensors)")
    return load_file(folder / WEIGHTS_FILE)


def _base_config(config: LoraConfig, folder: Path) -> DeepseekV41Config:
    """The config in the adapter's ``base_model_name_or_path`` folder."""
    base = config.base_model_name_or_path
    if not base or not (Path(base) / "config.json").is_file():
        raise ValueError(
            f"{folder}: its base model ({base!r}) is not a local folder with a config.json: give the "
            "base's config (dsv41 export --base PRESET|FOLDER; base= in Python)"
        )
    return DeepseekV41Config.from_pretrained(base)


def _check_config(config: LoraConfig, base: DeepseekV41Config, source: str) -> None:
    """Refuse what vLLM's LoRA does not serve as PEFT computes it, with what to do instead."""
    if getattr(config, "peft_type", None) != "LORA" or not isinstance(config, LoraConfig):
        raise ValueError(
            f"{source} is a {getattr(config, 'peft_type', type(config).__name__)} adapter: vLLM's "
            "DeepSeek-V4 LoRA serves LoRA adapters only (peft_type LORA); train one with peft.LoraConfig"
        )
    if config.use_dora:
        raise ValueError(
            f"{source} is DoRA (use_dora=True), which vLLM does not serve: merge it into the weights "
            "(merge_and_unload) and serve the merged model, or train a plain LoRA"
        )
    if config.modules_to_save:
        raise ValueError(
            f"{source} trains whole modules ({config.modules_to_save}, modules_to_save), which vLLM's "
            "LoRA refuses: target them with LoRA instead (target_modules), or merge and serve the model"
        )
    if config.lora_bias:
        raise ValueError(f"{source} has LoRA biases (lora_bias=True), which vLLM's LoRA does not apply: train without")
    if quantization_method(base) == "bitsandbytes":
        raise ValueError(
            f"{source} was trained on a bitsandbytes-quantized base (quantization_config quant_method "
            "bitsandbytes): its deltas correct NF4/int8 weights, while vLLM serves the release's FP8/FP4 "
            "ones. Train the adapter on the bf16 or natively loaded (FP8/FP4) model"
        )
    if base.model_type != DeepseekV41Config.model_type:
        raise ValueError(
            f"{source}: its base is a {base.model_type} model, not DeepSeek-V4.1 ({DeepseekV41Config.model_type})"
        )


def _meta_peft_model(config: LoraConfig, base: DeepseekV41Config, source: str) -> PeftModel:
    """The adapter's modules on a meta-device model of ``base``: which tensor each key is, and its shape."""
    try:
        model = meta_instance(base, DeepseekV41ForCausalLM)
        model.name_or_path = config.base_model_name_or_path  # which PEFT writes into the config it is given
        return get_peft_model(model, config)
    except ValueError as error:  # PEFT's "Target modules ... not found in the base model"
        raise ValueError(f"{source} does not fit DeepSeek-V4.1 ({error}): the adapter is for another base") from None


def _own_factors(module: LoraLayer, adapter_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if adapter_name in module.lora_embedding_A:
        return module.lora_embedding_A[adapter_name], module.lora_embedding_B[adapter_name]
    return module.lora_A[adapter_name].weight, module.lora_B[adapter_name].weight


def _our_name(module_name: str) -> str:
    """A PEFT model's module name → the base model's (the nested experts wrappers' ``.base_layer`` dropped)."""
    name = module_name.removeprefix(_PEFT_PREFIX)
    while name.endswith(".base_layer"):
        name = name.removesuffix(".base_layer")
    return name


def _factors(tree: nn.Module, state: dict[str, torch.Tensor], adapter_name: str, source: str) -> list[_Factors]:
    """Every module ``tree`` adapts, with its factors from ``state`` (PEFT's saved keys), checked key by key."""
    factors, used = [], set()
    for module_name, module in tree.named_modules():
        if not isinstance(module, LoraLayer) or adapter_name not in module.r:
            continue
        embedding = adapter_name in module.lora_embedding_A
        suffixes = ("lora_embedding_A", "lora_embedding_B") if embedding else ("lora_A.weight", "lora_B.weight")
        pair = []
        for suffix, own in zip(suffixes, _own_factors(module, adapter_name)):
            key = f"{module_name}.{suffix}"
            if key not in state:
                raise ValueError(
                    f"{source} has no {key}, which its config targets on DeepSeek-V4.1 of this config: "
                    "the adapter is for another base (or give its config as --base)"
                )
            if state[key].shape != own.shape:
                raise ValueError(
                    f"{source}: {key} is {tuple(state[key].shape)}, DeepSeek-V4.1 of this config takes "
                    f"{tuple(own.shape)}: the adapter is for another base (or give its config as --base)"
                )
            pair.append(state[key])
            used.add(key)
        parameter = module.parameter_name if isinstance(module, ParamWrapper) else None
        factors.append(
            _Factors(
                _our_name(module_name),
                *pair,
                module.r[adapter_name],
                module.scaling[adapter_name],
                parameter,
            )
        )
    copies = sorted(key for key in state.keys() - used if key.endswith(".base_layer.weight"))
    if copies:  # PEFT's save_embedding_layers: the base's own embedding / head, which vLLM takes from the base
        logger.warning("left out %s: copies of the base model's weights, not LoRA factors", ", ".join(copies))
    unknown = sorted(state.keys() - used - set(copies))
    if unknown:
        raise ValueError(
            f"{source} holds {len(unknown)} tensors no module of DeepSeek-V4.1 takes, e.g. {unknown[0]}: "
            "the adapter is for another base"
        )
    return factors


def _check_slot_ranks(factors: list[_Factors], source: str) -> None:
    """One rank per vLLM slot: a layer's routed experts (w1, w3, w2), and each group of modules it fuses."""
    slots: dict[tuple[str, str], dict[str, int]] = {}
    for f in factors:
        parent, _, leaf = f.name.rpartition(".")
        slot = (f.name, "its routed experts") if f.parameter else (parent, "fused" if leaf in _PACKED else leaf)
        slots.setdefault(slot, {})[f.parameter or leaf] = f.rank
    for (parent, slot), ranks in slots.items():
        if len(set(ranks.values())) > 1:
            raise ValueError(
                f"{source}: {parent} has ranks {ranks}, which vLLM stacks into one LoRA slot of one "
                "rank: train them with one rank (rank_pattern sets them apart)"
            )


def _scaling(alpha: float, rank: int, rslora: bool) -> float:
    return alpha / math.sqrt(rank) if rslora else alpha / rank


# ---------------------------------------------------------------------------------------------------------------
# the two layouts
# ---------------------------------------------------------------------------------------------------------------


def _release_name(name: str) -> str:
    """Our module name → the release's (the backbone at the root, the LM head ``head``)."""
    return "head" if name == "lm_head" else name.removeprefix("model.")


def _serving_tensors(f: _Factors, rescale: float, intermediate: int) -> dict[str, torch.Tensor]:
    """One module's factors under the release's names, lora_B times ``rescale`` (the PEFT scale over vLLM's one);
    the fused experts split into each expert's ``w1`` / ``w3`` (gate_up) or ``w2`` (down)."""
    lora_b = f.lora_b if rescale == 1 else (f.lora_b.float() * rescale).to(f.lora_b.dtype)
    name = _PEFT_PREFIX + _release_name(f.name)
    if f.parameter is None:
        return {f"{name}.lora_A.weight": f.lora_a.contiguous(), f"{name}.lora_B.weight": lora_b.contiguous()}
    experts = f.lora_a.shape[0] // f.rank
    lora_a = f.lora_a.reshape(experts, f.rank, -1)  # [E, r, in]
    lora_b = lora_b.reshape(lora_b.shape[0], f.rank, experts)  # [out, r, E]
    parts = {
        "gate_up_proj": {"w1": slice(0, intermediate), "w3": slice(intermediate, None)},
        "down_proj": {"w2": slice(None)},
    }[f.parameter]
    tensors = {}
    for e in range(experts):
        for weight, rows in parts.items():
            # copies of their own: safetensors refuses tensors that share memory
            key = f"{name}.{e}.{weight}"
            tensors[f"{key}.lora_A.weight"] = lora_a[e].clone(memory_format=torch.contiguous_format)
            tensors[f"{key}.lora_B.weight"] = lora_b[rows, :, e].clone(memory_format=torch.contiguous_format)
    return tensors


def _our_factors(
    tensors: dict[str, torch.Tensor], num_experts: int, source: Path
) -> dict[tuple[str, str | None], tuple[torch.Tensor, torch.Tensor]]:
    """The serving layout's tensors → (our module name, fused experts tensor or None) → (lora_A, lora_B) as PEFT
    holds them: each layer's experts fused back (w1 and w3 must share their lora_A, as PEFT's gate_up_proj does)."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_(?:embedding_)?([AB])(?:\.weight)?", key)
        if match is None:
            raise ValueError(f"{source}: {key} is not a LoRA factor (name.lora_A.weight / name.lora_B.weight)")
        modules.setdefault(match.group(1), {})[match.group(2)] = tensor
    ours, experts = {}, {}
    for name, pair in modules.items():
        if pair.keys() != {"A", "B"}:
            raise ValueError(f"{source}: {name} has no lora_{({'A', 'B'} - pair.keys()).pop()}")
        match = _EXPERT_KEY.match(name)
        if match:
            experts.setdefault(match.group(1), {})[(int(match.group(2)), match.group(3))] = pair
        else:
            ours[("lm_head" if name == "head" else f"model.{name}", None)] = (pair["A"], pair["B"])
    for layer, parts in experts.items():
        ours.update(_fused_experts(layer, parts, num_experts, source))
    return ours


def _fused_experts(
    layer: str, parts: dict[tuple[int, str], dict[str, torch.Tensor]], num_experts: int, source: Path
) -> dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]:
    """One layer's per-expert factors → PEFT's factors of ``gate_up_proj`` (w1, w3) and ``down_proj`` (w2)."""
    fused = {}
    for parameter, weights in (("gate_up_proj", ("w1", "w3")), ("down_proj", ("w2",))):
        present = {(e, w) for e, w in parts if w in weights}
        if not present:
            continue
        expected = {(e, w) for e in range(num_experts) for w in weights}
        if present != expected:
            missing = sorted(expected - present) or sorted(present - expected)
            raise ValueError(
                f"{source}: {layer} adapts {len(present)} of the {len(expected)} expert matrices "
                f"{'/'.join(weights)} (first off: expert {missing[0][0]} {missing[0][1]}): PEFT's "
                f"{parameter} adapter takes all {num_experts} experts"
            )
        ranks = {parts[(e, w)]["A"].shape[0] for e, w in present}
        if len(ranks) > 1:
            raise ValueError(
                f"{source}: the experts of {layer} have ranks {sorted(ranks)}: PEFT's (and vLLM's) "
                "experts adapter has one rank for all of them"
            )
        a, b = [], []
        for e in range(num_experts):
            first = parts[(e, weights[0])]["A"]
            if any(not torch.equal(parts[(e, w)]["A"], first) for w in weights[1:]):
                raise ValueError(
                    f"{source}: expert {e} of {layer} has different lora_A for w1 and w3, which PEFT's "
                    "fused gate_up_proj adapter cannot hold (it shares one per expert)"
                )
            a.append(first)
            b.append(torch.cat([parts[(e, w)]["B"] for w in weights]))
        out, rank = b[0].shape
        fused[(f"model.{layer}", parameter)] = (torch.cat(a), torch.stack(b, dim=-1).reshape(out, rank * num_experts))
    return fused


def _describe(key: tuple[str, str | None]) -> str:
    name, parameter = key
    return f"{name}.{parameter}" if parameter else name


__all__ = ["FORMAT", "FORMAT_VERSION", "export_serving_adapter", "load_serving_adapter"]
