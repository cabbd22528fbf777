"""DSpark speculative decoding: the release's draft head (``mtp.*``, :mod:`..dspark`) in
``generate(..., use_mtp=True)``.

:class:`DeepseekV41DSparkCandidateGenerator` is a transformers candidate generator (the interface of its assisted
decoding). What differs from transformers' ``MTPCandidateGenerator`` is DSpark's: one draft pass proposes a whole
block (``dspark_block_size`` tokens) from the main model's tapped streams (``output_dspark_hidden_states``), and
the draft head's only state, its window rings (:class:`~.cache.DeepseekV41DSparkCache`), takes every main position
the main model accepted — never a rejected one, so nothing of it is rolled back.

:func:`dspark_decoding` is the loop, transformers' assisted decoding carried past batch 1: the main model verifies
each draft in one forward, every row keeps the longest prefix all rows agree on plus the main model's own next token
(greedy: the tokens plain greedy decoding gives), or the standard speculative-sampling acceptance rule decides per
row (sampling: the main model's distribution is kept), the main cache (dynamic, or static with a rollback of up to
a block) is cropped back over the rejected tokens, and the accepted tokens go through the stopping criteria and the streamer one by one, as plain
decoding hands them over.

``dspark_confidence_threshold`` (a generation-config attribute, or a ``generate`` argument) cuts a draft before the
first token whose confidence-head probability is below it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.generation.candidate_generator import CandidateGenerator

from .cache import DeepseekV41DSparkCache


class DeepseekV41DSparkCandidateGenerator(CandidateGenerator):
    """Draft blocks from the main model's own DSpark head (see the module docstring)."""

    requires_model_outputs = True
    model_kwargs_overrides: dict[str, Any] = {"output_dspark_hidden_states": True}

    def __init__(self, model: nn.Module, generation_config, logits_processor=None):
        if getattr(model, "mtp", None) is None:
            raise ValueError(
                "use_mtp=True needs the DSpark draft head: this model's config has none (dspark_block_size = 0)"
            )
        self.model = model
        self.head = model.mtp
        text = model.config.get_text_config()
        self.rings = DeepseekV41DSparkCache(len(self.head), text.sliding_window)
        self.max_length = generation_config.max_length
        self.do_sample = generation_config.do_sample
        self.logits_processor = logits_processor
        self.threshold = getattr(generation_config, "dspark_confidence_threshold", None)
        if self.threshold is not None and not 0 <= self.threshold <= 1:
            raise ValueError(f"dspark_confidence_threshold must be a probability in [0, 1], got {self.threshold}")

    @torch.no_grad()
    def get_candidates(
        self, input_ids: torch.LongTensor, model_kwargs: dict[str, Any], model_outputs, is_first_iteration: bool,
        n_last_matches: int, **kwargs,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """input_ids [B, L]: the sequences so far, their last token the main model's newest (not yet forwarded).
        Returns them with the drafted tokens appended, and the (processed) draft logits of those [B, n, V]."""
        if is_first_iteration:  # the main model's prefill comes first: the draft needs its taps
            return input_ids, None
        taps = model_outputs.dspark_hidden_states
        if taps is None:
            raise ValueError("the main model's outputs carry no dspark_hidden_states: was it called with the overrides?")
        self._write_accepted(taps, model_kwargs.get("attention_mask"), input_ids.shape[1], n_last_matches)
        budget = min(self.head.block_size, self.max_length - input_ids.shape[1] - 1)
        if budget <= 0:
            return input_ids, None
        processed: list[torch.Tensor] = []
        ids, logits, confidence = self.head.draft(
            self.rings, input_ids[:, -1], self.rings.lengths - 1, self.model.model.embed, self.model.lm_head,
            choose=self._chooser(input_ids, processed),
        )
        processed = torch.stack(processed, dim=1)
        length = budget
        if self.threshold is not None:  # keep the draft up to (not including) any row's first unconfident token
            confident = torch.sigmoid(confidence[:, :budget]) >= self.threshold
            length = int(confident.long().cumprod(dim=1).sum(dim=1).min())
            if length == 0:
                return input_ids, None
        return torch.cat([input_ids, ids[:, 1 : length + 1]], dim=-1), processed[:, :length]

    def _write_accepted(
        self, taps: torch.Tensor, attention_mask: torch.Tensor | None, total: int, n_last_matches: int
    ) -> None:
        """Write the main positions the last forward accepted into the rings: the whole prompt after the prefill,
        then the ``n_last_matches + 1`` first tokens of each verification."""
        if self.rings.lengths is None:  # the prefill: every real prompt position (left padding is aligned away)
            mask = torch.ones(taps.shape[:2], dtype=torch.long, device=taps.device)
            if attention_mask is not None:
                mask = attention_mask[:, : taps.shape[1]].to(taps.device)
            positions = mask.cumsum(dim=1) - 1
            self.head.write_ring(self.rings, taps, positions, mask.bool())
            return
        taps = taps[:, : n_last_matches + 1]
        positions = self.rings.lengths.unsqueeze(1) + torch.arange(taps.shape[1], device=taps.device)
        self.head.write_ring(self.rings, taps, positions)

    def _chooser(self, input_ids: torch.LongTensor, processed: list[torch.Tensor]):
        """The token choice for each draft column: the logits processors on the sequence drafted so far, then argmax
        or a sample; the processed logits are appended to ``processed`` (the acceptance rule compares the main
        model's against them)."""
        sequence = input_ids
        processors = self.logits_processor if self.logits_processor is not None and len(self.logits_processor) else None

        def choose(logits: torch.Tensor, column: int) -> torch.Tensor:
            nonlocal sequence
            if processors is not None:
                logits = processors(sequence, logits)
            processed.append(logits)
            token = _choose(logits, self.do_sample)
            if processors is not None:  # only processors read the drafted sequence
                sequence = torch.cat([sequence, token.unsqueeze(1)], dim=-1)
            return token

        return choose


def _choose(logits: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """A token per row from processed logits [B, V]."""
    if do_sample:
        return torch.multinomial(logits.softmax(dim=-1), num_samples=1).squeeze(1)
    return logits.argmax(dim=-1)


def _processed(logits_processor, sequences: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The main model's logits [B, n, V] for the tokens after each prefix ``sequences[:, : L - n + 1 + i]``, through
    the logits processors (the same prefixes the draft's were processed with)."""
    logits = logits.float()
    if logits_processor is None or len(logits_processor) == 0:
        return logits
    start = sequences.shape[1] - logits.shape[1] + 1
    return torch.stack([logits_processor(sequences[:, : start + i], logits[:, i]) for i in range(logits.shape[1])], 1)


def accept_greedy(draft: torch.Tensor, target_logits: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
    """draft [B, L], the main model's processed logits [B, L+1, V] → the tokens every row keeps [B, n+1]: the longest
    draft prefix all ``active`` rows' argmaxes agree with (rows that have finished emit padding whatever they draft,
    so they do not shorten it), then the main model's next token (its argmax after that prefix)."""
    chosen = target_logits.argmax(dim=-1)
    agree = draft == chosen[:, :-1]
    if active is not None:
        agree = agree | ~active.unsqueeze(1)
    n = int(agree.long().cumprod(dim=1).sum(dim=1).min())
    return chosen[:, : n + 1]


def accept_sampled(
    draft: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor, active: torch.Tensor | None = None
) -> torch.Tensor:
    """The speculative-sampling rule (Leviathan et al. 2023, algorithm 1), per row: draft token i is kept with
    probability min(1, p/q); at the first rejection the token is drawn from normalize(max(0, p - q)), and after a
    fully kept draft from p. Every row keeps as many tokens as the row that kept fewest: a row past its own first
    rejection would be conditioned on another row's, so each row's token at that column is decided by its own rule
    there (kept draft token, or its residual draw), which has p's distribution given its prefix. Rows not ``active``
    (finished: they emit padding) keep every token. Returns [B, n+1]."""
    p, q = target_logits.softmax(dim=-1), draft_logits.softmax(dim=-1)
    p_draft = p[:, :-1].gather(-1, draft.unsqueeze(-1)).squeeze(-1)
    q_draft = q.gather(-1, draft.unsqueeze(-1)).squeeze(-1)
    kept = torch.rand_like(p_draft) * q_draft <= p_draft  # u <= p / q
    if active is not None:
        kept = kept | ~active.unsqueeze(1)
    n = int(kept.long().cumprod(dim=1).sum(dim=1).min())
    if n == draft.shape[1]:
        last = torch.multinomial(p[:, n], num_samples=1).squeeze(1)
    else:
        residual = (p[:, n] - q[:, n]).clamp_min(0)
        empty = residual.sum(dim=-1, keepdim=True) == 0  # p ≤ q everywhere: only possible where the token was kept
        residual = torch.where(empty, p[:, n], residual)
        last = torch.where(kept[:, n], draft[:, n], torch.multinomial(residual, num_samples=1).squeeze(1))
    return torch.cat([draft[:, :n], last.unsqueeze(1)], dim=1)


def dspark_decoding(
    model, input_ids: torch.LongTensor, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
    streamer=None, **model_kwargs,
):
    """``generate``'s decoding loop for ``use_mtp=True`` (see the module docstring); returns the sequences [B, S]
    (in a ``GenerateDecoderOnlyOutput`` with ``return_dict_in_generate``)."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    unsupported = [name for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
                   if getattr(generation_config, name, False)]
    if unsupported or synced_gpus:
        raise ValueError(f"DSpark speculative decoding (use_mtp=True) does not support {unsupported or 'synced_gpus'}")
    cache = model_kwargs.get("cache")
    if cache is None:
        raise ValueError("DSpark speculative decoding needs a cache (use_cache=True)")
    generator = DeepseekV41DSparkCandidateGenerator(model, generation_config, logits_processor)
    cache.activate_past_recording(max_rewind=generator.head.block_size)  # a step rejects at most a whole draft
    do_sample, pad = generation_config.do_sample, generation_config._pad_token_tensor
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)

    def emit(tokens: torch.Tensor) -> bool:
        """Hand over accepted tokens [B, n] one column at a time, as plain decoding would; True once all rows end."""
        nonlocal input_ids, unfinished
        for token in tokens.unbind(dim=1):
            if pad is not None:
                token = token * unfinished + pad * (1 - unfinished)
            input_ids = torch.cat([input_ids, token.unsqueeze(1)], dim=-1)
            if streamer is not None:
                streamer.put(token.cpu())
            unfinished = unfinished & ~stopping_criteria(input_ids, None)
            if unfinished.max() == 0:
                return True
        return False

    model_inputs = model.prepare_inputs_for_generation(input_ids, is_first_iteration=True, **model_kwargs)
    outputs = model(**model_inputs, output_dspark_hidden_states=True, return_dict=True)
    logits = _processed(logits_processor, input_ids, outputs.logits[:, -1:])
    finished = emit(_choose(logits[:, 0], do_sample).unsqueeze(1))
    kept = 0
    while not finished:
        candidates, draft_logits = generator.get_candidates(
            input_ids, model_kwargs=model_kwargs, model_outputs=outputs, is_first_iteration=False, n_last_matches=kept,
        )
        length = candidates.shape[1] - input_ids.shape[1]
        outputs = model(input_ids=candidates[:, -length - 1 :], cache=cache, output_dspark_hidden_states=True,
                        return_dict=True)
        target = _processed(logits_processor, candidates, outputs.logits[:, -length - 1 :])
        draft = candidates[:, input_ids.shape[1] :]
        if length == 0:
            tokens = _choose(target[:, 0], do_sample).unsqueeze(1)
        elif do_sample:
            tokens = accept_sampled(draft, draft_logits, target, unfinished.bool())
        else:
            tokens = accept_greedy(draft, target, unfinished.bool())
        kept = tokens.shape[1] - 1
        cache.crop(-(length - kept))
        finished = emit(tokens)
    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=input_ids, past_key_values=cache)
    return input_ids


__all__ = ["DeepseekV41DSparkCandidateGenerator", "accept_greedy", "accept_sampled", "dspark_decoding"]
