import json

import pytest

from configuration import PRESETS_DIR, DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig


def test_presets_load_and_round_trip(tmp_path):
    for name in ("tiny", "deepseek-v4.1-flash"):
        config = DeepseekV41Config.from_preset(name)
        config.save_pretrained(tmp_path / name)
        again = DeepseekV41Config.from_pretrained(tmp_path / name)
        assert again.to_dict() == config.to_dict()


def test_flash_preset_has_released_sizes():
    text = DeepseekV41Config.from_preset("deepseek-v4.1-flash").text_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.head_dim) == (5120, 40, 64, 512)
    assert text.compress_ratios == [0, 0] + [2] * 18 + [1] * 20 + [0] * 3
    assert text.engram_num_embeddings == [384006168, 384016682]


def test_flat_reference_config_folder_gives_equivalent_config(fixtures_dir, tmp_path):
    ref = json.loads((fixtures_dir / "v41_tiny_vl/dense/config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(ref))
    config = DeepseekV41Config.from_pretrained(tmp_path)
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.qk_rope_head_dim) == (
        ref["dim"],
        ref["n_layers"],
        ref["rope_head_dim"],
    )
    assert text.kv_source_layer_ids == ref["kv_source_layers"]
    assert text.engram_pad_token_id == ref["engram_pad_id"]
    assert text.compress_rope_scaling["factor"] == ref["rope_factor"]
    assert text.compress_rope_scaling["original_max_position_embeddings"] == ref["original_seq_len"]
    assert (vision.hidden_size, vision.max_image_tokens, vision.min_pixels) == (64, 64, 20000)
    assert config.image_token_id == 510
    nested = DeepseekV41Config.from_preset("tiny", text_config={**text.to_dict(), "index_topk": ref["index_topk"]})
    assert nested.text_config.index_topk == text.index_topk


def test_text_only_config_has_no_vision():
    config = DeepseekV41Config(
        text_config=DeepseekV41Config.from_preset("tiny").text_config.to_dict(), vision_config=None
    )
    assert not config.has_vision


TINY = DeepseekV41Config.from_preset("tiny").text_config.to_dict()


@pytest.mark.parametrize(
    "override, message",
    [
        ({"compress_ratios": [0, 2, 2]}, "compress_ratios has 3 entries"),
        ({"compress_ratios": [0, 0, 2, 1, 1, 1]}, "does not compress"),
        ({"kv_source_layer_ids": [1], "index_source_layer_ids": [1, 3, 5]}, "same ratio"),
        ({"index_topk": 64, "candidate_topk_blocks": 3}, "cannot fill index_topk"),
        ({"num_attention_heads": 3}, "divisible by o_groups"),
        ({"head_dim": 48}, "multiple of 32"),
        ({"qk_rope_head_dim": 15}, "must be even"),
        ({"num_experts_per_tok": 5}, "exceeds n_routed_experts"),
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"engram_num_embeddings": [660]}, "one table size per Engram layer"),
        ({"candidate_source_layer_id": 2}, "must be a KV source"),
    ],
)
def test_text_config_validation(override, message):
    with pytest.raises(ValueError, match=message):
        DeepseekV41TextConfig(**{**TINY, **override})


def test_vision_config_validation():
    with pytest.raises(ValueError, match="divisible by 4"):
        DeepseekV41VisionConfig(hidden_size=60, num_attention_heads=6)
    with pytest.raises(ValueError, match="positive integer"):
        DeepseekV41VisionConfig(patch_size=0)


@pytest.mark.parametrize(
    "drop, message",
    [
        (("text_config",), "missing 'text_config'"),
        (("text_config", "hidden_size"), "text_config is missing 'hidden_size'"),
        (("text_config", "vocab_size"), "text_config is missing 'vocab_size'"),
        (("text_config", "num_hidden_layers"), "text_config is missing 'num_hidden_layers'"),
    ],
)
def test_config_json_missing_a_size_key_is_a_clear_error(tmp_path, drop, message):
    """Without the key the released defaults (749B) would build silently; from_pretrained names the key instead."""
    config_dict = DeepseekV41Config.from_preset("tiny").to_dict()
    owner = config_dict
    for key in drop[:-1]:
        owner = owner[key]
    del owner[drop[-1]]
    (tmp_path / "config.json").write_text(json.dumps(config_dict))
    with pytest.raises(ValueError, match=message):
        DeepseekV41Config.from_pretrained(tmp_path)


@pytest.mark.parametrize("key", ["dim", "vocab_size"])
def test_flat_reference_config_missing_a_size_key_is_a_clear_error(fixtures_dir, key):
    ref = json.loads((fixtures_dir / "v41_tiny_vl/dense/config.json").read_text())
    del ref[key]
    with pytest.raises(ValueError, match=f"flat reference config is missing '{key}'"):
        DeepseekV41Config.from_dict(ref)


def test_a_config_that_is_not_an_object_is_a_clear_error():
    with pytest.raises(ValueError, match="must be a JSON object, got list"):
        DeepseekV41Config.from_dict([1, 2])


def test_the_released_config_json_gives_the_preset(fixtures_dir, tmp_path):
    """The release's own config.json (its published key names: `rope_scaling`, `dspark_num_experts_per_tok`,
    `topk_method`, a root `quantization_config`) loads through the Auto classes as the `deepseek-v4.1-flash` preset,
    and the preset and a saved config use those names."""
    import shutil

    from transformers import AutoConfig

    import modeling_dsv41  # noqa: F401  (registers the Auto classes)
    from modeling_dsv41 import DeepseekV41ForCausalLM
    from modeling_dsv41.placement import meta_instance

    published = json.loads((fixtures_dir / "released_config/config.json").read_text())
    shutil.copy(fixtures_dir / "released_config/config.json", tmp_path / "config.json")
    config = AutoConfig.from_pretrained(tmp_path)
    preset = DeepseekV41Config.from_preset("deepseek-v4.1-flash")
    assert {**config.to_dict(), "_name_or_path": ""} == preset.to_dict()
    text = config.text_config
    assert (text.dspark_top_k, text.dspark_num_routed_experts) == (3, 128)  # the draft head's top-3 of 128
    assert text.compress_rope_scaling == published["text_config"]["rope_scaling"]  # YaRN on the compressed layers
    assert config.quantization_config == published["quantization_config"]  # the native storage it describes
    assert sum(p.numel() for p in meta_instance(config, DeepseekV41ForCausalLM).parameters()) == 763_205_284_306
    config.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved/config.json").read_text())
    for key, value in published["text_config"].items():
        assert saved["text_config"][key] == value, key
    assert saved["quantization_config"] == published["quantization_config"]
    preset_file = json.loads((PRESETS_DIR / "deepseek-v4.1-flash.json").read_text())
    assert set(published["text_config"]) <= set(preset_file["text_config"])


def test_routing_other_than_noaux_tc_is_refused():
    text = DeepseekV41Config.from_preset("tiny").text_config.to_dict()
    with pytest.raises(ValueError, match="noaux_tc"):
        DeepseekV41TextConfig(**{**text, "topk_method": "greedy"})


def test_the_attribute_name_wins_over_the_config_json_name():
    """``{**config.to_dict(), "compress_rope_scaling": ...}`` (the attribute's name over the serialized
    ``rope_scaling``) takes the new value; so does ``dspark_num_experts_per_tok`` over DeepSeek's name."""
    text = DeepseekV41Config.from_preset("tiny").text_config.to_dict()
    assert "rope_scaling" in text and "compress_rope_scaling" not in text  # the published name
    yarn = {**text["rope_scaling"], "factor": 8}
    assert DeepseekV41TextConfig(**{**text, "compress_rope_scaling": yarn}).compress_rope_scaling == yarn
    both = {**text, "dspark_num_experts_per_tok": 1, "dspark_n_activated_experts": 2}
    assert DeepseekV41TextConfig(**both).dspark_num_experts_per_tok == 1


def test_deepseek_inference_name_of_the_draft_top_k_is_read():
    text = DeepseekV41Config.from_preset("tiny").text_config.to_dict()
    text.pop("dspark_num_experts_per_tok", None)
    assert DeepseekV41TextConfig(**text, dspark_n_activated_experts=1).dspark_num_experts_per_tok == 1


def _plan_from_fields(text):
    """The layer plan re-derived from the five schedule fields, as each consumer once did."""
    n, ratios = text.num_hidden_layers, text.compress_ratios
    kv = [i for i in text.kv_source_layer_ids if i < n]
    index = [i for i in text.index_source_layer_ids if i < n]
    cand = text.candidate_source_layer_id
    rows = []
    for i in range(n):
        compressed = ratios[i] > 0
        rows.append(
            (
                ratios[i],
                max(s for s in kv if s <= i) if compressed else None,
                max(s for s in index if s <= i) if compressed else None,
                cand if compressed and i in index and 0 <= cand < i else None,
                i == cand,
                text.engram_layer_ids.index(i) if i in text.engram_layer_ids else None,
            )
        )
    return rows


def test_the_layer_plan_follows_the_schedule_fields(fixtures_dir):
    """The tiny preset's and the release's config.json's plans: one spec per layer, as the fields say; the names
    read the roles; not serialized (the config.json keys stay the five fields)."""
    tiny = DeepseekV41Config.from_preset("tiny").text_config
    released = DeepseekV41Config.from_pretrained(fixtures_dir / "released_config").text_config
    for text in (tiny, released):
        plan = text.layer_plan
        assert [spec.layer_id for spec in plan] == list(range(text.num_hidden_layers))
        assert [
            (
                s.compress_ratio,
                s.kv_source_id,
                s.index_source_id,
                s.candidate_source_id,
                s.is_candidate_source,
                s.engram_index,
            )
            for s in plan
        ] == _plan_from_fields(text)
        assert [s.layer_id for s in plan if s.is_kv_source] == [i for i in text.kv_source_layer_ids if i < len(plan)]
        assert text.layer_plan is plan  # built once
        assert not {"layer_plan", "layer_kinds"} & set(text.to_dict())
    assert tiny.layer_kinds == [
        "engram+window",
        "engram+compressed_2+kv_source+index_source",
        "compressed_2",
        "compressed_1+kv_source+index_source+candidate_source",
        "compressed_1",
        "compressed_1+index_source",
    ]
    kinds = released.layer_kinds
    assert kinds[:3] == ["window", "engram+window", "compressed_2+kv_source+index_source"]
    assert kinds[14] == "engram+compressed_2+kv_source+index_source"
    assert kinds[20] == "compressed_1+kv_source+index_source+candidate_source"
    assert kinds.count("compressed_1+index_source") == 4 and len(kinds) == 40
    assert released.layer_spec(41).kind == "window"  # a DSpark draft block's attention


def test_a_bad_layer_schedule_is_refused_once_with_a_clear_error():
    text = DeepseekV41TextConfig(**TINY)
    text.compress_ratios = [0, 2, 2, 2, 1, 1]  # the KV source 3 now pools 2-to-1: layer 4 (1-to-1) has none
    with pytest.raises(ValueError, match="compressed layer 4 .ratio 1. needs a preceding KV source with the same"):
        text.layer_plan
    with pytest.raises(ValueError, match="engram_layer_ids must be increasing layer ids below 6"):
        DeepseekV41TextConfig(**{**TINY, "engram_layer_ids": [1, 0]})
