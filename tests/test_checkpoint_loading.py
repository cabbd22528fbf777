"""from_pretrained on DeepSeek-V4.1 checkpoints: the golden fixture folder as is, the released storage format (FP8 /
packed FP4 / E8M0 scales, checked against the reference's own dequantized values), the Engram token map, our own
save → load round trip."""

import json
import logging
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

import modeling_dsv41  # noqa: F401  (registers the Auto classes)
from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41 import codec
from modeling_dsv41.released import conversions
from modeling_dsv41.codec import (
    dequantize_released_weight,
    quantize_fp4_rows,
    quantize_fp8_block,
    quantize_fp8_rows,
)
from modeling_dsv41.released.reading import stores_scales
from modeling_dsv41.released.writing import released_state_dict, save_released_checkpoint
from reference_fixture import (
    QUANT_FORMAT_TEXT,
    dequantize_released_tensor,
    fixture_checkpoint,
    reference_inputs,
    reference_model,
    stub_tokenizer,
)


def _load(folder, **kwargs):
    return DeepseekV41ForCausalLM.from_pretrained(folder, **kwargs)


def _load_dequantized(folder, **kwargs):
    """The released storage dequantized on load (by default FP8 Linears and FP4 experts stay as stored: see
    test_native_precision.py)."""
    return _load(folder, quantization_config=FineGrainedFP8Config(dequantize=True), **kwargs)


def released_view(model: DeepseekV41ForCausalLM, name: str) -> torch.Tensor:
    """The tensor of ``model`` a released name denotes, written out independently of the conversion code: the
    ``model.`` prefix, ``head`` → ``lm_head``, and expert ``e``'s ``w1``/``w3`` = rows ``[:I]``/``[I:]`` of
    ``gate_up_proj[e]``, its ``w2`` = ``down_proj[e]``."""
    routed = re.fullmatch(r"(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight", name)
    if routed is None:
        ours = "lm_head.weight" if name == "head.weight" else f"model.{name}"
        return model.get_buffer(ours) if ".gate.bias" in ours else model.get_parameter(ours)
    experts, e, w = model.get_submodule(f"model.{routed[1]}"), int(routed[2]), routed[3]
    inter = experts.intermediate_dim
    return {"w1": experts.gate_up_proj[e, :inter], "w3": experts.gate_up_proj[e, inter:], "w2": experts.down_proj[e]}[
        w
    ]


@pytest.fixture(scope="module")
def fixture_folder(fixtures_dir, tmp_path_factory):
    return fixture_checkpoint(fixtures_dir, "dense", tmp_path_factory.mktemp("fixture") / "dense")


# ---------------------------------------------------------------------------------------------------------------------
# The fixture folder (reference names and dtypes, FP8 Engram tables, flat reference config)
# ---------------------------------------------------------------------------------------------------------------------


def test_fixture_folder_loads_like_the_reference_model(fixtures_dir, fixture_folder):
    model = _load(fixture_folder, dtype=torch.bfloat16)
    reference = reference_model(fixtures_dir, "dense", emulate_quantization=True)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():  # the reference's dtypes: fp32 mHC, sinks, biases, ratio-2 compressor, head
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    # the token map built from tokenizer.json is the fixture's stub map
    token_map = load_file(fixtures_dir / "v41_tiny_vl/engram.safetensors")["token_map"]
    assert torch.equal(model.model.engram_hasher.token_map, token_map)

    # same tensors, same dtypes: the same model as test_parity's, so in reference numerics its logits are the
    # reference's run in the mode, bit for bit (tests/data)
    model.config.reference_numerics = True
    with torch.no_grad():
        logits = model(**reference_inputs(fixtures_dir)).logits[0]
    expected = load_file(Path(__file__).parent / "data/reference_qdq.safetensors")["dense_fixture_logits"]
    assert torch.equal(logits, expected)


def test_reference_dtypes_survive_a_bf16_load(fixture_folder):
    model = _load(fixture_folder, dtype=torch.bfloat16)
    backbone = model.model
    assert backbone.layers[1].attn.compressor.wkv.weight.dtype == torch.float32  # ratio 2: pooled in fp32
    assert backbone.layers[3].attn.compressor.wkv.weight.dtype == torch.bfloat16  # ratio 1: a plain projection
    assert backbone.vision.norm.weight.dtype == backbone.vision.blocks[0].norm1.weight.dtype == torch.float32
    assert model.lm_head.weight.dtype == backbone.layers[0].hc_attn_fn.dtype == torch.float32
    assert backbone.layers[0].ffn.gate.bias.dtype == torch.float32


def test_fp8_engram_tables_load_as_stored(fixtures_dir, fixture_folder):
    config = DeepseekV41Config.from_pretrained(fixture_folder)
    config.text_config.engram_table_dtype = "fp8"
    model = _load(fixture_folder, config=config, dtype=torch.bfloat16)
    stored = load_file(fixtures_dir / "v41_tiny_vl/model.safetensors")
    for layer in (0, 1):
        table = model.model.layers[layer].engram.embed
        assert table.weight.dtype == torch.float8_e4m3fn and table.scale.dtype == torch.float8_e8m0fnu
        assert torch.equal(
            table.weight.view(torch.uint8), stored[f"layers.{layer}.engram.embed.weight"].view(torch.uint8)
        )
        assert torch.equal(
            table.scale.view(torch.uint8), stored[f"layers.{layer}.engram.embed.scale"].view(torch.uint8)
        )
    # looked up, every row reads what the float-table model (the reference's bf16 dequantization) holds
    dequantized = _load(fixture_folder, dtype=torch.bfloat16)
    for layer, rows in ((0, 660), (1, 864)):
        rows = torch.arange(rows)
        assert torch.equal(
            model.model.layers[layer].engram.embed(rows), dequantized.model.layers[layer].engram.embed(rows)
        )


def test_missing_token_map_is_a_clear_error_unless_a_tokenizer_is_given(fixtures_dir, tmp_path):
    folder = fixture_checkpoint(fixtures_dir, "dense", tmp_path / "no_tokenizer", with_tokenizer=False)
    with pytest.raises(ValueError, match="no compressed token map.*engram_tokenizer"):
        _load(folder, dtype=torch.bfloat16)
    model = _load(folder, dtype=torch.bfloat16, engram_tokenizer=stub_tokenizer())
    assert torch.equal(model.model.engram_hasher.token_map, torch.arange(512) // 2)


@pytest.mark.parametrize("table_dtype", ["float", "fp8"])
def test_save_then_load_is_bit_exact(fixture_folder, tmp_path, table_dtype):
    config = DeepseekV41Config.from_pretrained(fixture_folder)
    config.text_config.engram_table_dtype = table_dtype
    model = _load(fixture_folder, config=config, dtype=torch.bfloat16)
    # transformers' default: the released names (plain weights, token map included, no tokenizer.json needed)
    model.save_pretrained(tmp_path / "released")
    saved = load_file(tmp_path / "released/model.safetensors")
    assert "engram_hasher.token_map" in saved and "head.weight" in saved
    assert "layers.0.ffn.experts.0.w1.weight" in saved and not any(".gate_up_proj" in name for name in saved)
    assert not any(name.endswith(".scale") and "engram.embed" not in name for name in saved)
    model.save_pretrained(tmp_path / "ours", save_original_format=False)  # our names
    saved = load_file(tmp_path / "ours/model.safetensors")
    assert "model.engram_hasher.token_map" in saved and "lm_head.weight" in saved
    assert "model.layers.0.ffn.experts.gate_up_proj" in saved and not any(".experts.0." in name for name in saved)
    before = model.state_dict()
    for layout in ("released", "ours"):
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / layout, dtype=torch.bfloat16)
        assert isinstance(reloaded, DeepseekV41ForCausalLM)
        after = reloaded.state_dict()
        assert before.keys() == after.keys()
        for name, tensor in before.items():
            assert after[name].dtype == tensor.dtype, name
            assert torch.equal(after[name].view(torch.uint8), tensor.view(torch.uint8)), (layout, name)


# ---------------------------------------------------------------------------------------------------------------------
# The released storage format, against the reference's dequantized values (fixtures/quant_format)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quant_format(fixtures_dir):
    stored = load_file(fixtures_dir / "quant_format/checkpoint_format.safetensors")
    expected = load_file(fixtures_dir / "quant_format/dequantized_fp32.safetensors")
    return stored, expected


@pytest.fixture(scope="module")
def released_folder(quant_format, tmp_path_factory):
    """A random model in the released format, sharded, with the fixture's stored tensors at their own names (an FP8
    ``wo_a`` among them), plus the DSpark head and image_pad tensors the release also carries."""
    stored, _ = quant_format
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(DeepseekV41Config(text_config=QUANT_FORMAT_TEXT))
    state = released_state_dict(model)
    for name, tensor in stored.items():
        if not name.startswith("synthetic."):
            assert name in state and state[name].shape == tensor.shape, name
            state[name] = tensor
    state["mtp.0.attn.wq_a.weight"], state["mtp.0.attn.wq_a.scale"] = quantize_fp8_block(torch.randn(64, 256))
    state["image_pad"] = torch.randn(256, dtype=torch.bfloat16)
    folder = tmp_path_factory.mktemp("released")
    save_released_checkpoint(model, folder, max_shard_bytes=1 << 20, state_dict=state)
    stub_tokenizer().save(str(folder / "tokenizer.json"))
    return folder, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_released_checkpoint_dequantizes_like_the_reference(quant_format, released_folder, dtype, caplog):
    _, expected = quant_format
    folder, state = released_folder
    assert len(list(folder.glob("model-*.safetensors"))) > 1  # really sharded, with an index
    with caplog.at_level(logging.WARNING):
        model, info = _load_dequantized(folder, dtype=dtype, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ignored = [r for r in caplog.records if "mtp.*" in r.getMessage()]
    assert len(ignored) == 1 and "Ignoring 2 checkpoint weights" in ignored[0].getMessage()  # mtp (+ scale), image_pad

    for name, values in expected.items():
        if not name.startswith("synthetic."):
            ours = released_view(model, name)
            assert ours.dtype == dtype and torch.equal(ours, values.to(dtype)), name
    # every other quantized tensor (the FP4 experts merged into gate_up_proj / down_proj among them) reads as the
    # reference kernels read it
    for name, tensor in state.items():
        if name.endswith(".scale") and not name.startswith("mtp."):
            weight_name = name[: -len("scale")] + "weight"
            reference = dequantize_released_tensor(state[weight_name], tensor)
            assert torch.equal(released_view(model, weight_name), reference.to(dtype)), weight_name
    # what is not quantized keeps its values and its reference dtype
    assert model.model.layers[1].attn.compressor.wgate.weight.dtype == torch.float32
    assert torch.equal(model.model.layers[0].attn_norm.weight, state["layers.0.attn_norm.weight"].to(dtype))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.randint(0, 500, (1, 9))).logits).all()


def test_released_checkpoints_are_read_one_tensor_at_a_time(released_folder, fixture_folder, monkeypatch):
    """transformers' prefetching thread pool would hold every quantized tensor, cast up, until its turn."""
    folder, _ = released_folder
    seen = []
    dequantize = conversions.dequantize_released_weight

    def recording(*args):
        seen.append(os.environ.get("HF_DEACTIVATE_ASYNC_LOAD"))
        return dequantize(*args)

    monkeypatch.delenv("HF_DEACTIVATE_ASYNC_LOAD", raising=False)
    monkeypatch.setattr(conversions, "dequantize_released_weight", recording)
    _load_dequantized(folder, dtype=torch.bfloat16)
    assert seen and set(seen) == {"1"}
    assert "HF_DEACTIVATE_ASYNC_LOAD" not in os.environ  # restored
    assert stores_scales(folder) and stores_scales(fixture_folder)  # the fixture's Engram tables have scales


def test_dequantizing_after_the_loader_cast_equals_the_reference(quant_format, monkeypatch):
    """The loader hands the op its sources cast to the parameter dtype; bf16 keeps FP8 values, FP4 bytes and E8M0
    scales exactly. Chunking over rows (with a partial last 32-row block: the 40-row case) changes nothing."""
    stored, expected = quant_format
    monkeypatch.setattr(codec, "_CHUNK_ELEMENTS", 1)  # one 32-row block per chunk
    for name, values in expected.items():
        weight, scale = stored[name], stored[name[: -len("weight")] + "scale"]
        columns = values.shape[1]
        for cast in (None, torch.bfloat16, torch.float32):
            w, s = (weight, scale) if cast is None else (weight.to(cast), scale.to(cast))
            out = dequantize_released_weight(w, s, columns, torch.float32)
            assert torch.equal(out, values), (name, cast)


def test_float16_cannot_hold_every_e8m0_scale(quant_format):
    stored, _ = quant_format
    weight, scale = stored["layers.1.attn.wq_a.weight"], stored["layers.1.attn.wq_a.scale"]
    tiny = torch.full_like(scale.float(), 2.0**-30).to(torch.float8_e8m0fnu)  # flushes to 0 in float16
    with pytest.raises(ValueError, match="bfloat16"):
        dequantize_released_weight(weight.half(), tiny.half(), 256, torch.float16)


@pytest.mark.parametrize(
    "quantize, shape", [(quantize_fp8_block, (70, 96)), (quantize_fp8_rows, (40, 64)), (quantize_fp4_rows, (40, 64))]
)
def test_released_writers_round_trip_within_format_precision(quantize, shape):
    torch.manual_seed(0)
    weight = torch.randn(shape)
    stored, scale = quantize(weight)
    values = dequantize_released_tensor(stored, scale)
    # e4m3 rounds to within 1/16 of a value; e2m1 values x/s lie in (3, 6] where the grid step is at most 2 = 2s/s, so
    # the error is at most s <= amax/3
    bound = 1 / 3 if quantize is quantize_fp4_rows else 1 / 16
    blocks = weight.abs().unflatten(1, (-1, 32)).amax(-1, keepdim=True).expand(-1, -1, 32).flatten(1)
    assert ((values - weight).abs() <= bound * blocks).all()


# ---------------------------------------------------------------------------------------------------------------------
# Writing the released layout again: names and values round-trip
# ---------------------------------------------------------------------------------------------------------------------


def test_save_original_format_writes_the_released_names_and_reloads(fixtures_dir, fixture_folder, tmp_path):
    """``save_pretrained(save_original_format=True)``: the fixture's own key names (experts split per expert again,
    ``head``, no ``model.`` prefix), plain values, and a reload equal to the model."""
    model = _load(fixture_folder, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path, save_original_format=True)
    saved = load_file(tmp_path / "model.safetensors")
    released = load_file(fixtures_dir / "v41_tiny_vl/model.safetensors")
    # the Engram tables are written dequantized (no scale), and our token map comes along
    assert set(saved) == {k for k in released if not k.endswith("engram.embed.scale")} | {"engram_hasher.token_map"}
    for name, tensor in saved.items():
        if name != "engram_hasher.token_map":
            assert torch.equal(tensor, released_view(model, name)), name
            if "engram.embed" not in name:  # stored plain in the fixture: the same values again
                assert torch.equal(tensor.float(), released[name].float()), name
    inter = model.config.text_config.moe_intermediate_size
    assert torch.equal(
        saved["layers.0.ffn.experts.1.w3.weight"], model.model.layers[0].ffn.experts.gate_up_proj[1, inter:]
    )
    reloaded = _load(tmp_path, dtype=torch.bfloat16)
    before, after = model.state_dict(), reloaded.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name


def test_released_storage_round_trips_and_loads_without_a_dtype(released_folder, tmp_path):
    """A released-format folder (FP8 / packed FP4 + E8M0 scales) loads with a plain ``from_pretrained(path)`` (bf16,
    no "unknown dtype F8_E8M0"), and writing it again with save_released_checkpoint gives the same names, dtypes
    and shapes, and loads back to the same values. (Bytes may differ: the fixture's tensors were quantized by the
    reference, which may pick a larger power-of-two scale than ours for the same values.)"""
    folder, state = released_folder
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["metadata"]["dtype"] == "bfloat16"  # what transformers reads when the config names no dtype
    model = _load_dequantized(folder)
    assert model.model.layers[0].attn.wq_a.weight.dtype == torch.bfloat16
    assert model.model.layers[0].ffn.experts.gate_up_proj.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.float32
    again = released_state_dict(model)
    expected = {k: v for k, v in state.items() if not k.startswith("mtp.") and k != "image_pad"}
    assert again.keys() == expected.keys()
    for name, tensor in expected.items():
        ours = again[name]
        assert ours.shape == tensor.shape, name
        quantized = name.endswith(".scale") or tensor.dtype in (torch.float8_e4m3fn, torch.int8)
        if quantized:
            assert ours.dtype == tensor.dtype, name
        else:  # plain tensors come back in the dtype they were loaded in
            assert torch.equal(ours.float(), tensor.to(ours.dtype).float()), name
        if name.endswith(".scale"):  # dequantized, the values are the stored ones
            weight = name[: -len("scale")] + "weight"
            assert torch.equal(
                dequantize_released_tensor(again[weight], ours), dequantize_released_tensor(state[weight], tensor)
            ), weight
    save_released_checkpoint(model, tmp_path)
    reloaded = _load_dequantized(tmp_path, engram_tokenizer=stub_tokenizer())
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def _stored_tensors(folder: Path) -> dict[str, torch.Tensor]:
    stored = {}
    for shard in sorted(folder.glob("*.safetensors")):
        stored.update(load_file(shard))
    return stored


@pytest.mark.parametrize("case", ["float_tables", "fp8_tables", "dspark_vision"])
def test_a_natively_loaded_released_folder_is_written_back_byte_for_byte(fixtures_dir, tmp_path, case):
    """A released folder loaded natively (FP8 Linears and FP4 experts as stored; ``wo_a``, Engram ``wkv``, the draft
    head and, unless ``engram_table_dtype="fp8"``, the Engram tables dequantized) and written in the released layout
    again holds the source's tensor names, dtypes and bytes. The source is what save_released_checkpoint writes for a
    model in the reference dtypes (bf16, fp32 where the reference keeps fp32)."""
    if case == "dspark_vision":
        reference = json.loads((fixtures_dir / "v41_tiny_dspark/config.json").read_text())
        config = DeepseekV41Config.from_dict({**reference, "dspark_n_routed_experts": 2})
    else:
        config = DeepseekV41Config(text_config=QUANT_FORMAT_TEXT)
    torch.manual_seed(0)
    DeepseekV41ForCausalLM(config).save_pretrained(tmp_path / "ours")
    source = tmp_path / "released"
    save_released_checkpoint(_load(tmp_path / "ours", dtype=torch.bfloat16), source, max_shard_bytes=1 << 20)
    stub_tokenizer().save(str(source / "tokenizer.json"))
    config = DeepseekV41Config.from_pretrained(source)
    config.text_config.engram_table_dtype = "fp8" if case == "fp8_tables" else "float"
    native = _load(source, config=config)
    assert native.model.layers[0].attn.wq_a.weight.dtype == torch.float8_e4m3fn  # really kept as stored
    assert native.model.layers[0].ffn.experts.gate_up_proj.dtype == torch.int8
    save_released_checkpoint(native, tmp_path / "again", max_shard_bytes=1 << 20)
    stored, written = _stored_tensors(source), _stored_tensors(tmp_path / "again")
    assert written.keys() == stored.keys()
    for name, tensor in stored.items():
        assert (written[name].dtype, written[name].shape) == (tensor.dtype, tensor.shape), name
        assert torch.equal(written[name].flatten().view(torch.uint8), tensor.flatten().view(torch.uint8)), name
