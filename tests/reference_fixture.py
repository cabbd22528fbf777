"""Builds our model from the golden fixture (reference names and dtypes) for the parity tests, and reads the released
format as the reference does."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, models

import modeling_dsv41  # noqa: F401  (registers the Auto classes)
from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.engram import dequantize_engram_table
from modeling_dsv41.codec import RELEASED_BLOCK_SIZE, dequantize_fp4_rows, dequantize_fp8_block, dequantize_fp8_rows


def dequantize_released_tensor(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantize one quantized tensor of the released checkpoint to fp32, inferring its format from dtypes and shapes
    (the loader is told the width instead: ``codec.dequantize_released_weight``):

    * int8 / uint8 / float4_e2m1fn_x2 weight [R, C/2] + scale [R, C/32]: packed FP4 routed expert;
    * float8_e4m3fn weight [R, C] + scale [R, C/32]: FP8 with per-row scales (Engram table);
    * float8_e4m3fn weight [R, C] + scale [ceil(R/32), ceil(C/32)]: FP8 with 32x32 block scales (dense Linear).

    For R = 1 the last two layouts coincide and give the same values. Scales must be float8_e8m0fnu.
    """
    if scale.dtype != torch.float8_e8m0fnu:
        raise ValueError(f"released scales are float8_e8m0fnu, got {scale.dtype}")
    if weight.dim() != 2 or scale.dim() != 2:
        raise ValueError(f"expected 2-D weight and scale, got {tuple(weight.shape)} and {tuple(scale.shape)}")
    b = RELEASED_BLOCK_SIZE
    rows, cols = weight.shape
    if weight.dtype in (torch.int8, torch.uint8, torch.float4_e2m1fn_x2):
        return dequantize_fp4_rows(weight, scale, b)
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"cannot dequantize a {weight.dtype} weight: expected float8_e4m3fn or packed FP4 bytes")
    if cols % b == 0 and tuple(scale.shape) == (rows, cols // b):
        return dequantize_fp8_rows(weight, scale, b)
    if tuple(scale.shape) == (math.ceil(rows / b), math.ceil(cols / b)):
        return dequantize_fp8_block(weight, scale, b)
    raise ValueError(
        f"scale shape {tuple(scale.shape)} fits neither per-row [{rows}, {cols}/{b}] nor 32x32 block "
        f"{(math.ceil(rows / b), math.ceil(cols / b))} scales for FP8 weight {tuple(weight.shape)}"
    )


def reference_state_dict(fixtures: Path) -> dict[str, torch.Tensor]:
    """The fixture weights with the FP8 Engram tables dequantized (exact in bf16) and the token map added."""
    state = load_file(fixtures / "v41_tiny_vl/model.safetensors")
    for key in [k for k in state if k.endswith("engram.embed.scale")]:
        weight_key = key[: -len("scale")] + "weight"
        state[weight_key] = dequantize_engram_table(state[weight_key], state.pop(key))
    state["engram_hasher.token_map"] = load_file(fixtures / "v41_tiny_vl/engram.safetensors")["token_map"]
    return state


def to_our_layout(released: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Released names → our model's, written out independently of the conversion code: ``model.`` prefix,
    ``lm_head``, and each layer's routed experts fused into ``gate_up_proj`` [E, 2·I, D] (every expert's ``w1`` rows
    then its ``w3`` rows) and ``down_proj`` [E, D, I] (its ``w2``), experts in index order."""
    ours, experts = {}, {}
    for name, tensor in released.items():
        routed = re.fullmatch(r"(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight", name)
        if routed:
            experts.setdefault(routed[1], {}).setdefault(routed[3], {})[int(routed[2])] = tensor
        else:
            ours["lm_head.weight" if name == "head.weight" else f"model.{name}"] = tensor
    for path, weights in experts.items():
        stacked = {w: torch.stack([per_expert[e] for e in sorted(per_expert)]) for w, per_expert in weights.items()}
        ours[f"model.{path}.gate_up_proj"] = torch.cat([stacked["w1"], stacked["w3"]], dim=1)
        ours[f"model.{path}.down_proj"] = stacked["w2"]
    return ours


def reference_model(fixtures: Path, variant: str, emulate_quantization: bool) -> DeepseekV41ForCausalLM:
    """The reference's bf16 model: bf16 everywhere except the tensors the reference keeps in fp32, run in reference
    numerics so that the parity tests give the same result on every CPU."""
    config = DeepseekV41Config.from_dict(json.loads((fixtures / f"v41_tiny_vl/{variant}/config.json").read_text()))
    config.text_config.emulate_quantization = emulate_quantization
    config.reference_numerics = True
    model = DeepseekV41ForCausalLM(config).eval()
    state = to_our_layout(reference_state_dict(fixtures))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    for name, param in model.named_parameters():
        param.data = param.data.to(torch.float32 if state[name].dtype == torch.float32 else torch.bfloat16)
    return model


def reference_inputs(fixtures: Path) -> dict[str, torch.Tensor]:
    inputs = load_file(fixtures / "v41_tiny_vl/inputs.safetensors")
    return {
        "input_ids": inputs["input_ids"],
        "pixel_values": inputs["pixel_values"],
        "image_grid_hw": torch.tensor([[9, 13]]),
        "image_token_types": inputs["token_types"],
    }


def stub_tokenizer() -> Tokenizer:
    """A 512-token tokenizer whose Engram compressed map is the fixture's stub map, ``id // 2``: token ``2i`` is
    ``t{i}`` and ``2i+1`` is ``T{i}``, which lowercase to the same key."""
    vocab = {}
    for i in range(256):
        vocab[f"t{i}"], vocab[f"T{i}"] = 2 * i, 2 * i + 1
    return Tokenizer(models.WordLevel(vocab, unk_token="t0"))


def fixture_checkpoint(fixtures: Path, variant: str, folder: Path, with_tokenizer: bool = True) -> Path:
    """The fixture as a checkpoint folder for ``from_pretrained``: its reference ``config.json`` (flat layout), its
    ``model.safetensors`` (reference names and dtypes, FP8 Engram tables) and, optionally, the stub
    ``tokenizer.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(fixtures / f"v41_tiny_vl/{variant}/config.json", folder / "config.json")
    (folder / "model.safetensors").symlink_to(fixtures / "v41_tiny_vl/model.safetensors")
    if with_tokenizer:
        stub_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


# Shapes of fixtures/quant_format (the reference's FP8/FP4 small model): hidden 256, q_lora 64, 4 heads of 64 in
# 2 output groups of rank 32, an indexer of 4 x 64, experts of width 128, the fixture's Engram tables.
QUANT_FORMAT_TEXT = dict(
    vocab_size=512,
    hidden_size=256,
    moe_intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=64,
    o_lora_rank=32,
    o_groups=2,
    n_routed_experts=4,
    num_experts_per_tok=2,
    sliding_window=16,
    compress_ratios=[0, 2],
    kv_source_layer_ids=[1],
    index_source_layer_ids=[1],
    index_n_heads=4,
    index_head_dim=64,
    index_topk=8,
    candidate_source_layer_id=-1,
    engram_layer_ids=[0, 1],
    engram_num_embeddings=[660, 864],
    engram_vocab_size=100,
    engram_n_heads=2,
    engram_head_dim=32,
    engram_compressed_vocab_size=256,
    num_nextn_predict_layers=0,
)


# The released-export golden (tests/data/reference_export.safetensors): a seeded "fine-tune" of the dense fixture,
# exported with `dsv41 export --format released`, decoded greedily by DeepSeek's reference code and by our model.
EXPORT_SEED = 49
EXPORT_NOISE = 0.05  # each weight scaled by 1 + EXPORT_NOISE * N(0, 1): far more than one FP8/FP4 step
EXPORT_PROMPT_LEN = 12
EXPORT_NEW_TOKENS = 12
# the files of the export that DeepSeek's inference code reads (config, index, shards, tokenizer)
EXPORT_READ_FILES = ("inference/config.json", "model.safetensors.index.json", "tokenizer.json")


def released_finetune(fixtures: Path, folder: Path) -> Path:
    """The dense fixture model with every parameter scaled by seeded noise (a stand-in for a full fine-tune), saved
    with ``save_pretrained`` and the stub tokenizer into ``folder / "finetune"`` and exported in the release's
    format into ``folder / "released"``, which is returned. The same bytes on every run with the same torch."""
    from modeling_dsv41.serving.released_export import export_released_checkpoint

    model = reference_model(fixtures, "dense", emulate_quantization=True)
    generator = torch.Generator().manual_seed(EXPORT_SEED)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_((param.float() * (1 + EXPORT_NOISE * noise)).to(param.dtype))
    source = folder / "finetune"
    model.save_pretrained(source)
    stub_tokenizer().save(str(source / "tokenizer.json"))
    released = folder / "released"
    export_released_checkpoint(source, released)
    return released


def export_prompt() -> torch.Tensor:
    """[1, EXPORT_PROMPT_LEN] text ids (no image token, no pad id) from a seeded generator."""
    generator = torch.Generator().manual_seed(EXPORT_SEED)
    return torch.randint(3, 500, (1, EXPORT_PROMPT_LEN), generator=generator)


def export_read_files(released: Path) -> dict[str, str]:
    """sha256 of each file of the export DeepSeek's inference code reads, by path relative to ``released``."""
    import hashlib

    index = json.loads((released / "model.safetensors.index.json").read_text())
    names = sorted({*EXPORT_READ_FILES, *index["weight_map"].values()})
    return {name: hashlib.sha256((released / name).read_bytes()).hexdigest() for name in names}
