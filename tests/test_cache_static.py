"""DeepseekV41StaticCache: ``generate(cache_implementation="static")`` decodes what the dynamic cache decodes, and a
decode step compiles as one graph (``torch.compile(fullgraph=True)``) that is reused step after step. And the
dynamic cache's ``crop`` (past recording): assisted generation decodes what plain greedy decoding does.

Tiny config, random fp32 weights (see tests/test_generation.py for the preset's layer kinds).
"""

import os

import pytest
import torch

from modeling_dsv41.generation.cache import DeepseekV41Cache, DeepseekV41StaticCache
from modeling_dsv41.moe import DeepseekV41Experts, routed_experts_forward

from test_generation import TOL, image_prompt, random_prompt, tiny_model

NEW_TOKENS = 16
GREEDY = dict(max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True)


def text_only_model():
    model = tiny_model()
    model.config.text_config.engram_layer_ids = []
    stripped = type(model)(model.config).eval()
    stripped.load_state_dict(model.state_dict(), strict=False)  # same weights, Engram modules gone
    stripped.generation_config.eos_token_id = None
    return stripped


def assert_same_generation(dynamic, static):
    assert isinstance(dynamic.cache, DeepseekV41Cache) and isinstance(static.cache, DeepseekV41StaticCache)
    assert torch.equal(dynamic.sequences, static.sequences)
    # the step's ops are the same; only the indexer's and attention's widths differ (all compressed rows the
    # buffer can hold instead of those filled so far), which changes fp32 GEMM blocking: rounding-level drift
    worst = max((a - b).abs().max().item() for a, b in zip(dynamic.logits, static.logits))
    assert worst <= TOL, worst


@pytest.mark.parametrize(
    "engram, prompt_len",
    [
        (True, 37),  # ends mid ratio-2 group, longer than the window
        (False, 10),  # shorter than the window: the window and the groups fill during decoding
    ],
    ids=["engram", "text"],
)
def test_static_cache_generates_what_the_dynamic_cache_generates(engram, prompt_len):
    model = tiny_model() if engram else text_only_model()
    assert (model.model.engram_hasher is not None) == engram
    prompt = random_prompt(prompt_len, 0)
    assert_same_generation(
        model.generate(prompt, **GREEDY), model.generate(prompt, cache_implementation="static", **GREEDY)
    )


def test_static_cache_with_left_padding_an_image_and_beams():
    """Rows at different positions (left padding) with an image; beam search, whose reordering is in place."""
    model = tiny_model()
    image = image_prompt(3, before=4, after=12)  # 24 tokens
    text = random_prompt(30, 1)
    pad = text.shape[1] - image["input_ids"].shape[1]
    batch = {
        "input_ids": torch.cat([torch.nn.functional.pad(image["input_ids"], (pad, 0), value=2), text]),
        "attention_mask": torch.cat([torch.tensor([[0] * pad + [1] * 24]), torch.ones(1, 30, dtype=torch.long)]),
        "image_token_types": torch.cat(
            [torch.nn.functional.pad(image["image_token_types"], (pad, 0), value=-1), torch.full((1, 30), -1)]
        ),
        "pixel_values": image["pixel_values"],
        "image_grid_hw": image["image_grid_hw"],
    }
    assert_same_generation(
        model.generate(**batch, **GREEDY), model.generate(**batch, cache_implementation="static", **GREEDY)
    )
    beams = dict(max_new_tokens=5, num_beams=2, num_return_sequences=2, do_sample=False)
    text = {"input_ids": batch["input_ids"][1:], "attention_mask": batch["attention_mask"][1:]}
    assert torch.equal(model.generate(**text, **beams), model.generate(**text, cache_implementation="static", **beams))


def test_static_cache_is_sized_once_and_refuses_to_overflow():
    model = tiny_model()
    cache = DeepseekV41StaticCache(model.config, max_cache_len=40)
    ids = random_prompt(40, 0)
    with torch.no_grad():
        model(ids[:, :36], cache=cache)
        buffers = [layer.window_kv.data_ptr() for layer in cache.layers]
        for t in range(36, 40):
            model(ids[:, t : t + 1], cache=cache)
        assert [layer.window_kv.data_ptr() for layer in cache.layers] == buffers  # updated in place
        assert cache.get_seq_length() == 40 and cache.get_max_cache_shape() == 40
        with pytest.raises(ValueError, match="static cache holds 40 positions"):
            model(ids[:, :1], cache=cache)
        # reset keeps the buffers: a new sequence decodes as in a fresh cache
        cache.reset()
        again = model(ids[:, :36], cache=cache).logits
        fresh = model(ids[:, :36], cache=DeepseekV41StaticCache(model.config, max_cache_len=40)).logits
        assert torch.equal(again, fresh)


def test_per_slot_experts_equal_the_per_expert_loop():
    """The decode path of the eager experts (gathered weights, no host sync) computes what the per-expert loop
    computes: same products, same fp32 summation order (only GEMM shapes differ)."""
    config = tiny_model().config.text_config
    torch.manual_seed(0)
    experts = DeepseekV41Experts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=1.0)  # large enough for both SwiGLU clamps to act
        experts.down_proj.normal_(std=0.2)
    x = torch.randn(2, config.hidden_size)
    index = torch.tensor([[3, 1], [0, 3]])  # unsorted: the sum must still run in expert order
    weights = torch.rand(2, 2)
    assert index.numel() <= experts.num_experts  # the per-slot path is what forward takes here
    per_slot = experts(x, index, weights)
    per_expert = routed_experts_forward(
        x,
        index,
        weights,
        experts.num_experts,
        experts.swiglu_limit,
        lambda e: (experts.gate_up_proj[e], experts.down_proj[e]),
    )
    # fp32 rounding of GEMMs of other shapes (one slot vs an expert's two tokens) on outputs of scale ~100
    torch.testing.assert_close(per_slot, per_expert, rtol=1e-6, atol=1e-6 * per_expert.abs().max().item())


def _decode_compiled(model, backend: str, steps: int = 6):
    """Eager and compiled decode steps on two static caches after the same prefill: logits, and frames compiled."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    ids = random_prompt(37 + steps, 0)
    counter = CompileCounterWithBackend(backend)
    step = torch.compile(model.forward, fullgraph=True, backend=counter)
    eager_cache = DeepseekV41StaticCache(model.config, max_cache_len=64)
    compiled_cache = DeepseekV41StaticCache(model.config, max_cache_len=64)
    worst = 0.0
    with torch.no_grad():
        model(ids[:, :37], cache=eager_cache)
        model(ids[:, :37], cache=compiled_cache)
        for t in range(37, 37 + steps):  # odd and even positions: ratio-2 groups complete every other step
            eager = model(ids[:, t : t + 1], cache=eager_cache).logits
            compiled = step(input_ids=ids[:, t : t + 1], cache=compiled_cache).logits
            worst = max(worst, (eager - compiled).abs().max().item())
    assert torch.equal(eager_cache.lengths, compiled_cache.lengths)
    return worst, counter.frame_count


def test_decode_step_compiles_as_one_graph():
    """fullgraph=True fails on any graph break; one frame for 20 steps means no recompilation either.
    aot_eager traces the graph through AOTAutograd (the in-place cache updates included) without inductor's
    C++ build, which takes minutes on a loaded 2-core machine (see the slow test below)."""
    worst, frames = _decode_compiled(tiny_model(), "aot_eager", steps=20)
    assert frames == 1
    assert worst == 0.0, worst  # the same ops in the same order


@pytest.mark.slow
@pytest.mark.skipif(
    "ATEN_CPU_CAPABILITY" in os.environ,
    reason="torch 2.13's inductor aborts (SIGABRT, no message) running this model's kernels when ATen's ISA is "
    "limited below the CPU's (ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU; ONEDNN_MAX_CPU_ISA alone is fine): an "
    "artefact of the emulation, which the numerics checks use; the eager-backend fullgraph test above still runs",
)
def test_decode_step_compiles_with_inductor():
    worst, frames = _decode_compiled(tiny_model(), "inductor")
    assert frames == 1
    assert worst <= 1e-5, worst  # inductor fuses and reorders fp32 elementwise math


@pytest.mark.parametrize("cache_implementation", [None, "static"], ids=["dynamic", "static"])
@pytest.mark.parametrize("drafter", ["assistant_model", "prompt_lookup"])
def test_assisted_generation_matches_greedy(drafter, cache_implementation, monkeypatch):
    """A draft model with other weights, or prompt lookup on a prompt that repeats itself, proposes tokens the model
    mostly rejects: every rejection crops the caches (a draft model's inside its prompt on the first round), and the
    result must be plain greedy decoding, with the dynamic cache and with the static one (which transformers'
    recording call, ``recurrent_states_to_keep``, sizes for a crop of any length)."""
    model = tiny_model()
    crops = []
    crop = DeepseekV41Cache.crop
    monkeypatch.setattr(DeepseekV41Cache, "crop", lambda self, n: (crops.append((type(self), n)), crop(self, n))[1])
    greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation=cache_implementation)
    if drafter == "assistant_model":
        torch.manual_seed(1)
        draft = type(model)(model.config).eval()
        draft.model.engram_hasher.token_map.copy_(model.model.engram_hasher.token_map)
        draft.generation_config.eos_token_id = None
        prompt = random_prompt(37, 0)
        drafting = dict(assistant_model=draft)
    else:
        prompt = random_prompt(13, 0).repeat(1, 3)  # every 3-gram recurs: prompt lookup always finds a draft
        drafting = dict(prompt_lookup_num_tokens=4)
    assisted = model.generate(prompt, **drafting, **greedy)
    expected = DeepseekV41StaticCache if cache_implementation == "static" else DeepseekV41Cache
    assert any(n < 0 and kind is expected for kind, n in crops)  # the model's rejected draft tokens rolled back
    assert torch.equal(assisted, model.generate(prompt, **greedy))


def test_crop_restores_the_state_before_the_removed_tokens():
    """Decode tokens, crop them (into the prompt too), decode others: the logits are those of a cache that never
    saw the removed tokens (up to fp32 rounding: its prompt's K=V came from GEMMs over 35 tokens, not 37)."""
    model = tiny_model()
    ids, other = random_prompt(45, 0), random_prompt(6, 1)
    with torch.no_grad():
        recorded = DeepseekV41Cache(model.config)
        recorded.activate_past_recording()
        model(ids[:, :37], cache=recorded)
        model(other[:, :4], cache=recorded)
        model(other[:, 4:5], cache=recorded)
        recorded.crop(-7)  # the 5 decoded tokens and the prompt's last 2
        assert recorded.get_seq_length() == 35 and recorded.lengths.tolist() == [35]
        plain = DeepseekV41Cache(model.config)
        model(ids[:, :35], cache=plain)
        for new in (ids[:, 35:40], ids[:, 40:41]):  # 5 tokens (ratio-2 groups across the crop point), then 1
            torch.testing.assert_close(
                model(new, cache=recorded).logits, model(new, cache=plain).logits, rtol=0, atol=TOL
            )
