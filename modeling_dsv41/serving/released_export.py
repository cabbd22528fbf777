"""A full fine-tune written back in DeepSeek's released checkpoint format (``dsv41 export --format released``,
docs/serving.md).

The release (``deepseek-ai/DeepSeek-V4.1-Flash``) stores its Linears FP8 e4m3 with one E8M0 scale per 32x32 block,
its routed experts packed FP4 (E2M1) with one E8M0 scale per row and 32 columns, and its Engram tables FP8 with one
E8M0 scale per row and 32 columns, under the reference's tensor names (:mod:`~modeling_dsv41.released.writing`). Its
``config.json`` uses the published key names and ``quantization_config``; ``inference/config.json`` holds the same
architecture as DeepSeek's inference code reads it (its ``ModelArgs``, ``dtype="fp8"``, ``expert_dtype="fp4"``).

Writing rounds every quantized weight to that storage: what a fine-tune changed below the FP8/FP4 step is lost, as it
is for any checkpoint in this format. The export says so (a warning with the largest relative change) and refuses
what the format cannot hold: an unmerged PEFT adapter, a bitsandbytes model, a config with settings the published
keys cannot say, widths that are not whole scale blocks, an Engram token map the tokenizer would not rebuild.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from configuration import DeepseekV41Config
from configuration.configuration_dsv41 import (
    REFERENCE_TEXT_KEYS,
    REFERENCE_VISION_KEYS,
    released_quantization_dict,
)

from ..codec import dequantize_released_weight
from ..released.convert import COPIED_FILES
from ..released.native_precision import quantization_method
from ..released.writing import released_layout_state_dict, released_state_dict, save_released_checkpoint

logger = logging.getLogger(__name__)

FORMAT = "deepseek-v4.1-released"
FORMAT_VERSION = 1
REFERENCE_CONFIG = Path("inference") / "config.json"  # where the release keeps the config its inference code reads
BLOCK = 32  # the scale block of every quantized tensor (both dims of an FP8 Linear, the columns of the others)
# the release's published config.json keys, per section (``../shared/fixtures/released_config/config.json``)
PUBLISHED_ROOT_KEYS = ("architectures", "model_type", "image_token_id", "quantization_config")
PUBLISHED_TEXT_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_lora_rank",
    "o_groups",
    "hidden_act",
    "swiglu_limit",
    "rms_norm_eps",
    "tie_word_embeddings",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "scoring_func",
    "topk_method",
    "norm_topk_prob",
    "routed_scaling_factor",
    "sliding_window",
    "compress_ratios",
    "compress_rope_theta",
    "kv_source_layer_ids",
    "index_source_layer_ids",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "candidate_source_layer_id",
    "candidate_topk_blocks",
    "candidate_block_size",
    "hc_mult",
    "hc_sinkhorn_iters",
    "hc_eps",
    "engram_layer_ids",
    "engram_num_embeddings",
    "engram_max_ngram_size",
    "engram_vocab_size",
    "engram_n_heads",
    "engram_head_dim",
    "engram_pad_token_id",
    "engram_compressed_vocab_size",
    "num_nextn_predict_layers",
    "dspark_block_size",
    "dspark_noise_token_id",
    "dspark_target_layer_ids",
    "dspark_markov_rank",
    "dspark_n_routed_experts",
    "dspark_num_experts_per_tok",
)
PUBLISHED_VISION_KEYS = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "patch_size",
    "rope_theta",
    "downsample_ratio",
    "max_image_tokens",
    "min_pixels",
    "max_wh_ratio",
)
# how our model runs, not what it is: no published key, and not needed to load the weights
_RUNTIME_KEYS = frozenset(
    {
        "emulate_quantization",
        "query_chunk_size",
        "engram_table_dtype",
        "reference_numerics",
        "use_cache",
        "initializer_range",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "dtype",
        "transformers_version",
        "auto_map",
        "quantization_config",
        "_name_or_path",
    }
)
# the DSpark blocks' own embedding and head: the release stores copies of the backbone's, which our model shares
_DSPARK_COPIES = (("embed.weight", "embed"), ("head.weight", "head"))


def published_config_dict(config: DeepseekV41Config) -> dict[str, Any]:
    """``config`` under the release's published ``config.json`` keys, with its ``quantization_config``.

    Raises ``ValueError`` when a setting of ``config`` has no published key (the release's config would build
    another model), naming it.
    """
    ours = config.to_dict()
    text, vision = ours["text_config"], ours.get("vision_config")
    out: dict[str, Any] = {key: ours[key] for key in PUBLISHED_ROOT_KEYS if key in ours}
    out["quantization_config"] = released_quantization_dict()
    out["text_config"] = {key: text[key] for key in PUBLISHED_TEXT_KEYS if key in text}
    if vision is not None:
        out["vision_config"] = {key: vision[key] for key in PUBLISHED_VISION_KEYS if key in vision}
    # the settings the published keys leave out must be the ones a config read from them gets
    rebuilt = DeepseekV41Config.from_dict(json.loads(json.dumps(out))).to_dict()
    lost = [
        f"{section}{key}={value!r}"
        for section, mine, theirs in (
            ("", ours, rebuilt),
            ("text_config.", text, rebuilt["text_config"]),
            ("vision_config.", vision or {}, rebuilt.get("vision_config") or {}),
        )
        for key, value in mine.items()
        if key not in _RUNTIME_KEYS and key not in ("text_config", "vision_config") and theirs.get(key, value) != value
    ]
    if lost:
        raise ValueError(
            f"the model's config cannot be written with the release's config.json keys: {', '.join(lost)} "
            "(a config read from those keys would build another model)"
        )
    return out


def reference_config_dict(config: DeepseekV41Config) -> dict[str, Any]:
    """``config`` as DeepSeek's inference code reads it (``inference/config.json``: its ``ModelArgs`` keys) for the
    released storage (``dtype="fp8"``, ``expert_dtype="fp4"``). The inverse of ``from_reference_dict``, checked."""
    text, vision = config.text_config, config.vision_config
    flat: dict[str, Any] = {"dtype": "fp8", "expert_dtype": "fp4"}
    flat |= {ref: getattr(text, ours) for ref, ours in REFERENCE_TEXT_KEYS.items()}
    yarn = text.compress_rope_scaling
    if yarn.get("rope_type") == "yarn":
        flat |= {
            "original_seq_len": yarn["original_max_position_embeddings"],
            "rope_factor": yarn["factor"],
            "beta_fast": yarn["beta_fast"],
            "beta_slow": yarn["beta_slow"],
        }
    else:
        flat["original_seq_len"] = 0  # the reference's "no YaRN"
    if vision is not None:
        flat |= {ref: getattr(vision, ours) for ref, ours in REFERENCE_VISION_KEYS.items()}
        flat["image_token_id"] = config.image_token_id
    else:
        flat["vision_n_layers"] = 0
    flat = json.loads(json.dumps(flat))  # tuples as lists, as a JSON file holds them
    rebuilt = DeepseekV41Config.from_reference_dict(flat)
    for name, mine, theirs in (
        ("text_config", text, rebuilt.text_config),
        ("vision_config", vision, rebuilt.vision_config),
    ):
        mine_dict = {} if mine is None else mine.to_dict()
        theirs_dict = {} if theirs is None else theirs.to_dict()
        differ = sorted(
            key for key in mine_dict.keys() - _RUNTIME_KEYS if theirs_dict.get(key, mine_dict[key]) != mine_dict[key]
        )
        if differ:
            raise ValueError(f"the model's {name} cannot be written as DeepSeek's inference/config.json: {differ}")
    return flat


def _check_model(model: nn.Module) -> None:
    """Refuse what the release's storage cannot hold, saying what to do."""
    if hasattr(model, "peft_config"):
        raise ValueError(
            "the model carries PEFT adapters: merge them first (model = model.merge_and_unload()) and export the "
            "merged model, or export the adapter alone with --format vllm-lora"
        )
    quantizer = getattr(model, "hf_quantizer", None)
    method = quantization_method(quantizer)
    if quantizer is not None and method != "fp8":
        raise ValueError(
            f"the model is quantized with {method}: its weights are not the fine-tune's; load the fine-tune "
            "unquantized (bf16 or float32) to export it"
        )
    config = getattr(model, "config", None)
    if not isinstance(config, DeepseekV41Config):
        raise ValueError(f"not a DeepSeek-V4.1 model (its config is {type(config).__name__})")
    if config.get_text_config().tie_word_embeddings:
        raise ValueError("the release stores the embedding and the head apart: a tied head cannot be exported")


def _check_whole_blocks(state: dict[str, torch.Tensor]) -> None:
    """Every quantized tensor must hold whole 32-column scale blocks (the reference's kernels assert it)."""
    for name, tensor in state.items():
        if not name.endswith(".scale"):
            continue
        weight = state[name[: -len(".scale")] + ".weight"]
        columns = weight.shape[-1] * (2 if weight.dtype in (torch.int8, torch.uint8, torch.float4_e2m1fn_x2) else 1)
        if columns % BLOCK:
            raise ValueError(
                f"{name[: -len('.scale')]} has {columns} input columns: the release's storage needs a multiple of "
                f"{BLOCK} (one E8M0 scale per {BLOCK} values)"
            )


def _rounding(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[int, float]:
    """(quantized tensors, the largest relative change of one of them) between ``model``'s float weights and their
    released storage: what the export rounds away."""
    plain = {
        name: tensor
        for name, tensor in released_layout_state_dict(model).items()
        if name.endswith(".weight") and tensor.is_floating_point() and tensor.element_size() > 1
    }
    count, worst = 0, 0.0
    for name, tensor in state.items():
        if not name.endswith(".scale"):
            continue
        weight_name = name[: -len(".scale")] + ".weight"
        original = plain.get(weight_name)
        if original is None:  # stored quantized already: nothing rounded
            continue
        weight = state[weight_name]
        columns = weight.shape[-1] * (2 if weight.dtype in (torch.int8, torch.uint8, torch.float4_e2m1fn_x2) else 1)
        stored = dequantize_released_weight(weight, tensor, columns, torch.float32)
        norm = original.float().norm()
        count += 1
        if norm > 0:
            worst = max(worst, ((stored - original.float()).norm() / norm).item())
    return count, worst


def stored_dtypes(config: DeepseekV41Config) -> dict[str, torch.dtype]:
    """The dtype the release stores each unquantized tensor in, under the released names: the one DeepSeek's
    reference holds it in, which is our model's in bf16 (its fp32 modules, such as ``head``, ``hc_*``, the ratio-2
    compressor and the gate's biases, stay fp32)."""
    from ..modeling_dsv41 import DeepseekV41ForCausalLM
    from ..placement import meta_instance

    model = meta_instance(config, DeepseekV41ForCausalLM, torch.bfloat16)
    return {name: tensor.dtype for name, tensor in released_layout_state_dict(model).items()}


def exported_state_dict(model: nn.Module) -> tuple[dict[str, torch.Tensor], int]:
    """The tensors of the export and how many unquantized ones changed when cast to their stored dtype.

    :func:`~modeling_dsv41.released.writing.released_state_dict` (quantized from the model's own values), the
    unquantized tensors in the dtype the release stores them in (:func:`stored_dtypes`), plus the DSpark blocks'
    copies of the embedding and head, which the release stores (and our model shares)."""
    state = released_state_dict(model)
    dtypes = stored_dtypes(model.config)
    narrowed = 0
    for name, tensor in state.items():
        quantized = name.endswith(".scale") or f"{name[: -len('.weight')]}.scale" in state
        target = dtypes.get(name)
        if quantized or target is None or not tensor.is_floating_point() or tensor.dtype == target:
            continue
        cast = tensor.to(target)
        narrowed += int(not torch.equal(cast.to(tensor.dtype), tensor))
        state[name] = cast
    config = model.config.get_text_config()
    if config.has_dspark:
        for k in range(config.num_nextn_predict_layers):
            for suffix, source in _DSPARK_COPIES:
                # a copy of its own: the release's files hold each tensor once, and safetensors refuses shared memory
                state.setdefault(f"mtp.{k}.{suffix}", state[f"{source}.weight"].clone())
    return state, narrowed


def _check_token_map(model: nn.Module, source: Path | None) -> None:
    """The release stores no Engram token map: DeepSeek's code and ``from_pretrained`` build it from the tokenizer.
    Refuse a model whose map that tokenizer would not rebuild; warn when there is no tokenizer to check with."""
    hasher = getattr(model.base_model, "engram_hasher", None)
    if hasher is None:
        return
    tokenizer_file = None if source is None else source / "tokenizer.json"
    if tokenizer_file is None or not tokenizer_file.is_file():
        logger.warning(
            "the release stores no Engram token map and no tokenizer.json comes with the model: whoever loads the "
            "export must give the tokenizer the fine-tune was trained with (from_pretrained(..., "
            "engram_tokenizer=...))"
        )
        return
    from tokenizers import Tokenizer

    from ..engram import build_compressed_token_map

    lookup, _ = build_compressed_token_map(Tokenizer.from_file(str(tokenizer_file)))
    if not torch.equal(torch.tensor(lookup, dtype=torch.long), hasher.token_map.long().cpu()):
        raise ValueError(
            f"the model's Engram token map is not the one {tokenizer_file} builds, and the release stores none: "
            "loaded from the export, the Engram layers would hash other n-grams"
        )


def _load(source: Path) -> nn.Module:
    """The model saved in ``source`` (our ``save_pretrained`` / Trainer layout, any dtype), in float32 so that
    nothing is rounded before the release's quantization."""
    if not source.is_dir():
        raise FileNotFoundError(f"source model folder {source} does not exist")
    if (source / "adapter_config.json").is_file():
        raise ValueError(
            f"{source} is a PEFT adapter, not a model: merge it into its base first "
            "(PeftModel.from_pretrained(base, ADAPTER).merge_and_unload().save_pretrained(MERGED)) and export the "
            "merged folder, or export the adapter alone with --format vllm-lora"
        )
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source} is not a model folder: it has no config.json")
    if not any(source.glob("*.safetensors")):
        raise FileNotFoundError(f"{source} is not a model folder: it has no *.safetensors weights")
    from ..modeling_dsv41 import DeepseekV41ForCausalLM

    return DeepseekV41ForCausalLM.from_pretrained(source, dtype=torch.float32).eval()


def export_released_checkpoint(
    source: str | os.PathLike | nn.Module, destination: str | os.PathLike, max_shard_bytes: int = 5 * 2**30
) -> dict[str, Any]:
    """Write ``source`` (a folder our ``save_pretrained`` or Trainer wrote, or the model itself) in the release's
    format into ``destination`` (a new or empty folder): ``config.json`` under the published keys,
    ``inference/config.json`` for DeepSeek's inference code, FP8/FP4 safetensors shards with E8M0 scales and the
    Engram tables, ``model.safetensors.index.json``, and the tokenizer files found next to the source.

    Returns ``{"tensors": n, "bytes": total, "quantized": n, "max_relative_rounding": r, "narrowed": n}``: the
    tensors written, their bytes, how many were quantized, the largest relative change one of those took (a
    Frobenius-norm ratio), and how many unquantized tensors changed when cast to bf16.
    """
    destination = Path(destination)
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise FileExistsError(f"destination {destination} exists and is not an empty folder")
    folder = None if isinstance(source, nn.Module) else Path(source)
    model = source if folder is None else _load(folder)
    _check_model(model)
    published = published_config_dict(model.config)
    reference = reference_config_dict(model.config)
    _check_token_map(model, folder)
    state, narrowed = exported_state_dict(model)
    _check_whole_blocks(state)
    quantized, worst = _rounding(model, state)
    if quantized:
        logger.warning(
            "%d weights are rounded to the release's FP8/FP4 storage (largest relative change %.3g)%s: what the "
            "fine-tune changed below that step is not in the export",
            quantized,
            worst,
            f", {narrowed} other tensors to bf16" if narrowed else "",
        )
    save_released_checkpoint(model, destination, max_shard_bytes=max_shard_bytes, state_dict=state)
    (destination / "config.json").write_text(json.dumps(published, indent=2) + "\n")
    (destination / REFERENCE_CONFIG).parent.mkdir(exist_ok=True)
    (destination / REFERENCE_CONFIG).write_text(json.dumps(reference, indent=2) + "\n")
    for name in COPIED_FILES if folder is not None else ():
        if (folder / name).is_file():
            shutil.copy2(folder / name, destination / name)
    total = sum(t.numel() * t.element_size() for t in state.values())
    return {
        "tensors": len(state),
        "bytes": total,
        "quantized": quantized,
        "max_relative_rounding": worst,
        "narrowed": narrowed,
    }


__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "REFERENCE_CONFIG",
    "export_released_checkpoint",
    "exported_state_dict",
    "published_config_dict",
    "reference_config_dict",
    "stored_dtypes",
]
