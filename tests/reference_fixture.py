"""Builds our model from the golden fixture (reference names and dtypes) for the parity tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

import modeling_dsv41  # noqa: F401  (registers the Auto classes)
from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.engram import dequantize_engram_table


def reference_state_dict(fixtures: Path) -> dict[str, torch.Tensor]:
    """The fixture weights with the FP8 Engram tables dequantized (exact in bf16) and the token map added."""
    state = load_file(fixtures / "v41_tiny_vl/model.safetensors")
    for key in [k for k in state if k.endswith("engram.embed.scale")]:
        weight_key = key[: -len("scale")] + "weight"
        state[weight_key] = dequantize_engram_table(state[weight_key], state.pop(key))
    state["engram_hasher.token_map"] = load_file(fixtures / "v41_tiny_vl/engram.safetensors")["token_map"]
    return state


def reference_model(fixtures: Path, variant: str, emulate_quantization: bool) -> DeepseekV41ForCausalLM:
    """The reference's bf16 model: bf16 everywhere except the tensors the reference keeps in fp32."""
    config = DeepseekV41Config.from_dict(json.loads((fixtures / f"v41_tiny_vl/{variant}/config.json").read_text()))
    config.text_config.emulate_quantization = emulate_quantization
    model = DeepseekV41ForCausalLM(config).eval()
    state = reference_state_dict(fixtures)
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
