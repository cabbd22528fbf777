"""The tiny models the tests build: the ``tiny`` preset, seeded, with the Engram token map the test needs."""

from __future__ import annotations

import torch

from modeling_dsv41 import DeepseekV41Config, DeepseekV41ForCausalLM

# text-config entries of a DSpark draft head of one block, drafting from layers 0 and 1, its MoE with 2 routed experts
# of its own, 1 active (under expert parallelism on 2 processes: 1 per rank)
DSPARK = dict(
    num_nextn_predict_layers=1,
    dspark_block_size=3,
    dspark_target_layer_ids=[0, 1],
    dspark_markov_rank=16,
    dspark_noise_token_id=7,
    dspark_n_routed_experts=2,
    dspark_n_activated_experts=1,
)


def tiny_config(vision: bool = True, **text_overrides) -> DeepseekV41Config:
    """The tiny preset, with ``text_overrides`` in its text config (validated as a new config) and without the vision
    tower unless ``vision``."""
    sub_configs = {} if vision else {"vision_config": None}
    config = DeepseekV41Config.from_preset("tiny", **sub_configs)
    if text_overrides:
        text = {**config.text_config.to_dict(), **text_overrides}
        config = DeepseekV41Config.from_preset("tiny", text_config=text, **sub_configs)
    return config


def tiny_model(
    config: DeepseekV41Config | None = None, seed: int = 0, engram_map: str | None = "stub", **text_overrides
) -> DeepseekV41ForCausalLM:
    """A model of ``config`` (default: :func:`tiny_config` with ``text_overrides``), its weights drawn after
    ``torch.manual_seed(seed)``, in eval mode. Its Engram hasher (if any) hashes with ``engram_map``: ``"stub"``, the
    map of the fixtures' stub tokenizer (token id // 2); ``"default"``, the default map written out (token id mod the
    compressed vocabulary: no warning about it); None, the map as built."""
    config = config if config is not None else tiny_config(**text_overrides)
    torch.manual_seed(seed)
    model = DeepseekV41ForCausalLM(config).eval()
    hasher, text = model.model.engram_hasher, config.text_config
    if hasher is not None and engram_map == "stub":
        hasher.token_map.copy_(torch.arange(text.vocab_size) // 2)
    elif hasher is not None and engram_map == "default":
        hasher.token_map.copy_(torch.arange(text.vocab_size) % text.engram_compressed_vocab_size)
    return model


def tiny_training_model(num_hidden_layers: int, seed: int = 0) -> DeepseekV41ForCausalLM:
    """The tiny preset at ``num_hidden_layers`` layers, seeded, without QDQ emulation (training runs in plain floats),
    its Engram hasher on the default compressed map written out, in training mode."""
    config = tiny_config(num_hidden_layers=num_hidden_layers, emulate_quantization=False)
    return tiny_model(config, seed=seed, engram_map="default").train()
