"""``generate(..., use_mtp=True)``: DSpark speculative decoding gives exactly plain greedy decoding's tokens (batch of
left-padded prompts whose rows advance by their own accepted lengths, an image in the prompt, rows ending early at EOS
or a stop string, max_new_tokens, streamers, the static cache, compiled), keeps the sampling distribution (the
speculative-sampling rule per row, checked statistically), honours the confidence threshold, and refuses what it
cannot do.

The tiny preset with a 2-block DSpark head, random fp32 weights: the draft agrees with the main model now and then,
so steps accept a few tokens and reject the rest (rolled back in the main cache). The verification forward computes
several tokens where plain decoding computes one: fp32 rounding of other GEMM shapes, far below the logit gaps of
these seeds (as in test_generation.py).
"""

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, PreTrainedTokenizerFast
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
        num_nextn_predict_layers=stages,
        dspark_block_size=block_size,
        dspark_noise_token_id=7,
        dspark_target_layer_ids=[3, 5, 4],
        dspark_markov_rank=16,
        dspark_n_routed_experts=2,
        dspark_n_activated_experts=1,
    )
    model.generation_config.eos_token_id = None
    return model


class RowCrops:
    """Records how many tokens each crop removes from each row (speculative decoding's per-row rollback)."""

    def __init__(self, monkeypatch):
        self.calls: list[list[int]] = []
        crop_rows = DeepseekV41Cache.crop_rows

        def record(cache, tokens):
            self.calls.append(tokens.tolist())
            crop_rows(cache, tokens)

        monkeypatch.setattr(DeepseekV41Cache, "crop_rows", record)

    def out_of_step(self) -> bool:
        """Whether some verification kept different numbers of tokens in different rows."""
        return any(len(set(call)) > 1 for call in self.calls)


def left_pad(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    width = max(r.shape[1] for r in rows)
    ids = torch.cat([torch.nn.functional.pad(r, (width - r.shape[1], 0), value=2) for r in rows])
    mask = torch.cat([torch.tensor([[0] * (width - r.shape[1]) + [1] * r.shape[1]]) for r in rows])
    return {"input_ids": ids, "attention_mask": mask}


class FewTokens(LogitsProcessor):
    """Only ``ids`` may be chosen (by the main model and by the draft alike): among so few tokens the random draft
    head agrees with the main model now and then, so that rows keep different numbers of drafted tokens."""

    def __init__(self, ids):
        self.ids = torch.tensor(list(ids))

    def __call__(self, input_ids, scores):
        out = torch.full_like(scores, -torch.inf)
        out[:, self.ids] = scores[:, self.ids]
        return out


def few_tokens(ids=(3, 4)) -> LogitsProcessorList:
    return LogitsProcessorList([FewTokens(ids)])


class Forwards:
    """Counts the main model's forwards (verification steps)."""

    def __init__(self, model):
        self.count = 0
        model.model.register_forward_hook(lambda *args: setattr(self, "count", self.count + 1))


@pytest.mark.parametrize("block_size, stages", [(4, 2), (2, 1), (5, 3)])
def test_greedy_equals_plain_greedy_on_a_left_padded_batch(block_size, stages, monkeypatch):
    """Each row keeps its own accepted prefix (the rows fall out of step) and still gets plain greedy's tokens."""
    model = dspark_model(block_size, stages)
    rows = [random_prompt(19, 1), random_prompt(7, 2), random_prompt(12, 3)]
    inputs = left_pad(rows)
    width = inputs["input_ids"].shape[1]
    greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False, logits_processor=few_tokens())
    forwards = Forwards(model)
    plain = model.generate(**inputs, **greedy)
    assert forwards.count == NEW_TOKENS
    crops = RowCrops(monkeypatch)
    spec = model.generate(**inputs, use_mtp=True, **greedy)
    assert torch.equal(spec, plain)
    assert crops.out_of_step()
    if block_size == 4:  # and a row alone; and the whole vocabulary (no processor)
        alone = model.generate(rows[1], use_mtp=True, **greedy)
        assert torch.equal(alone[0, rows[1].shape[1] :], plain[1, width:])
        assert torch.equal(
            model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, use_mtp=True),
            model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False),
        )


class ZeroInRowZero(LogitsProcessor):
    """Forces token 0 in row 0 (the main model's logits and the draft's alike: there the draft is always right)."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[0] = -torch.inf
        scores[0, 0] = 0.0
        return scores


def test_a_row_whose_drafts_are_right_keeps_whole_blocks(monkeypatch):
    """Row 0 keeps every draft whole (a block and the main model's token per verification) while the other rows
    reject theirs: each row advances by its own accepted length, and the tokens are still plain greedy's."""
    model = dspark_model()
    batch = torch.cat([random_prompt(9, 4), random_prompt(9, 5), random_prompt(9, 6)])
    processors = LogitsProcessorList([ZeroInRowZero()])
    plain = model.generate(batch, max_new_tokens=NEW_TOKENS, do_sample=False, logits_processor=processors)
    assert not plain[0, 9:].any()
    crops = RowCrops(monkeypatch)
    spec = model.generate(batch, max_new_tokens=NEW_TOKENS, do_sample=False, use_mtp=True, logits_processor=processors)
    assert torch.equal(spec, plain)
    # the prefill's token, then 3 verifications of 4 drafted + 1 own token: row 0 is done; the others go on
    assert [call[0] for call in crops.calls[:3]] == [0, 0, 0]
    assert any(call[1] > 0 or call[2] > 0 for call in crops.calls[:3])
    # done: row 0 leaves the cache and the later forwards (the logits processor, which reads the row's index,
    # still sees the whole batch: the tokens above are plain decoding's)
    assert len(crops.calls) > 3 and all(len(call) == 2 for call in crops.calls[3:])


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


def image_and_text_batch() -> dict[str, torch.Tensor]:
    """An image prompt (left-padded) and a longer text prompt in one batch."""
    image, text = image_prompt(5), random_prompt(41, 1)
    pad = text.shape[1] - image["input_ids"].shape[1]
    return {
        **left_pad([image["input_ids"], text]),
        "image_token_types": torch.cat(
            [torch.nn.functional.pad(image["image_token_types"], (pad, 0), value=-1), torch.full((1, 41), -1)]
        ),
        "pixel_values": image["pixel_values"],
        "image_grid_hw": image["image_grid_hw"],
    }


@pytest.mark.parametrize("prompt", ["image", "image and text"])
def test_greedy_with_an_image_in_the_prompt(prompt):
    model = dspark_model()
    inputs = image_prompt(5) if prompt == "image" else image_and_text_batch()
    plain = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    spec = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, use_mtp=True)
    assert torch.equal(spec, plain)


def left_padded_batch():
    return left_pad([random_prompt(37, 1), random_prompt(7, 2), random_prompt(20, 3)])  # past the 16-token window


@pytest.mark.parametrize("prompt", ["batch", "image and text"])
def test_static_cache_rolls_back_in_its_fixed_buffers(prompt, monkeypatch):
    """use_mtp on the static cache: every row's rejected tokens are cropped in place (the buffers keep their shapes
    and addresses), each row by its own count, and the tokens are plain greedy decoding's (dynamic cache)."""
    model = dspark_model(block_size=4, stages=2)
    inputs = left_padded_batch() if prompt == "batch" else image_and_text_batch()
    greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False, logits_processor=few_tokens())
    plain = model.generate(**inputs, **greedy)
    crops, buffers = [], {}
    crop_rows = DeepseekV41StaticCache.crop_rows

    def record(self, tokens):
        if not buffers:  # after the prefill: the fixed buffers every later step must reuse
            buffers.update(
                {
                    (i, name): getattr(layer, name).data_ptr()
                    for i, layer in enumerate(self.layers)
                    for name in layer._STATE
                    if getattr(layer, name) is not None
                }
            )
        crops.append(tokens.tolist())
        crop_rows(self, tokens)

    monkeypatch.setattr(DeepseekV41StaticCache, "crop_rows", record)
    out = model.generate(**inputs, use_mtp=True, cache_implementation="static", return_dict_in_generate=True, **greedy)
    assert torch.equal(out.sequences, plain)
    assert any(len(set(call)) > 1 for call in crops)  # rows rolled back by their own counts
    cache = out.past_key_values
    assert isinstance(cache, DeepseekV41StaticCache)
    assert {
        (i, name): getattr(layer, name).data_ptr()
        for i, layer in enumerate(cache.layers)
        for name in layer._STATE
        if getattr(layer, name) is not None
    } == buffers


def test_compiled_verification_steps_reuse_one_graph(monkeypatch):
    """With the static cache, generate compiles the verification forward (as transformers compiles decode steps):
    every step verifies a whole block whatever each row kept, so one graph serves every step (fullgraph: no break,
    and the frame count says no recompilation), and the tokens stay plain greedy's. The experts run transformers'
    grouped GEMM (the eager experts read how many tokens each expert got, a host sync, once a forward routes more
    tokens than there are experts). aot_eager traces the graph through AOTAutograd without inductor's C++ build
    (slow on a loaded 2-core machine)."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model = dspark_model(block_size=4, stages=2)
    model.set_experts_implementation("grouped_mm")
    inputs = left_padded_batch()
    greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False, logits_processor=few_tokens())
    plain = model.generate(**inputs, **greedy)
    torch._dynamo.reset()
    counters.clear()
    compile_config = CompileConfig(backend="aot_eager", fullgraph=True, mode=None)  # a mode is for inductor
    compile_config._compile_all_devices = True  # transformers compiles on accelerators only, unless told so
    crops = RowCrops(monkeypatch)  # (outside the compiled forward: a hook counting inside it would be recompiled)
    spec = model.generate(
        **inputs, use_mtp=True, cache_implementation="static", compile_config=compile_config, **greedy
    )
    assert torch.equal(spec, plain) and crops.out_of_step()
    assert len(crops.calls) > 3 and counters["stats"]["unique_graphs"] == 1  # one graph, never recompiled


@pytest.mark.parametrize("bounded", ["static", "dynamic"])
def test_bounded_cache_crop_equals_a_cache_that_never_saw_the_tokens(bounded):
    """Crop a cache recording at most ``max_rewind`` tokens (the static one, in its fixed buffers; the dynamic one,
    as DSpark activates it) into the prompt too, across steps, and decode on: the logits are those of a dynamic
    cache that never saw the removed tokens (fp32 rounding: other GEMM widths, as in test_cache_static.py); and
    what the cache can no longer undo is refused."""
    model = dspark_model()
    ids, other = random_prompt(45, 0), random_prompt(6, 1)
    with torch.no_grad():
        if bounded == "static":
            cache = DeepseekV41StaticCache(model.config, max_cache_len=64)
            with pytest.raises(ValueError, match="max_rewind must be a positive number"):
                cache.activate_past_recording(max_rewind=0)
        else:
            cache = DeepseekV41Cache(model.config)
        cache.activate_past_recording(max_rewind=4)
        model(ids[:, :37], cache=cache)
        cache.crop(-2)  # into the prompt
        model(other[:, :4], cache=cache)
        cache.crop(-3)
        model(other[:, 4:6], cache=cache)
        cache.crop(-3)  # back to the prompt's first 35 tokens: all 4 recorded steps are used up
        with pytest.raises(ValueError, match="can undo only its newest 0"):
            cache.crop(-1)
        assert cache.get_seq_length() == 35 and cache.lengths.tolist() == [35]
        if bounded == "dynamic":  # a fixed amount kept: the window and 4 more, not every token since the prefill
            assert (
                max(layer.window_kv.shape[1] for layer in cache.layers) <= model.config.text_config.sliding_window + 4
            )
        plain = DeepseekV41Cache(model.config)
        model(ids[:, :35], cache=plain)
        for new in (ids[:, 35:40], ids[:, 40:41]):  # groups across the crop point, then one token
            torch.testing.assert_close(
                model(new, cache=cache).logits, model(new, cache=plain).logits, rtol=0, atol=1e-4
            )


def test_confidence_threshold_cuts_drafts_and_keeps_the_output():
    model = dspark_model()
    prompt = random_prompt(10, 6)
    plain = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    forwards = Forwards(model)
    # a threshold of 1 keeps no draft token at all: one forward per token, as plain decoding
    never = model.generate(
        prompt, max_new_tokens=NEW_TOKENS, do_sample=False, use_mtp=True, dspark_confidence_threshold=1.0
    )
    assert torch.equal(never, plain) and forwards.count == NEW_TOKENS
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, use_mtp=True, dspark_confidence_threshold=0.5
    )
    assert torch.equal(model.generate(prompt, generation_config=config), plain)
    batch = left_padded_batch()  # each row's draft cut at its own unconfident token
    assert torch.equal(
        model.generate(**batch, generation_config=config),
        model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False),
    )
    with pytest.raises(ValueError, match="dspark_confidence_threshold must be a probability"):
        model.generate(prompt, max_new_tokens=3, use_mtp=True, dspark_confidence_threshold=2.0)


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.ended = True


def test_streamer_receives_every_token_once_in_order():
    model = dspark_model()
    prompt = random_prompt(8, 7)
    streamer = Collect()
    out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, use_mtp=True, streamer=streamer)
    assert streamer.ended and torch.equal(streamer.chunks[0], prompt)
    assert torch.equal(torch.cat([c.view(-1) for c in streamer.chunks[1:]]), out[0, 8:])


def test_a_batch_streams_the_columns_plain_decoding_streams(monkeypatch):
    """Rows out of step: a column reaches the streamer once every row has it, each once, as plain decoding puts
    them (padding for rows that ended at EOS)."""
    model = dspark_model()
    batch = left_padded_batch()
    greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False, logits_processor=few_tokens(range(3, 9)))
    eos = int(model.generate(**batch, **greedy)[1, -10])  # a token row 1 generates
    plain, spec = Collect(), Collect()
    expected = model.generate(**batch, streamer=plain, eos_token_id=eos, pad_token_id=2, **greedy)
    crops = RowCrops(monkeypatch)
    out = model.generate(**batch, streamer=spec, use_mtp=True, eos_token_id=eos, pad_token_id=2, **greedy)
    assert torch.equal(out, expected) and crops.out_of_step()
    assert spec.ended and len(spec.chunks) == len(plain.chunks)
    assert all(torch.equal(a, b) for a, b in zip(spec.chunks, plain.chunks))


@pytest.mark.parametrize("new_tokens", [NEW_TOKENS, 7])
def test_eos_stops_each_row_as_plain_decoding_does(new_tokens, monkeypatch):
    """Rows ending at EOS at different columns (then padded, and no longer decoded), or at max_new_tokens."""
    model = dspark_model()
    prompt = torch.cat([random_prompt(10, 8), random_prompt(10, 9), random_prompt(10, 10)])
    greedy = dict(do_sample=False, logits_processor=few_tokens(range(3, 9)), pad_token_id=2)
    eos = int(model.generate(prompt, max_new_tokens=NEW_TOKENS, **greedy)[0, 14])  # a token the first row generates
    plain = model.generate(prompt, max_new_tokens=new_tokens, eos_token_id=eos, **greedy)
    assert (plain[:, 10:-1] == 2).any()  # some row ended early
    crops = RowCrops(monkeypatch)
    spec = model.generate(prompt, max_new_tokens=new_tokens, eos_token_id=eos, use_mtp=True, **greedy)
    assert torch.equal(spec, plain) and crops.out_of_step()


def char_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """One character per token (``a`` … ``z``, then CJK ideographs), decoded by concatenation: what stop strings
    need (transformers matches them on each token's string)."""
    from tokenizers import Tokenizer, decoders, models

    chars = [chr(ord("a") + i) for i in range(26)] + [chr(0x4E00 + i) for i in range(vocab_size - 26)]
    tokenizer = Tokenizer(models.BPE({c: i for i, c in enumerate(chars)}, merges=[]))
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.mark.parametrize("eos", [False, True], ids=["no eos", "eos"])
def test_stop_strings_end_each_row_as_plain_decoding_does(eos):
    """Stop strings spanning two tokens, met by each row at its own column. Without an EOS criterion plain decoding
    pads no row: one that stopped goes on until every row has; with one, a row is padded after its stop."""
    model = dspark_model()
    tokenizer = char_tokenizer()
    batch = left_padded_batch()
    greedy = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
    new = greedy[:, -NEW_TOKENS:]
    stops = [
        "".join(tokenizer.convert_ids_to_tokens(new[row, start : start + 2].tolist()))
        for row, start in ((0, 3), (1, 9), (2, 5))
    ]
    kwargs = dict(
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        stop_strings=stops,
        tokenizer=tokenizer,
        pad_token_id=2,
        **({"eos_token_id": 1} if eos else {}),
    )
    plain = model.generate(**batch, **kwargs)
    assert plain.shape[1] < greedy.shape[1]  # every row stopped before max_new_tokens
    spec = model.generate(**batch, use_mtp=True, **kwargs)
    assert torch.equal(spec, plain)
    assert (plain[:, batch["input_ids"].shape[1] :] == 2).any() == eos  # padding after a stop


def test_each_row_keeps_its_own_accepted_prefix():
    """Row 0's draft agrees with the main model's argmaxes all along, row 1's not at all: row 0 keeps all 3 draft
    tokens and the main model's 4th, row 1 only the main model's first; a limit cuts a row's draft."""
    target = torch.nn.functional.one_hot(torch.tensor([[3, 4, 5, 6], [0, 0, 0, 0]]), 8).float()
    draft = torch.tensor([[3, 4, 5], [1, 1, 1]])
    tokens, kept = accept_greedy(draft, target)
    assert kept.tolist() == [3, 0] and tokens[0].tolist() == [3, 4, 5, 6] and tokens[1, 0] == 0
    assert accept_greedy(draft, target, torch.tensor([2, 3]))[1].tolist() == [2, 0]
    p_logits = (target * 50).log_softmax(-1)
    q_logits = (torch.nn.functional.one_hot(draft, 8).float() * 50).log_softmax(-1)  # each drafted token: q ≈ 1
    tokens, kept = accept_sampled(draft, q_logits, p_logits)
    assert kept.tolist() == [3, 0] and tokens[0].tolist() == [3, 4, 5, 6] and tokens[1, 0] == 0


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


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.shape[0]).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def chi_square_999(df: int) -> float:
    """The 0.999 quantile of chi-square(df) (Wilson–Hilferty: within 2% from 3 degrees of freedom on)."""
    return df * (1 - 2 / (9 * df) + 3.0902 * (2 / (9 * df)) ** 0.5) ** 3


def test_speculative_sampling_keeps_the_target_distribution():
    """accept_sampled on fixed p (target) and q (draft) over 4 tokens, 20 000 rows at once, each deciding on its
    own: the first emitted token's frequencies match p (chi-square, 3 degrees of freedom, p-value > 0.001),
    however far q is from p; the token after a kept first one is p's of the next column, though other rows
    rejected theirs; a draft cut by ``limit`` draws its last token from p (not from the residual)."""
    torch.manual_seed(0)
    p_logits = torch.tensor([[2.0, 0.5, -1.0, 0.0], [0.0, 1.0, 0.0, -2.0], [0.0, 0.0, 0.0, 0.0]]).log_softmax(-1)
    q_logits = torch.tensor([[-1.0, 2.0, 0.5, 0.0], [1.5, 0.0, 0.0, 0.0]]).log_softmax(-1)
    n = 20_000
    q = q_logits.softmax(-1)
    draft = torch.stack([torch.multinomial(q[i].expand(n, -1), 1).squeeze(1) for i in range(2)], 1)  # [n, 2]
    tokens, kept = accept_sampled(draft, q_logits.expand(n, 2, 4), p_logits.expand(n, 3, 4))
    p = p_logits.softmax(-1)
    assert 0 < int((kept == 0).sum()) < n  # rows keep different lengths
    assert chi_square(tokens[:, 0], p[0]) < 16.27  # the 0.999 quantile of chi-square(3)
    assert chi_square(tokens[kept >= 1, 1], p[1]) < 16.27
    cut, cut_kept = accept_sampled(
        draft, q_logits.expand(n, 2, 4), p_logits.expand(n, 3, 4), torch.zeros(n, dtype=torch.long)
    )
    assert not cut_kept.any() and chi_square(cut[:, 0], p[0]) < 16.27


def test_sampling_generates_and_matches_plain_sampling_in_distribution():
    """With do_sample, DSpark decoding is a sampler of the main model: the second and third new tokens' frequencies
    over many rows agree with plain sampling's (the same joint distribution, so the same marginals; chi-square on
    the tokens drawn), though each row keeps its own number of drafted tokens."""
    model = dspark_model()
    prompt = random_prompt(6, 10).expand(200, -1)
    kwargs = dict(max_new_tokens=3, do_sample=True, top_k=4, temperature=1.5)
    torch.manual_seed(1)
    plain = model.generate(prompt, **kwargs)
    torch.manual_seed(2)
    spec = model.generate(prompt, use_mtp=True, **kwargs)
    for column in (-2, -1):
        tokens = torch.unique(torch.cat([plain[:, column], spec[:, column]]))
        a = torch.stack([(plain[:, column] == t).sum() for t in tokens]).double()
        b = torch.stack([(spec[:, column] == t).sum() for t in tokens]).double()
        chi2 = float((((a - b) ** 2) / (a + b).clamp_min(1)).sum())
        assert chi2 < chi_square_999(len(tokens) - 1), (column, tokens, a, b)  # two-sample chi-square
