"""``generate(..., use_mtp=True)``: DSpark speculative decoding gives exactly plain greedy decoding's tokens (batch of
left-padded prompts, an image in the prompt), keeps the sampling distribution (the speculative-sampling rule, checked
statistically), honours the confidence threshold and streamers, and refuses what it cannot do.

The tiny preset with a 2-block DSpark head, random fp32 weights: the draft agrees with the main model now and then,
so steps accept a few tokens and reject the rest (rolled back in the main cache). The verification forward computes
several tokens where plain decoding computes one: fp32 rounding of other GEMM shapes, far below the logit gaps of
these seeds (as in test_generation.py).
"""

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.generation.cache import DeepseekV41Cache, DeepseekV41StaticCache
from modeling_dsv41.generation.speculative import accept_greedy, accept_sampled
from test_generation import image_prompt, random_prompt
from tiny_models import tiny_model

NEW_TOKENS = 16


def dspark_model(block_size: int = 4, stages: int = 2) -> DeepseekV41ForCausalLM:
    model = tiny_model(
        num_nextn_predict_layers=stages, dspark_block_size=block_size, dspark_noise_token_id=7,
        dspark_target_layer_ids=[3, 5, 4], dspark_markov_rank=16, dspark_n_routed_experts=2,
        dspark_n_activated_experts=1,
    )
    model.generation_config.eos_token_id = None
    return model


class Forwards:
    """Counts the main model's forwards (verification steps)."""

    def __init__(self, model):
        self.count = 0
        model.model.register_forward_hook(lambda *args: setattr(self, "count", self.count + 1))


@pytest.mark.parametrize("block_size, stages", [(4, 2), (2, 1), (5, 3)])
def test_greedy_equals_plain_greedy_on_a_left_padded_batch(block_size, stages):
    model = dspark_model(block_size, stages)
    rows = [random_prompt(19, 1), random_prompt(7, 2), random_prompt(12, 3)]
    width = max(r.shape[1] for r in rows)
    ids = torch.cat([torch.nn.functional.pad(r, (width - r.shape[1], 0), value=2) for r in rows])
    mask = torch.cat([torch.tensor([[0] * (width - r.shape[1]) + [1] * r.shape[1]]) for r in rows])
    forwards = Forwards(model)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert forwards.count == NEW_TOKENS
    forwards.count = 0
    spec = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, use_mtp=True)
    assert torch.equal(spec, plain)
    if block_size == 4:  # and a row alone
        alone = model.generate(rows[1], max_new_tokens=NEW_TOKENS, do_sample=False, use_mtp=True)
        assert torch.equal(alone[0, rows[1].shape[1]:], plain[1, width:])


def test_whole_accepted_blocks_give_several_tokens_per_forward():
    """A draft that is always right (the released head's aim) gets every block accepted: the backbone's final norm is
    zeroed, so its logits are all 0 and its argmax token 0; the draft head's Markov bias makes it draft token 0."""
    model = dspark_model()
    with torch.no_grad():
        model.model.norm.weight.zero_()
        model.mtp[-1].markov_head.head.weight.zero_()
        model.mtp[-1].markov_head.head.weight[0] = 1.0
        model.mtp[-1].markov_head.embed.weight.fill_(1.0)
    prompt = random_prompt(9, 4)
    plain = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert not plain[0, 9:].any()
    forwards = Forwards(model)
    spec = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, use_mtp=True)
    assert torch.equal(spec, plain)
    # the prefill's token, then blocks of 4 drafted + 1 own token per verification
    assert forwards.count == 1 + -(-(NEW_TOKENS - 1) // 5)


def test_greedy_with_an_image_in_the_prompt():
    model = dspark_model()
    inputs = image_prompt(5)
    plain = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    spec = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, use_mtp=True)
    assert torch.equal(spec, plain)


def left_padded_batch():
    rows = [random_prompt(37, 1), random_prompt(7, 2), random_prompt(20, 3)]  # past the 16-token window, and short
    width = max(r.shape[1] for r in rows)
    ids = torch.cat([torch.nn.functional.pad(r, (width - r.shape[1], 0), value=2) for r in rows])
    mask = torch.cat([torch.tensor([[0] * (width - r.shape[1]) + [1] * r.shape[1]]) for r in rows])
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("prompt", ["batch", "image"])
def test_static_cache_rolls_back_in_its_fixed_buffers(prompt, monkeypatch):
    """use_mtp on the static cache: every rejected draft is cropped in place (the buffers keep their shapes and
    addresses), and the tokens are plain greedy decoding's (dynamic cache)."""
    model = dspark_model(block_size=4, stages=2)
    inputs = left_padded_batch() if prompt == "batch" else image_prompt(5)
    plain = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    crops, buffers = [], {}

    def crop(self, tokens):
        if not buffers:  # after the prefill: the fixed buffers every later step must reuse
            buffers.update({(i, name): getattr(layer, name).data_ptr() for i, layer in enumerate(self.layers)
                            for name in layer._STATE if getattr(layer, name) is not None})
        crops.append(tokens)
        DeepseekV41StaticCache.crop.__wrapped__(self, tokens)

    crop.__wrapped__ = DeepseekV41StaticCache.crop
    monkeypatch.setattr(DeepseekV41StaticCache, "crop", crop)
    out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, use_mtp=True,
                         cache_implementation="static", return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert any(n < 0 for n in crops)  # drafts were rejected and rolled back
    cache = out.past_key_values
    assert isinstance(cache, DeepseekV41StaticCache)
    assert {(i, name): getattr(layer, name).data_ptr() for i, layer in enumerate(cache.layers)
            for name in layer._STATE if getattr(layer, name) is not None} == buffers


def test_static_cache_crop_equals_a_cache_that_never_saw_the_tokens():
    """Crop a static cache (into the prompt too, across steps), decode on: the logits are those of a dynamic cache
    that never saw the removed tokens (fp32 rounding: other GEMM widths, as in test_cache_static.py); and what the
    buffers can no longer undo is refused."""
    model = dspark_model()
    ids, other = random_prompt(45, 0), random_prompt(6, 1)
    with torch.no_grad():
        static = DeepseekV41StaticCache(model.config, max_cache_len=64)
        with pytest.raises(ValueError, match="needs the most tokens one crop removes"):
            static.activate_past_recording()
        static.activate_past_recording(max_rewind=4)
        model(ids[:, :37], cache=static)
        static.crop(-2)  # into the prompt
        model(other[:, :4], cache=static)
        static.crop(-3)
        model(other[:, 4:6], cache=static)
        static.crop(-3)  # back to the prompt's first 35 tokens: all 4 recorded steps are used up
        with pytest.raises(ValueError, match="can undo only its newest 0"):
            static.crop(-1)
        assert static.get_seq_length() == 35 and static.lengths.tolist() == [35]
        plain = DeepseekV41Cache(model.config)
        model(ids[:, :35], cache=plain)
        for new in (ids[:, 35:40], ids[:, 40:41]):  # groups across the crop point, then one token
            torch.testing.assert_close(model(new, cache=static).logits, model(new, cache=plain).logits, rtol=0,
                                       atol=1e-4)


def test_confidence_threshold_cuts_drafts_and_keeps_the_output():
    model = dspark_model()
    prompt = random_prompt(10, 6)
    plain = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    forwards = Forwards(model)
    # a threshold of 1 keeps no draft token at all: one forward per token, as plain decoding
    never = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, use_mtp=True,
                           dspark_confidence_threshold=1.0)
    assert torch.equal(never, plain) and forwards.count == NEW_TOKENS
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, use_mtp=True, dspark_confidence_threshold=0.5)
    assert torch.equal(model.generate(prompt, generation_config=config), plain)
    with pytest.raises(ValueError, match="dspark_confidence_threshold must be a probability"):
        model.generate(prompt, max_new_tokens=3, use_mtp=True, dspark_confidence_threshold=2.0)


def test_streamer_receives_every_token_once_in_order():
    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.clone())

        def end(self):
            self.ended = True

    model = dspark_model()
    prompt = random_prompt(8, 7)
    streamer = Collect()
    out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, use_mtp=True, streamer=streamer)
    assert streamer.ended and torch.equal(streamer.chunks[0], prompt)
    assert torch.equal(torch.cat([c.view(-1) for c in streamer.chunks[1:]]), out[0, 8:])


def test_eos_stops_each_row_as_plain_decoding_does():
    model = dspark_model()
    prompt = torch.cat([random_prompt(10, 8), random_prompt(10, 9)])
    plain = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    eos = int(plain[0, 14])  # a token the first row generates
    plain = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=2)
    spec = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=2,
                          use_mtp=True)
    assert torch.equal(spec, plain)


def test_finished_rows_do_not_shorten_the_accepted_prefix():
    """Row 1 has finished (it emits padding): its disagreeing draft must not cut row 0's fully agreeing one."""
    target = torch.nn.functional.one_hot(torch.tensor([[3, 4, 5, 6], [0, 0, 0, 0]]), 8).float()
    draft = torch.tensor([[3, 4, 5], [1, 1, 1]])
    assert accept_greedy(draft, target).shape[1] == 1  # both rows active: row 1 rejects at once
    kept = accept_greedy(draft, target, torch.tensor([True, False]))
    assert kept[0].tolist() == [3, 4, 5, 6]
    sampled = accept_sampled(draft, (target * 50).log_softmax(-1)[:, :-1], (target * 50).log_softmax(-1),
                             torch.tensor([True, False]))
    assert sampled[0].tolist() == [3, 4, 5, 6]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_beams=2), "use_mtp=True\\) works with greedy search and sampling"),
        (dict(output_scores=True, return_dict_in_generate=True), "does not support \\['output_scores'\\]"),
    ],
)
def test_unsupported_combinations_are_clear_errors(kwargs, message):
    model = dspark_model()
    with pytest.raises(ValueError, match=message):
        model.generate(random_prompt(6, 0), max_new_tokens=4, use_mtp=True, **kwargs)


def test_use_mtp_without_a_head_is_a_clear_error():
    model = DeepseekV41ForCausalLM(DeepseekV41Config.from_preset("tiny")).eval()
    with pytest.raises(ValueError, match="use_mtp=True needs the DSpark draft head"):
        model.generate(random_prompt(6, 0), max_new_tokens=4, use_mtp=True)


def test_speculative_sampling_keeps_the_target_distribution():
    """accept_sampled on fixed p (target) and q (draft) over 4 tokens: the first emitted token's frequencies over
    20 000 draws match p (chi-square, 3 degrees of freedom, p-value > 0.001), however far q is from p; and a row
    whose own draft was kept is not cut short by another row beyond the shortest acceptance."""
    torch.manual_seed(0)
    p_logits = torch.tensor([[2.0, 0.5, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]).log_softmax(-1)
    q_logits = torch.tensor([[-1.0, 2.0, 0.5, 0.0]]).log_softmax(-1)
    n = 20_000
    q = q_logits.softmax(-1)
    draft = torch.multinomial(q.expand(n, -1), 1)  # [n, 1]: one drafted token per row, from q
    tokens = accept_sampled(draft, q_logits.expand(n, 1, 4), p_logits.expand(n, 2, 4))
    counts = torch.bincount(tokens[:, 0], minlength=4).double()
    expected = p_logits[0].softmax(-1).double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (counts, expected)  # the 0.999 quantile of chi-square(3)


def test_sampling_generates_and_matches_plain_sampling_in_distribution():
    """With do_sample, DSpark decoding is a sampler of the main model: the first new token's frequencies over many
    runs agree with plain sampling's (both draw from the same softmax; chi-square on the 4 likeliest tokens)."""
    model = dspark_model()
    prompt = random_prompt(6, 10).expand(200, -1)
    kwargs = dict(max_new_tokens=3, do_sample=True, top_k=4, temperature=1.5)
    torch.manual_seed(1)
    plain = model.generate(prompt, **kwargs)[:, -2]
    torch.manual_seed(2)
    spec = model.generate(prompt, use_mtp=True, **kwargs)[:, -2]
    tokens = torch.unique(torch.cat([plain, spec]))
    a = torch.stack([(plain == t).sum() for t in tokens]).double()
    b = torch.stack([(spec == t).sum() for t in tokens]).double()
    chi2 = float((((a - b) ** 2) / (a + b).clamp_min(1)).sum())
    assert chi2 < 30, (tokens, a, b)  # two-sample chi-square, well above its 0.999 quantile for ≤ 16 categories
