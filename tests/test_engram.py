"""Engram: n-gram hasher and gated memory block against DeepSeek's reference (fixtures v41_tiny_vl)."""

import json
import logging as std_logging
import re
import unicodedata

import pytest
import torch
from safetensors.torch import load_file

from configuration.configuration_dsv41 import DeepseekV41Config, DeepseekV41TextConfig
from modeling_dsv41.engram import (
    DEAD,
    DeepseekV41Engram,
    DeepseekV41NgramHasher,
    build_compressed_token_map,
    dequantize_engram_table,
    engram_primes,
)
from modeling_dsv41.generation.cache import DeepseekV41Cache

CAPTURES = "v41_tiny_vl/dense/captures_noqdq.safetensors"


@pytest.fixture(scope="module")
def tiny(fixtures_dir):
    """Text config, shared fixture tensors and a hasher whose token map comes from the fixture."""
    reference = json.loads((fixtures_dir / "v41_tiny_vl/dense/config.json").read_text())
    config = DeepseekV41Config.from_reference_dict(reference).text_config
    engram = load_file(fixtures_dir / "v41_tiny_vl/engram.safetensors")
    inputs = load_file(fixtures_dir / "v41_tiny_vl/inputs.safetensors")
    captures = load_file(fixtures_dir / CAPTURES)
    return config, engram, inputs, captures


def make_hasher(config, token_map):
    hasher = DeepseekV41NgramHasher(config)
    hasher.load_state_dict({"token_map": token_map})
    return hasher


# ---------------------------------------------------------------------------------------------------
# hash constants
# ---------------------------------------------------------------------------------------------------
def test_hash_constants_match_reference(tiny):
    config, engram, _, _ = tiny
    hasher = DeepseekV41NgramHasher(config)
    for name in ("primes", "multipliers", "offsets"):
        assert torch.equal(getattr(hasher, name), engram[name]), name
    # the bucket ranges tile each table exactly
    rows = hasher.offsets[:, -1] + hasher.primes[:, -1, -1]
    assert torch.equal(rows, engram["num_embeddings"])
    hasher.load_state_dict({"token_map": engram["token_map"]})
    assert hasher.token_map[hasher.pad_token_id].item() == engram["pad_id"].item()


def test_released_prime_search_fills_released_tables():
    # the released table sizes are the sums of the 24 primes searched from 16,000,000, per layer
    released = DeepseekV41TextConfig()
    primes = engram_primes(
        len(released.engram_layer_ids),
        released.engram_max_ngram_size,
        released.engram_n_heads,
        released.engram_vocab_size,
    )
    sums = [sum(sum(per_ngram) for per_ngram in layer) for layer in primes]
    assert sums == released.engram_num_embeddings
    flat = [p for layer in primes for per_ngram in layer for p in per_ngram]
    assert len(set(flat)) == len(flat) == 48


def test_too_small_table_is_rejected(tiny):
    config, *_ = tiny
    small = DeepseekV41TextConfig(**{**config.to_dict(), "engram_num_embeddings": [659, 864]})
    with pytest.raises(ValueError, match="need 660 rows"):
        DeepseekV41NgramHasher(small)


def test_init_buffers_restores_derived_buffers_and_keeps_loaded_map(tiny):
    config, engram, _, _ = tiny
    hasher = make_hasher(config, engram["token_map"])
    assert set(hasher.state_dict()) == {"token_map"}  # the derived buffers are not saved
    for name in ("primes", "multipliers", "offsets"):
        getattr(hasher, name).fill_(7)  # transformers leaves them as uninitialized memory
    hasher.token_map._is_hf_initialized = True  # loaded from the checkpoint
    hasher.init_buffers()
    for name in ("primes", "multipliers", "offsets"):
        assert torch.equal(getattr(hasher, name), engram[name]), name
    assert torch.equal(hasher.token_map, engram["token_map"])

    del hasher.token_map._is_hf_initialized  # missing from the checkpoint: back to the default map
    hasher.init_buffers()
    assert not hasher.has_token_map and hasher.uses_default_token_map
    assert torch.equal(hasher.token_map, torch.arange(config.vocab_size) % config.engram_compressed_vocab_size)


# ---------------------------------------------------------------------------------------------------
# hash ids
# ---------------------------------------------------------------------------------------------------
def test_hash_ids_match_reference(tiny):
    config, engram, inputs, captures = tiny
    hasher = make_hasher(config, engram["token_map"])
    image_mask = inputs["token_types"] >= 0
    compressed = hasher.compress(inputs["input_ids"], image_mask)
    assert torch.equal(compressed[0], captures["engram.compressed_tokens"])
    hash_ids = hasher(inputs["input_ids"], image_mask)
    assert hash_ids.shape == (1, 57, 2, 6)
    assert torch.equal(hash_ids[0], captures["engram.hash_ids"])


@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_hashing_equals_full(tiny, chunk):
    config, engram, inputs, _ = tiny
    hasher = make_hasher(config, engram["token_map"])
    image_mask = inputs["token_types"] >= 0
    full = hasher(inputs["input_ids"], image_mask)
    compressed = hasher.compress(inputs["input_ids"], image_mask)
    cache, steps = DeepseekV41Cache(config), []  # the decode cache keeps the history
    for start in range(0, compressed.size(1), chunk):
        piece = compressed[:, start : start + chunk]
        steps.append(hasher.hash_ids_from_compressed(piece, cache.engram_past(hasher.history_size)))
        cache.update_engram_history(piece, torch.full((1,), piece.size(1)), hasher.history_size)
    assert torch.equal(torch.cat(steps, dim=1), full)


def test_left_padding_acts_as_sequence_start(tiny):
    config, engram, inputs, _ = tiny
    hasher = make_hasher(config, engram["token_map"])
    ids, image_mask = inputs["input_ids"], inputs["token_types"] >= 0
    n_pad = 10  # both rows end together; row 0 is the sequence from position 10, left-padded with junk ids
    short, short_mask = ids[:, n_pad:], image_mask[:, n_pad:]
    batch = torch.stack([torch.cat([torch.full((n_pad,), -100), short[0]]), ids[0]])
    attention_mask = torch.stack([torch.arange(57) >= n_pad, torch.ones(57, dtype=torch.bool)]).long()
    mask = torch.stack([torch.cat([torch.zeros(n_pad, dtype=torch.bool), short_mask[0]]), image_mask[0]])
    hashes = hasher(batch, mask, attention_mask)
    assert torch.equal(hashes[0, n_pad:], hasher(short, short_mask)[0])
    assert torch.equal(hashes[1], hasher(ids, image_mask)[0])
    # had the pad positions been read as tokens, the first real positions would hash differently
    unmasked = hasher(batch[:1].clone().index_fill_(1, torch.arange(n_pad), 5), mask[:1])
    assert not torch.equal(unmasked[0, n_pad], hashes[0, n_pad])


def test_without_a_tokenizer_the_default_map_is_used_with_a_warning(tiny, caplog):
    config, engram, inputs, _ = tiny
    hasher = DeepseekV41NgramHasher(config)
    assert hasher.uses_default_token_map and not hasher.has_token_map
    expected = torch.arange(config.vocab_size) % config.engram_compressed_vocab_size
    assert torch.equal(hasher.token_map, expected)
    std_logging.Logger.warning_once.cache_clear()  # transformers' once-only cache, shared by all loggers
    with caplog.at_level("WARNING", logger="modeling_dsv41.engram"):
        hashes = hasher(inputs["input_ids"])
    assert "default compressed token map" in caplog.text
    # the same ids as a hasher given that map explicitly, which no longer counts as the default
    explicit = make_hasher(config, expected)
    assert not explicit.uses_default_token_map and explicit.has_token_map
    assert torch.equal(hashes, explicit(inputs["input_ids"]))
    # and not the hashes of the tokenizer-built map released tables need
    assert not torch.equal(hashes, make_hasher(config, engram["token_map"])(inputs["input_ids"]))


def test_warning_names_the_hasher_of_both_classes_and_stops_once_the_map_is_written_in_place(tiny, caplog):
    config, engram, inputs, _ = tiny
    hasher = DeepseekV41NgramHasher(config)
    std_logging.Logger.warning_once.cache_clear()
    with caplog.at_level("WARNING", logger="modeling_dsv41.engram"):
        hasher(inputs["input_ids"])
    assert "`model.model.engram_hasher.load_tokenizer(tokenizer)` on a DeepseekV41ForCausalLM" in caplog.text
    assert "`model.engram_hasher.load_tokenizer(tokenizer)` on a DeepseekV41Model" in caplog.text
    # a map written in place (as benchmarks/forward.py does) is no longer the default: no warning, no folding
    with torch.no_grad():
        hasher.token_map.copy_(engram["token_map"])
    assert not hasher.uses_default_token_map and hasher.has_token_map
    std_logging.Logger.warning_once.cache_clear()
    caplog.clear()
    with caplog.at_level("WARNING", logger="modeling_dsv41.engram"):
        hashes = hasher(inputs["input_ids"])
    assert "default compressed token map" not in caplog.text
    assert torch.equal(hashes, make_hasher(config, engram["token_map"])(inputs["input_ids"]))
    with pytest.raises(ValueError, match="no compressed Engram id"):
        hasher(torch.tensor([[5, config.vocab_size + 3]]))  # ids beyond the map no longer fold as the default's
    # writing the default map back (or moving the buffer) is the default again
    with torch.no_grad():
        hasher.token_map.copy_(torch.arange(config.vocab_size) % config.engram_compressed_vocab_size)
    assert hasher.uses_default_token_map


def test_default_map_covers_ids_added_by_a_resize(tiny):
    config, engram, _, _ = tiny
    hasher = DeepseekV41NgramHasher(config)
    ids = torch.tensor([[5, config.vocab_size + 3, 7]])  # an id beyond the map, as after resize_token_embeddings
    folded = ids % config.engram_compressed_vocab_size
    assert torch.equal(hasher(ids), hasher(folded))
    with pytest.raises(ValueError, match=rf"input ids \[{config.vocab_size + 3}\]"):
        make_hasher(config, engram["token_map"])(ids)  # a tokenizer's map knows nothing of new tokens


def test_model_from_config_trains_saves_and_reloads_without_a_tokenizer(tmp_path):
    from modeling_dsv41 import DeepseekV41ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(DeepseekV41Config.from_preset("tiny"))
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(
        table.weight.grad is not None for table in (layer.engram.embed for layer in model.model.layers if layer.engram)
    )
    model.eval().save_pretrained(tmp_path)  # no tokenizer.json beside the weights
    reloaded = DeepseekV41ForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.model.engram_hasher.has_token_map  # the saved default map counts as the checkpoint's own
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


def test_ids_outside_the_map_raise(tiny):
    config, engram, _, _ = tiny
    token_map = engram["token_map"].clone()
    token_map[300:] = DEAD  # as if the tokenizer had only 300 tokens
    hasher = make_hasher(config, token_map)
    with pytest.raises(ValueError, match=r"input ids \[301\]"):
        hasher(torch.tensor([[5, 301, 7]]))
    with pytest.raises(ValueError, match=r"input ids \[-3\]"):
        hasher(torch.tensor([[5, -3, 7]]))
    hasher(torch.tensor([[5, 301, 7]]), image_mask=torch.tensor([[False, True, False]]))  # dead: never read


# ---------------------------------------------------------------------------------------------------
# compressed token map from a tokenizer
# ---------------------------------------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes map to themselves, the rest to 256+."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


def _expected_map(vocab: dict[str, int], specials: dict[str, int]) -> tuple[list[int], int]:
    """The documented rule, written independently with unicodedata and the byte alphabet."""
    to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    raw_by_id = {i: t for t, i in {**vocab, **specials}.items()}
    keys: dict[str, int] = {}
    lookup = []
    for token_id in range(len(raw_by_id)):
        raw = raw_by_id[token_id]
        text = raw if raw in specials else bytes(to_byte[c] for c in raw).decode("utf-8", errors="replace")
        if "\ufffd" in text:
            key = raw
        else:
            norm = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
            norm = "".join(c for c in norm if unicodedata.category(c) != "Mn").lower()
            norm = re.sub(r"[ \t\r\n]+", " ", norm)
            norm = norm if norm == " " else norm.strip()
            key = norm or text
        lookup.append(keys.setdefault(key, len(keys)))
    return lookup, len(keys)


@pytest.fixture(scope="module")
def byte_bpe():
    """A byte-level BPE whose vocab is the 256 bytes plus whole-word tokens built to collide."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    words = [
        " the",
        " The",
        "THE",
        "the",
        "café",
        "cafe",
        " CAFÉ",
        "naïve",
        "naive",
        "æ",
        "ß",
        "ﬁ",
        "fi",
        "  ",
        "\n\n",
        " \t",
        "①",
        "1",
        "Ａ",
        "a",
        "\x0b",
        "µ",
        "μ",
    ]
    for word in words:
        piece = "".join(alphabet[b] for b in word.encode())
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<｜begin▁of▁sentence｜>"])
    specials = {"<｜begin▁of▁sentence｜>": len(vocab)}
    return tok, vocab, specials


def test_compressed_map_follows_documented_rule(byte_bpe):
    tok, vocab, specials = byte_bpe
    lookup, size = build_compressed_token_map(tok)
    assert (lookup, size) == _expected_map(vocab, specials)

    alphabet = _bytes_to_unicode()
    compressed = {
        word: lookup[vocab["".join(alphabet[b] for b in word.encode())]]
        for word in [
            " the",
            "THE",
            "the",
            "café",
            " CAFÉ",
            "cafe",
            "ﬁ",
            "fi",
            "  ",
            "\n\n",
            "①",
            "1",
            "Ａ",
            "a",
            "æ",
            "ß",
            "naïve",
            "naive",
            "µ",
            "μ",
        ]
    }
    assert compressed[" the"] == compressed["THE"] == compressed["the"]
    assert compressed["café"] == compressed[" CAFÉ"] == compressed["cafe"]
    assert compressed["ﬁ"] == compressed["fi"] and compressed["①"] == compressed["1"]
    assert compressed["Ａ"] == compressed["a"] and compressed["naïve"] == compressed["naive"]
    assert compressed["µ"] == compressed["μ"]  # NFKC folds the micro sign into mu
    # whitespace-only tokens keep one space rather than becoming empty
    assert compressed["  "] == compressed["\n\n"] == lookup[vocab[alphabet[ord(" ")]]]
    # partial UTF-8 bytes are keyed by their raw byte-level string, which can equal a normalized text:
    # byte 0xE6 is drawn "æ", so it shares its id with the whole character "æ" (and 0xDF with "ß")
    assert lookup[0xE6] == compressed["æ"] and lookup[0xDF] == compressed["ß"]
    assert lookup[0xC3] != lookup[vocab["a"]]  # "Ã", raw: not folded to "a"


def test_load_tokenizer_fills_map(byte_bpe, tiny):
    from transformers import PreTrainedTokenizerFast

    tok, vocab, specials = byte_bpe
    expected, size = _expected_map(vocab, specials)
    config, *_ = tiny
    config = DeepseekV41TextConfig(**{**config.to_dict(), "engram_compressed_vocab_size": size})
    for tokenizer in (tok, PreTrainedTokenizerFast(tokenizer_object=tok)):
        hasher = DeepseekV41NgramHasher(config)
        hasher.load_tokenizer(tokenizer)
        assert hasher.has_token_map
        assert hasher.token_map[: len(expected)].tolist() == expected
        assert (hasher.token_map[len(expected) :] == DEAD).all()

    wrong = DeepseekV41TextConfig(**{**config.to_dict(), "engram_compressed_vocab_size": size + 1})
    with pytest.raises(ValueError, match="compresses to"):
        DeepseekV41NgramHasher(wrong).load_tokenizer(tok)
    # a pad token the tokenizer does not have: look-back past the sequence start would read no real id
    outside = DeepseekV41TextConfig(
        **{**config.to_dict(), "engram_compressed_vocab_size": size, "engram_pad_token_id": len(expected)}
    )
    with pytest.raises(ValueError, match=f"engram_pad_token_id {len(expected)} is not a token"):
        DeepseekV41NgramHasher(outside).load_tokenizer(tok)


# ---------------------------------------------------------------------------------------------------
# the Engram block
# ---------------------------------------------------------------------------------------------------
def _engram_state(weights, layer_id, fp8_table):
    prefix = f"layers.{layer_id}.engram."
    state = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    if not fp8_table:
        state["embed.weight"] = dequantize_engram_table(state["embed.weight"], state.pop("embed.scale"))
    return state


@pytest.mark.parametrize("fp8_table", [False, True], ids=["float_table", "fp8_table"])
@pytest.mark.parametrize("layer_id", [0, 1])
def test_engram_matches_reference(tiny, fixtures_dir, layer_id, fp8_table):
    config, engram, inputs, captures = tiny
    weights = load_file(fixtures_dir / "v41_tiny_vl/model.safetensors")
    if fp8_table:
        config = DeepseekV41TextConfig(**{**config.to_dict(), "engram_table_dtype": "fp8"})
    block = DeepseekV41Engram(config, layer_id)
    for param in block.parameters():  # not `block.to(bf16)`, which would cast an FP8 table too
        if param.dtype == torch.float32:
            param.data = param.data.bfloat16()
    block.load_state_dict(_engram_state(weights, layer_id, fp8_table))
    expected_table_dtype = torch.float8_e4m3fn if fp8_table else torch.bfloat16
    assert block.embed.weight.dtype == expected_table_dtype

    image_mask = inputs["token_types"] >= 0
    hash_ids = make_hasher(config, engram["token_map"])(inputs["input_ids"], image_mask)
    x = captures[f"layers.{layer_id}.engram_in"].unsqueeze(0)
    with torch.no_grad():
        out = block(x, hash_ids[:, :, block.hash_index], ~image_mask)
    expected = captures[f"layers.{layer_id}.engram_out"].unsqueeze(0)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)  # bit-exact: same op order, fp32 gate, one bf16 rounding at the end
    assert torch.equal(out[image_mask], x[image_mask])  # shut gate: image positions pass through
    assert not torch.equal(out[~image_mask], x[~image_mask])


def test_engram_trains_in_fp32(tiny):
    config, engram, inputs, _ = tiny
    torch.manual_seed(0)
    block = DeepseekV41Engram(config, 1)
    hash_ids = make_hasher(config, engram["token_map"])(inputs["input_ids"])[:, :, block.hash_index]
    x = torch.randn(1, 57, config.hc_mult, config.hidden_size, requires_grad=True)
    block(x, hash_ids).square().mean().backward()
    for name, param in [("x", x), *block.named_parameters()]:
        assert param.grad is not None and param.grad.isfinite().all() and param.grad.abs().sum() > 0, name
    assert block.embed.weight.shape == (864, 32) and block.wkv.weight.shape == (320, 192)


def test_dequantize_matches_reference_checkpoint_format(fixtures_dir):
    stored = load_file(fixtures_dir / "quant_format/checkpoint_format.safetensors")
    expected = load_file(fixtures_dir / "quant_format/dequantized_fp32.safetensors")
    for layer_id in (0, 1):
        name = f"layers.{layer_id}.engram.embed"
        table = dequantize_engram_table(stored[f"{name}.weight"], stored[f"{name}.scale"])
        assert table.dtype == torch.bfloat16
        assert torch.equal(table.float(), expected[f"{name}.weight"])  # exact in bf16, as documented


def test_dequantize_uses_one_scale_per_32_columns():
    torch.manual_seed(0)
    weight = (torch.randn(5, 96) * 50).to(torch.float8_e4m3fn)
    exponents = torch.randint(-8, 8, (5, 3))
    scale = torch.pow(2.0, exponents.float()).to(torch.float8_e8m0fnu)
    table = dequantize_engram_table(weight, scale, dtype=torch.float32)
    for block in range(3):
        columns = slice(32 * block, 32 * (block + 1))
        expected = weight[:, columns].float() * torch.pow(2.0, exponents[:, block : block + 1].float())
        assert torch.equal(table[:, columns], expected)
    with pytest.raises(ValueError, match="needs scales of shape"):
        dequantize_engram_table(weight, scale[:, :1])
