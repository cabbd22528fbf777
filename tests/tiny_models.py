"""The tiny trainable model the training tests share (one process, DDP, FSDP2)."""

from __future__ import annotations

import torch

from modeling_dsv41 import DeepseekV41Config, DeepseekV41ForCausalLM


def tiny_training_model(num_hidden_layers: int, seed: int = 0) -> DeepseekV41ForCausalLM:
    """The tiny preset at ``num_hidden_layers`` layers, seeded, without QDQ emulation (training runs in plain floats),
    its Engram hasher on the default compressed map (token id mod the compressed vocabulary) written out."""
    preset = DeepseekV41Config.from_preset("tiny")
    text = {**preset.text_config.to_dict(), "num_hidden_layers": num_hidden_layers, "emulate_quantization": False}
    config = DeepseekV41Config.from_preset("tiny", text_config=text)
    torch.manual_seed(seed)
    model = DeepseekV41ForCausalLM(config)
    text = config.text_config
    model.model.engram_hasher.token_map.copy_(torch.arange(text.vocab_size) % text.engram_compressed_vocab_size)
    return model
