"""What ``dsv41 demo`` measures on held-out images: caption exact match, and DSpark speculative decoding against plain
decoding (tokens/s of both, the mean accepted length, whether the captions are identical)."""

from __future__ import annotations

import time
from typing import Any

import torch

from processing import DeepseekV41Processor

from . import demo_reload
from .demo_data import PROMPT, ShapesDataset
from ..generation.cache import DeepseekV41Cache
from ..modeling_dsv41 import DeepseekV41ForCausalLM

DSPARK_TIMING_REPS = 2  # each decoding timed this many times, alternating; the fastest counts (least disturbed)


def caption_exact_match(
    model: Any, processor: Any, dataset: ShapesDataset, batch_size: int = 72
) -> tuple[float, list[str]]:
    """Share of ``dataset`` images whose greedy caption equals the true one, and the captions."""
    model.eval()
    predictions = []
    for start in range(0, len(dataset), batch_size):
        samples = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        predictions += demo_reload.caption_images(model, processor, [s.image for s in samples], PROMPT)
    truth = [dataset[i].caption for i in range(len(dataset))]
    return sum(p == t for p, t in zip(predictions, truth)) / len(truth), predictions


def _decoded_tokens(new: torch.Tensor, eos_token_id: int) -> int:
    """Tokens generated in new [B, N]: each row's up to its first EOS (included), or all N."""
    is_eos = new == eos_token_id
    ended = is_eos.any(dim=1)
    return int(torch.where(ended, is_eos.long().argmax(dim=1) + 1, new.shape[1]).sum())


@torch.no_grad()
def dspark_speed(model: DeepseekV41ForCausalLM, processor: DeepseekV41Processor, images: list) -> dict[str, Any]:
    """Greedy captions of ``images`` in one batch (one ``generate`` call, as a batch is captioned), by plain cached
    decoding and by DSpark speculative decoding (every row advancing by its own accepted length), timed in
    alternation (the fastest of :data:`DSPARK_TIMING_REPS` each): tokens/s of both, their ratio, the mean accepted
    length (tokens a row decodes per verification forward after the prefill's) and whether the tokens are
    identical."""
    model.eval()
    greedy = dict(max_new_tokens=demo_reload.MAX_NEW_TOKENS, do_sample=False)
    inputs = demo_reload.caption_inputs(processor, images, PROMPT)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    outputs = {}
    for _ in range(DSPARK_TIMING_REPS):
        for use_mtp in (False, True):
            start = time.perf_counter()
            outputs[use_mtp] = model.generate(**inputs, use_mtp=use_mtp, **greedy)
            seconds[use_mtp].append(time.perf_counter() - start)
    prompt_len = inputs["input_ids"].shape[1]
    tokens = _decoded_tokens(outputs[False][:, prompt_len:], model.generation_config.eos_token_id)
    plain_rate, spec_rate = tokens / min(seconds[False]), tokens / min(seconds[True])
    return {
        "images": len(images),
        "tokens": tokens,
        "plain_tokens_per_s": plain_rate,
        "dspark_tokens_per_s": spec_rate,
        "speedup": spec_rate / plain_rate,
        "mean_accepted_length": (tokens - len(images)) / max(_row_verifications(model, inputs, greedy), 1),
        "captions_identical": bool(torch.equal(outputs[True], outputs[False])),
    }


def _row_verifications(model: DeepseekV41ForCausalLM, inputs: dict, greedy: dict) -> int:
    """Verification forwards summed over the rows in them that kept tokens (a row that is done leaves the batch):
    from each forward's width and what the decode cache's per-row rollback after it removed."""
    cache, widths, rows = DeepseekV41Cache(model.config), [], []
    crop_rows = cache.crop_rows

    def count_rows(tokens: torch.Tensor) -> None:
        rows.append(int((widths[-1] - tokens > 0).sum()))
        crop_rows(tokens)

    cache.crop_rows = count_rows
    hook = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]) if "input_ids" in kwargs else None,
        with_kwargs=True,
    )
    try:
        model.generate(**inputs, use_mtp=True, cache=cache, **greedy)
    finally:
        hook.remove()
    return sum(rows)


__all__ = ["caption_exact_match", "dspark_speed"]
