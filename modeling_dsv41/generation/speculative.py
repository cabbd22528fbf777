"""DSpark speculative decoding: the release's draft head (``mtp.*``, :mod:`..dspark`) in
``generate(..., use_mtp=True)``, at any batch size, every row advancing by its own accepted length.

:class:`DeepseekV41DSparkCandidateGenerator` is a transformers candidate generator (the interface of its assisted
decoding). What differs from transformers' ``MTPCandidateGenerator`` is DSpark's: one draft pass proposes a whole
block (``dspark_block_size`` tokens) from the main model's tapped streams (``output_dspark_hidden_states``), and
the draft head's only state, its window rings (:class:`~.cache.DeepseekV41DSparkCache`), takes every main position
the main model accepted — never a rejected one, so nothing of it is rolled back.

:func:`dspark_decoding` is the loop, transformers' assisted decoding carried past batch 1. The main model verifies
each row's draft in one forward; each row keeps its own accepted prefix plus the main model's next token (greedy:
the longest prefix its argmaxes agree with, so the tokens are plain greedy decoding's; sampling: the
speculative-sampling rule, so the main model's distribution is kept), and the main cache forgets each row's own
rejected tokens (:meth:`~.cache.DeepseekV41Cache.crop_rows`): rows fall out of step, each at its own position.
The stopping criteria see each new column of a row as plain decoding would (the sequences up to it), and the
streamer gets the columns in order once every row has decoded them. A row that is done (finished, or as long as
plain decoding would make it) leaves the dynamic cache, the rings and the later forwards (the logits processors and
stopping criteria still see the whole batch, as plain decoding calls them); with the static cache it stays in the
forwards, so that the shapes never change, and drops what they add.

``dspark_confidence_threshold`` (a generation-config attribute, or a ``generate`` argument) cuts each row's draft
before its first token whose confidence-head probability is below it.
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
        self.do_sample = generation_config.do_sample
        self.logits_processor = logits_processor
        self.threshold = getattr(generation_config, "dspark_confidence_threshold", None)
        if self.threshold is not None and not 0 <= self.threshold <= 1:
            raise ValueError(f"dspark_confidence_threshold must be a probability in [0, 1], got {self.threshold}")

    @torch.no_grad()
    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any],
        model_outputs,
        n_last_matches: torch.Tensor,
        lengths: torch.Tensor,
        rows: torch.Tensor,
    ) -> tuple[torch.LongTensor, torch.Tensor, torch.Tensor]:
        """One draft block for each of the batch's ``rows`` [R] (those the last forward and the rings hold).

        input_ids [B, T]: each row's sequence in its first ``lengths[b]`` columns (prompt columns shared, the last
        one the main model's newest token, not yet forwarded). ``n_last_matches`` [R]: the main positions each of
        the rows kept of the last forward (all real prompt positions after the prefill; 0 for a row that is done).

        Returns the block [R, nb], its processed logits [R, nb, V] and each row's confident length [R] (``nb``
        without a threshold). The main model's prefill comes first: the draft needs its taps."""
        taps = model_outputs.dspark_hidden_states
        if taps is None:
            raise ValueError(
                "the main model's outputs carry no dspark_hidden_states: was it called with the overrides?"
            )
        self._write_accepted(taps, model_kwargs.get("attention_mask"), n_last_matches)
        sequence = _with_columns(input_ids, lengths, input_ids.new_zeros(input_ids.shape[0], self.head.block_size))
        first = sequence[rows].gather(1, (lengths[rows] - 1).unsqueeze(1)).squeeze(1)
        processed: list[torch.Tensor] = []
        ids, _, confidence = self.head.draft(
            self.rings,
            first,
            self.rings.lengths - 1,
            self.model.model.embed,
            self.model.lm_head,
            choose=self._chooser(sequence, lengths, rows, processed),
        )
        confident = torch.full_like(first, self.head.block_size)
        if self.threshold is not None:  # each row's draft up to (not including) its first unconfident token
            confident = (torch.sigmoid(confidence) >= self.threshold).long().cumprod(dim=1).sum(dim=1)
        return ids[:, 1:], torch.stack(processed, dim=1), confident

    def _write_accepted(self, taps: torch.Tensor, attention_mask: torch.Tensor | None, kept: torch.Tensor) -> None:
        """Write the main positions the last forward accepted into the rings: the whole prompt after the prefill,
        then each row's ``kept[b]`` first tokens of a verification."""
        if self.rings.lengths is None:  # the prefill: every real prompt position (left padding is aligned away)
            mask = torch.ones(taps.shape[:2], dtype=torch.long, device=taps.device)
            if attention_mask is not None:
                mask = attention_mask[:, : taps.shape[1]].to(taps.device)
            positions = mask.cumsum(dim=1) - 1
            self.head.write_ring(self.rings, taps, positions, mask.bool())
            return
        column = torch.arange(taps.shape[1], device=taps.device)
        positions = self.rings.lengths.unsqueeze(1) + column
        self.head.write_ring(self.rings, taps, positions, column < kept.unsqueeze(1))

    def _chooser(
        self, sequence: torch.LongTensor, lengths: torch.Tensor, rows: torch.Tensor, processed: list[torch.Tensor]
    ):
        """The token choice for each draft column of ``rows``: the logits processors on each row's sequence drafted
        so far (as the main model's logits are processed), then argmax or a sample, written into ``sequence``; the
        processed logits are appended to ``processed`` (the acceptance rule compares the main model's against
        them)."""

        def choose(logits: torch.Tensor, column: int) -> torch.Tensor:
            logits = process_rows(self.logits_processor, sequence, lengths + column, logits.unsqueeze(1), rows)[:, 0]
            processed.append(logits)
            token = _choose(logits, self.do_sample)
            sequence[rows, lengths[rows] + column] = token
            return token

        return choose


def _choose(logits: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """A token per row from processed logits [B, V]."""
    if do_sample:
        return torch.multinomial(logits.softmax(dim=-1), num_samples=1).squeeze(1)
    return logits.argmax(dim=-1)


def _scatter_rows(values: torch.Tensor, rows: torch.Tensor, batch: int) -> torch.Tensor:
    """values [R, ...] of the batch's ``rows`` [R] → [batch, ...], zeros in the other rows."""
    out = values.new_zeros(batch, *values.shape[1:])
    out[rows] = values
    return out


def _with_columns(sequences: torch.Tensor, lengths: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``sequences`` [B, T] with ``new`` [B, n] written after each row's ``lengths[b]`` columns (a new tensor, as
    wide as needed)."""
    width = max(sequences.shape[1], int(lengths.max()) + new.shape[1])
    out = torch.nn.functional.pad(sequences, (0, width - sequences.shape[1]))
    return out.scatter(1, lengths.unsqueeze(1) + torch.arange(new.shape[1], device=new.device), new)


def process_columns(
    logits_processor, sequences: torch.Tensor, starts: torch.Tensor, logits: torch.Tensor
) -> torch.Tensor:
    """The logits processors on logits [B, n, V] whose column i of row b follows the prefix
    ``sequences[b, : starts[b] + i]``: for each prefix length, the processors see the sequences cut there (the
    call plain decoding makes at that length, whose rows it then keeps), so that rows at other lengths get the
    processing plain decoding gives them (processors that read ``input_ids.shape``, e.g. minimum lengths, too)."""
    logits = logits.float()
    if logits_processor is None or len(logits_processor) == 0:
        return logits
    n = logits.shape[1]
    out = torch.empty_like(logits)
    first, last = int(starts.min()), int(starts.max()) + n
    for length in range(first, last):
        column = length - starts  # [B]: which column of each row follows this prefix
        rows = ((column >= 0) & (column < n)).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        scores = logits[torch.arange(logits.shape[0], device=logits.device), column.clamp(0, n - 1)]
        scores = logits_processor(sequences[:, :length], scores)
        out[rows, column[rows]] = scores[rows]
    return out


def process_rows(
    logits_processor, sequences: torch.Tensor, starts: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """:func:`process_columns` for logits [R, n, V] of the batch's ``rows`` [R] only (``sequences`` [B, T] and
    ``starts`` [B]: the whole batch's). The processors still see the whole batch, as plain decoding calls them (a
    processor may keep per-row state or read a row's index); the other rows' logits are zeros there, and dropped."""
    if logits_processor is None or len(logits_processor) == 0:
        return logits.float()
    full = _scatter_rows(logits, rows, sequences.shape[0])
    return process_columns(logits_processor, sequences, starts, full)[rows]


def accept_greedy(
    draft: torch.Tensor, target_logits: torch.Tensor, limit: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """draft [B, L], the main model's processed logits [B, L+1, V] → (its argmax tokens [B, L+1], the draft tokens
    each row keeps [B]): the longest draft prefix the row's argmaxes agree with (at most ``limit[b]``). Row b keeps
    ``tokens[b, : kept[b] + 1]``: that prefix, then the main model's next token after it."""
    chosen = target_logits.argmax(dim=-1)
    agree = draft == chosen[:, :-1]
    if limit is not None:
        agree = agree & (torch.arange(draft.shape[1], device=draft.device) < limit.unsqueeze(1))
    return chosen, agree.long().cumprod(dim=1).sum(dim=1)


def accept_sampled(
    draft: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor, limit: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative-sampling rule (Leviathan et al. 2023, algorithm 1), each row on its own: draft token i is
    kept with probability min(1, p/q); at the row's first rejection the next token is drawn from
    normalize(max(0, p - q)), and after a fully kept draft (or its first ``limit[b]`` tokens: a draft cut there) from
    p. Returns (tokens [B, L+1], the draft tokens each row keeps [B]): row b keeps ``tokens[b, : kept[b] + 1]``."""
    bsz, length = draft.shape
    p, q = target_logits.softmax(dim=-1), draft_logits.softmax(dim=-1)
    p_draft = p[:, :-1].gather(-1, draft.unsqueeze(-1)).squeeze(-1)
    q_draft = q.gather(-1, draft.unsqueeze(-1)).squeeze(-1)
    limit = torch.full((bsz,), length, device=draft.device) if limit is None else limit
    column = torch.arange(length, device=draft.device)
    kept = (torch.rand_like(p_draft) * q_draft <= p_draft) & (column < limit.unsqueeze(1))  # u <= p / q
    n = kept.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(bsz, device=draft.device)
    p_next = p[rows, n]  # [B, V]: the main model's distribution after each row's kept prefix
    rejected = n < limit
    residual = (p_next - q[rows, n.clamp_max(length - 1)]).clamp_min(0)
    residual = torch.where(rejected.unsqueeze(1) & (residual.sum(dim=-1, keepdim=True) > 0), residual, p_next)
    last = torch.multinomial(residual, num_samples=1).squeeze(1)  # p ≤ q everywhere only where the token was kept
    tokens = torch.cat([draft, draft.new_zeros(bsz, 1)], dim=1)
    tokens[rows, n] = last
    return tokens, n


class _Rows:
    """Each row's sequence as it advances by its own accepted length, and what plain decoding does with it: the
    stopping criteria for each new column, padding after a finished row (with an EOS criterion, as plain decoding
    pads), the streamer's columns in order.

    sequences [B, T]: the prompt columns, then row b's generated tokens up to ``lengths[b]``. A row is *done* once
    plain decoding would give it no more tokens: finished with an EOS criterion, or as long as the output (the
    longest finishing row, once every row has finished) or ``max_length``."""

    def __init__(self, input_ids: torch.Tensor, stopping_criteria, generation_config, streamer, extra: int):
        self.stopping_criteria, self.streamer = stopping_criteria, streamer
        self.max_length = generation_config.max_length
        pad = generation_config._pad_token_tensor
        # plain decoding pads finished rows only with an EOS criterion; otherwise they go on until every row ends
        self.pad = pad if any(hasattr(c, "eos_token_id") for c in stopping_criteria) else None
        bsz, self.prompt = input_ids.shape
        width = max(self.max_length, self.prompt) + extra
        fill = 0 if pad is None else int(pad)
        self.sequences = torch.cat([input_ids, input_ids.new_full((bsz, width - self.prompt), fill)], dim=1)
        self.lengths = torch.full((bsz,), self.prompt, dtype=torch.long, device=input_ids.device)
        self.finished_at: torch.Tensor = torch.full_like(self.lengths, -1)  # the row's length when it finished
        self.streamed = self.prompt

    @property
    def finished(self) -> torch.Tensor:
        return self.finished_at >= 0

    def done(self) -> torch.Tensor:
        """[B] bool: rows plain decoding would give no more tokens."""
        done = self.lengths >= self.max_length
        if self.pad is not None:
            done |= self.finished
        if bool(self.finished.all()):
            done |= self.lengths >= self.finished_at.max()
        return done

    def last_tokens(self) -> torch.Tensor:
        return self.sequences.gather(1, (self.lengths - 1).unsqueeze(1)).squeeze(1)

    def append(self, tokens: torch.Tensor, kept: torch.Tensor) -> None:
        """Row b takes ``tokens[b, : kept[b]]``; then the stopping criteria run at each new column."""
        rows, column = (torch.arange(tokens.shape[1], device=tokens.device) < kept.unsqueeze(1)).nonzero(as_tuple=True)
        before = self.lengths
        self.sequences[rows, before[rows] + column] = tokens[rows, column]
        self.lengths = before + kept
        if bool((kept > 0).any()):
            self._stop(before, self.lengths)
        self._stream()

    def _stop(self, before: torch.Tensor, after: torch.Tensor) -> None:
        """The stopping criteria at each length a row went through (plain decoding's call with the sequences cut
        there); a row stops at the first one that finishes it, padded after it with an EOS criterion."""
        for length in range(int(before[after > before].min()) + 1, int(after.max()) + 1):
            reached = (before < length) & (after >= length) & ~self.finished
            if not bool(reached.any()):
                continue
            stop = self.stopping_criteria(self.sequences[:, :length], None) & reached
            self.finished_at = torch.where(stop, length, self.finished_at)
        if self.pad is not None:  # a finished row's tokens past its end are padding, and it decodes no further
            ended = self.finished & (self.lengths > self.finished_at)
            column = torch.arange(self.sequences.shape[1], device=self.sequences.device)
            self.sequences.masked_fill_(ended.unsqueeze(1) & (column >= self.finished_at.unsqueeze(1)), self.pad)
            self.lengths = torch.where(ended, self.finished_at, self.lengths)

    def _stream(self) -> None:
        """Hand the streamer every column all rows have now (padding for those that ended), one at a time."""
        if self.streamer is None:
            return
        for column in range(self.streamed, self.output_length()):
            self.streamer.put(self.sequences[:, column].cpu())
        self.streamed = max(self.streamed, self.output_length())

    def output_length(self) -> int:
        """Columns every row has decoded (an ended row: all of them), within the output."""
        available = self.lengths
        if self.pad is not None:
            available = torch.where(self.finished, self.sequences.shape[1], available)
        end = self.max_length
        if bool(self.finished.all()):
            end = min(end, int(self.finished_at.max()))
        return min(int(available.min()), end)


def dspark_decoding(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus=False,
    streamer=None,
    **model_kwargs,
):
    """``generate``'s decoding loop for ``use_mtp=True`` (see the module docstring); returns the sequences [B, S]
    (in a ``GenerateDecoderOnlyOutput`` with ``return_dict_in_generate``)."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    unsupported = [
        name
        for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
        if getattr(generation_config, name, False)
    ]
    if unsupported or synced_gpus:
        raise ValueError(f"DSpark speculative decoding (use_mtp=True) does not support {unsupported or 'synced_gpus'}")
    cache = model_kwargs.get("cache")
    if cache is None:
        raise ValueError("DSpark speculative decoding needs a cache (use_cache=True)")
    generator = DeepseekV41DSparkCandidateGenerator(model, generation_config, logits_processor)
    block, do_sample = generator.head.block_size, generation_config.do_sample
    accept = accept_sampled if do_sample else accept_greedy
    # a row that is done drops the whole verification forward: its draft and its newest token
    cache.activate_past_recording(max_rewind=block + 1)
    # a compileable (static) cache verifies whole blocks: the same shapes every step, one compiled graph
    fixed_shape = cache.is_compileable
    model_forward = (
        model.get_compiled_call(generation_config.compile_config)
        if model._valid_auto_compile_criteria(model_kwargs, generation_config)
        else model.__call__
    )
    rows = _Rows(input_ids, stopping_criteria, generation_config, streamer, extra=block + 1)
    # the batch's rows that the cache, the draft head's rings and the forwards hold: a row that is done leaves them
    # (with the dynamic cache; the static one keeps its shapes, so that one compiled graph serves every step)
    live = torch.arange(input_ids.shape[0], device=input_ids.device)

    model_inputs = model.prepare_inputs_for_generation(input_ids, is_first_iteration=True, **model_kwargs)
    outputs = model(**model_inputs, output_dspark_hidden_states=True, return_dict=True)
    logits = process_columns(logits_processor, input_ids, rows.lengths, outputs.logits[:, -1:])
    kept = torch.ones_like(rows.lengths)
    rows.append(_choose(logits[:, 0], do_sample).unsqueeze(1), kept)
    done = rows.done()
    while not bool(done.all()):
        draft, draft_logits, confident = generator.get_candidates(
            rows.sequences,
            model_kwargs=model_kwargs,
            model_outputs=outputs,
            n_last_matches=kept,
            lengths=rows.lengths,
            rows=live,
        )
        if not fixed_shape and bool(done[live].any()):  # (after the rings took the last forward's accepted taps)
            going_on = (~done[live]).nonzero().squeeze(1)
            cache.batch_select_indices(going_on)
            generator.rings.batch_select_indices(going_on)
            live, draft, draft_logits, confident = (t[going_on] for t in (live, draft, draft_logits, confident))
        lengths, live_done = rows.lengths[live], done[live]
        # each row keeps at most what it is still to decode after the main model's own next token
        limit = torch.minimum(confident, rows.max_length - lengths - 1).clamp_min(0).masked_fill(live_done, 0)
        length = block if fixed_shape else int(limit.max())
        draft, draft_logits = draft[:, :length], draft_logits[:, :length]
        outputs = model_forward(
            input_ids=torch.cat([rows.last_tokens()[live].unsqueeze(1), draft], dim=1),
            cache=cache,
            output_dspark_hidden_states=True,
            return_dict=True,
        )
        candidates = _with_columns(rows.sequences, rows.lengths, _scatter_rows(draft, live, rows.lengths.shape[0]))
        target = process_rows(logits_processor, candidates, rows.lengths, outputs.logits, live)
        if length == 0:
            tokens, accepted = _choose(target[:, 0], do_sample).unsqueeze(1), torch.zeros_like(limit)
        else:
            tokens, accepted = (
                accept(draft, draft_logits, target, limit) if do_sample else accept(draft, target, limit)
            )
        kept = (accepted + 1).masked_fill(live_done, 0)
        cache.crop_rows(length + 1 - kept)
        rows.append(_scatter_rows(tokens, live, len(done)), _scatter_rows(kept, live, len(done)))
        done = rows.done()
    if streamer is not None:
        streamer.end()
    sequences = rows.sequences[:, : rows.output_length()]
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences, past_key_values=cache)
    return sequences


__all__ = ["DeepseekV41DSparkCandidateGenerator", "accept_greedy", "accept_sampled", "dspark_decoding"]
