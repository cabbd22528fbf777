"""DSpark speculative decoding: the release's draft head (``mtp.*``, :mod:`..dspark`) as a transformers candidate
generator, for ``generate(..., use_mtp=True)``.

transformers' assisted decoding drives the loop: the main model verifies each draft in one forward, keeps the longest
agreeing prefix plus its own next token (greedy), or applies the speculative-sampling acceptance rule to the draft's
probabilities (sampling), crops its :class:`~.cache.DeepseekV41Cache` back over the rejected tokens, and streams what
it accepted. What differs from transformers' ``MTPCandidateGenerator`` is DSpark's: one draft pass proposes a whole
block (``dspark_block_size`` tokens) from the main model's tapped streams (``output_dspark_hidden_states``), and
the draft head's only state, its window rings (:class:`~.cache.DeepseekV41DSparkCache`), takes every main position
the main model accepted — never a rejected one, so nothing of it is rolled back.

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
        """input_ids [1, L]: the sequence so far, its last token the main model's newest (not yet forwarded)."""
        if is_first_iteration:  # the main model's prefill comes first: the draft needs its taps
            return input_ids, None
        taps = model_outputs.dspark_hidden_states
        if taps is None:
            raise ValueError("the main model's outputs carry no dspark_hidden_states: was it called with the overrides?")
        self._write_accepted(taps, model_kwargs.get("attention_mask"), input_ids.shape[1], n_last_matches)
        budget = min(self.head.block_size, self.max_length - input_ids.shape[1] - 1)
        if budget <= 0:
            return input_ids, None
        ids, logits, confidence = self.head.draft(
            self.rings, input_ids[:, -1], self.rings.lengths - 1, self.model.model.embed, self.model.lm_head,
            choose=self._chooser(input_ids),
        )
        length = budget
        if self.threshold is not None:  # keep the draft up to (not including) its first unconfident token
            confident = torch.sigmoid(confidence[0, :budget]) >= self.threshold
            length = int(confident.long().cumprod(0).sum())
            if length == 0:
                return input_ids, None
        return torch.cat([input_ids, ids[:, 1 : length + 1]], dim=-1), self._processed[:, :length]

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

    def _chooser(self, input_ids: torch.LongTensor):
        """The token choice for each draft column: the logits processors on the sequence drafted so far, then argmax
        or a sample; the processed logits are kept (the acceptance rule compares the main model's against them)."""
        sequence = input_ids
        processed = []

        def choose(logits: torch.Tensor, column: int) -> torch.Tensor:
            nonlocal sequence
            if self.logits_processor is not None and len(self.logits_processor) > 0:
                logits = self.logits_processor(sequence, logits)
            processed.append(logits)
            if self.do_sample:
                token = torch.multinomial(logits.softmax(dim=-1), num_samples=1).squeeze(1)
            else:
                token = logits.argmax(dim=-1)
            sequence = torch.cat([sequence, token.unsqueeze(1)], dim=-1)
            self._processed = torch.stack(processed, dim=1)
            return token

        return choose


__all__ = ["DeepseekV41DSparkCandidateGenerator"]
