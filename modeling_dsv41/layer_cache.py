"""Decode state of each attention layer, and where one forward call's tokens sit in it.

A CSA2 layer (:mod:`.attention`) needs far less than every past K=V vector:

* every layer: the window K=V of the last ``sliding_window`` tokens (a fixed size);
* each KV source (``kv_source_layer_ids``): its compressed K=V, one row per ``r`` tokens, plus for ``r > 1`` the
  fp32 ``wkv``/``wgate`` projections of the group still filling up, so the group pools exactly as in a full
  pass once its last token arrives;
* each key owner (KV sources with an indexer): its index keys, one row per compressed row. Every index source
  scores against the complete keys of its owner, whichever layer emitted a latent in this step.

Top-k selections and candidate blocks depend on the new queries only, so they are recomputed in each step and
handed to consumer layers through that step's :class:`~.attention.CompressedContext`; nothing of them is kept.

Rows count positions from their own first real token (a left-padded prompt is aligned to start at 0), so rows
of one batch sit at different positions and complete their compression groups at different steps: compressed rows
are stored left-aligned per batch row. :class:`DeepseekV41StaticLayerCache` holds the same state in buffers sized
once and updated in place. The transformers ``Cache`` that holds one of these per layer (and each row's length, and
Engram's history) is :class:`~.generation.cache.DeepseekV41Cache`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class CacheStep:
    """Where the tokens of one forward call sit in each row of a :class:`~.generation.cache.DeepseekV41Cache`.

    past [B]: real tokens each row had cached before this call. lengths [B]: real tokens after it.
    positions [B, S]: position of each token of the call in its row (rows aligned to start at 0).
    columns: input columns consumed after this call (known on the host): no row holds more tokens.
    prefill: the cache was empty, so the layers run the full-sequence path and record its state.
    compress_rotary: rotations of compressed layers at given positions (a latent sits at its group's first
    token, which may belong to an earlier call).
    """

    past: torch.Tensor
    lengths: torch.Tensor
    positions: torch.Tensor
    columns: int
    prefill: bool
    compress_rotary: Callable[[torch.Tensor], torch.Tensor]
    window_slots: torch.Tensor | None = None  # [B, S, W] after the prefill: :func:`decode_window_slots`


def decode_window_slots(past: torch.Tensor, seq_len: int, window: int) -> torch.Tensor:
    """[B, S, W] indices into the window keys that :meth:`DeepseekV41LayerCache.extend_window` returns (positions
    ``past - W`` … ``past + S - 1`` of each row): query s (at position past + s) reads the W positions ending at its
    own, oldest first, -1 before the row's first token (the reference's ring order, empty slots first). The same in
    every layer, so built once per step."""
    query = torch.arange(seq_len, device=past.device).view(1, -1, 1)
    offset = torch.arange(window, device=past.device)
    position = past.view(-1, 1, 1) + query - window + 1 + offset
    return (query + 1 + offset).masked_fill(position < 0, -1)


def gather_rows(t: torch.Tensor, index: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
    """``t[b, index[b, i]]`` for t [B, S, ...] and index [B, N], with ``fill`` where the index is out of range."""
    valid = (index >= 0) & (index < t.shape[1])
    index = index.clamp(0, max(t.shape[1] - 1, 0))
    out = t.gather(1, index.view(*index.shape, *([1] * (t.ndim - 2))).expand(-1, -1, *t.shape[2:]))
    return out.masked_fill(~valid.view(*valid.shape, *([1] * (t.ndim - 2))), fill)


def last_columns(t: torch.Tensor, width: int) -> torch.Tensor:
    """The newest ``width`` columns of t [B, T, ...], left-padded with zeros when T is shorter."""
    kept = t[:, max(t.shape[1] - width, 0) :]
    return F.pad(kept, (0, 0) * (t.ndim - 2) + (width - kept.shape[1], 0))


def shift_right(t: torch.Tensor, shifts: torch.Tensor, width: int, fill: float | int = 0) -> torch.Tensor:
    """t [B, T, ...] → [B, width, ...] whose row b is t's row b moved ``shifts[b]`` columns to the right (its
    newest ones out, ``fill`` in front; negative shifts move left): a per-row rollback of right-aligned state."""
    index = torch.arange(width, device=t.device) - shifts.unsqueeze(1) + (t.shape[1] - width)
    return gather_rows(t, index, fill)


def count_for_message(tokens: torch.Tensor) -> int | list[int]:
    """Tokens a crop removes, for messages: one count, or one per row where they differ."""
    counts = tokens.tolist()
    return counts[0] if len(set(counts)) == 1 else counts


def write_rows(
    buffer: torch.Tensor, counts: torch.Tensor, new: torch.Tensor, new_counts: torch.Tensor, spare: int
) -> None:
    """In place: ``new[b, :new_counts[b]]`` into ``buffer[b, counts[b]:]`` [B, T, ...], and the rows of ``new`` a row
    does not keep into column ``spare`` (a fixed-shape write, with no count read back)."""
    column = torch.arange(new.shape[1], device=new.device)
    rows = torch.where(column < new_counts.unsqueeze(1), counts.unsqueeze(1) + column, spare)  # [B, n]
    buffer.scatter_(1, rows.view(*rows.shape, *([1] * (new.ndim - 2))).expand_as(new), new.to(buffer.dtype))


def append_rows(
    buffer: torch.Tensor | None, counts: torch.Tensor, new: torch.Tensor, new_counts: torch.Tensor, width: int
) -> torch.Tensor:
    """Write ``new[b, :new_counts[b]]`` after the ``counts[b]`` rows row b already holds in ``buffer`` [B, T, ...].

    Returns a new tensor ``width`` rows wide (or T if wider): ``width``, known on the host, bounds every row's
    ``counts + new_counts``, so that the shape needs no count read back. Out of place, so that gradients and earlier
    outputs stay valid."""
    bsz = new.shape[0]
    if buffer is None:
        buffer = new.new_zeros(bsz, 0, *new.shape[2:])
    width = max(width, buffer.shape[1])
    grown = torch.cat([buffer, buffer.new_zeros(bsz, width + 1 - buffer.shape[1], *buffer.shape[2:])], dim=1)
    write_rows(grown, counts, new, new_counts, spare=width)
    return grown[:, :width]


class DeepseekV41LayerCache:
    """Decode state of one attention layer, every tensor batch-first.

    window_kv [B, W, D]: K=V of each row's last W tokens, newest last (zeros before a row's first token); while
    past recording is on (assisted decoding, see :meth:`rewind`), every token's since the prefill too.
    compressed_kv [B, T, D] (KV sources): rotated compressed K=V, row b valid in ``[: lengths[b] // r]``.
    index_keys [B, T, Di] (key owners): the indexer keys of those rows.
    pending_kv / pending_score [B, r, D] fp32 (KV sources with r > 1): projections of the open group's tokens,
    slot ``i`` holding the token at ``position % r == i``.
    projections_kv / projections_score [B, P, D] fp32 (KV sources with r > 1, while recording): the projections of
    each row's last P tokens, newest last, from which a rewind rebuilds the open group.
    """

    is_compileable = False
    is_sliding = True
    supports_early_init = False
    _STATE = (
        "window_kv",
        "compressed_kv",
        "index_keys",
        "pending_kv",
        "pending_score",
        "projections_kv",
        "projections_score",
    )

    def __init__(self, window: int, ratio: int):
        self.window, self.ratio = window, ratio
        self.record_past = False
        self.max_rewind: int | None = None  # while recording: None keeps every token's state, else enough for this
        self.projections_kv: torch.Tensor | None = None
        self.projections_score: torch.Tensor | None = None
        self.window_kv: torch.Tensor | None = None
        self.compressed_kv: torch.Tensor | None = None
        self.index_keys: torch.Tensor | None = None
        self.pending_kv: torch.Tensor | None = None
        self.pending_score: torch.Tensor | None = None

    def __repr__(self) -> str:
        held = {name: tuple(getattr(self, name).shape) for name in self._STATE if getattr(self, name) is not None}
        return f"{type(self).__name__}(ratio={self.ratio}, {held})"

    # ---- writes ---------------------------------------------------------------------------------------
    def store_window(self, kv: torch.Tensor, lengths: torch.Tensor) -> None:
        """After a full pass over kv [B, S, D] holding ``lengths[b]`` real tokens per row: keep each row's last W
        (all of them while recording the past)."""
        width = max(self.window, self._window_width(kv.shape[1]))
        index = lengths.unsqueeze(1) - width + torch.arange(width, device=kv.device)
        self._write("window_kv", gather_rows(kv, index))

    def extend_window(self, kv: torch.Tensor) -> torch.Tensor:
        """Append the call's K=V [B, S, D] (all real tokens); returns the keys they may attend to [B, W + S, D]
        (positions ``past - W`` … ``past + S - 1`` of each row) and keeps the last W."""
        keys = torch.cat([self.window_kv, kv], dim=1)
        self._write("window_kv", last_columns(keys, self._window_width(keys.shape[1])))
        return keys[:, -(self.window + kv.shape[1]) :]

    def append_compressed(
        self,
        compressed_kv: torch.Tensor,
        index_keys: torch.Tensor | None,
        counts: torch.Tensor,
        new_counts: torch.Tensor,
        columns: int,
    ) -> None:
        """Add ``new_counts[b]`` compressed rows (and their index keys) after the ``counts[b]`` row b holds; after
        them no row has more than ``columns`` tokens (:attr:`CacheStep.columns`)."""
        rows = columns // self.ratio
        self._append("compressed_kv", counts, compressed_kv, new_counts, rows)
        if index_keys is not None:
            self._append("index_keys", counts, index_keys, new_counts, rows)

    def store_pending(self, kv: torch.Tensor, score: torch.Tensor) -> None:
        """The open group's fp32 projections [B, r, D] after a full pass."""
        self._write("pending_kv", kv)
        self._write("pending_score", score)

    def complete_groups(
        self, kv: torch.Tensor, score: torch.Tensor, past: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prepend each row's open group to the call's projections kv, score [B, S, D] (fp32).

        Returns the groups now complete, kv and score [B, G, r, D] (row b's first ``complete[b]`` are real), and
        ``complete`` [B]; the new open group becomes the pending state.
        """
        r, seq_len = self.ratio, kv.shape[1]
        if self.record_past:
            self._record_projections(kv, score, past)
        held = (past % r).unsqueeze(1)  # [B, 1] tokens of the open group seen in earlier calls
        n_groups = (r - 1 + seq_len) // r
        # offset i of the group-aligned sequence (open group first) reads slot i of the pending state while
        # i < held, and new token i - held after it
        offsets = torch.arange((n_groups + 1) * r, device=kv.device)
        source = torch.where(offsets < held, offsets, r + offsets - held).clamp_max(r + seq_len - 1)
        aligned_kv = torch.cat([self.pending_kv, kv], dim=1).gather(
            1, source.unsqueeze(-1).expand(-1, -1, kv.shape[-1])
        )
        aligned_score = torch.cat([self.pending_score, score], dim=1).gather(
            1, source.unsqueeze(-1).expand(-1, -1, score.shape[-1])
        )
        complete = (held.squeeze(1) + seq_len) // r
        tail = complete.unsqueeze(1) * r + torch.arange(r, device=kv.device)  # the open group after this call
        self._write("pending_kv", gather_rows(aligned_kv, tail))
        self._write("pending_score", gather_rows(aligned_score, tail))
        groups = n_groups * r
        return (
            aligned_kv[:, :groups].unflatten(1, (n_groups, r)),
            aligned_score[:, :groups].unflatten(1, (n_groups, r)),
            complete,
        )

    # ---- rewinding (assisted decoding) ------------------------------------------------------------------
    @property
    def is_croppable(self) -> bool:
        return self.record_past

    def activate_past_recording(self, max_rewind: int | None = None) -> None:
        """Keep what a :meth:`rewind` needs from now on: every window K=V and open-group projection, or with
        ``max_rewind`` M those of the last W + M and r + M tokens (a rewind of at most M tokens)."""
        self.record_past, self.max_rewind = True, max_rewind

    def _window_width(self, available: int) -> int:
        """Window columns kept of ``available``: W; while recording, all of them or at most W + ``max_rewind``."""
        if not self.record_past:
            return self.window
        return available if self.max_rewind is None else min(available, self.window + self.max_rewind)

    def _projection_width(self, available: int) -> int:
        """Recorded projection columns kept of ``available`` (only while recording): all, or at most r + M."""
        return available if self.max_rewind is None else min(available, self.ratio + self.max_rewind)

    def record_prefill_projections(self, kv: torch.Tensor, score: torch.Tensor, lengths: torch.Tensor) -> None:
        """While recording: the projections [B, S, D] of a full pass's tokens, ``lengths[b]`` real in row b."""
        width = self._projection_width(kv.shape[1])
        index = lengths.unsqueeze(1) - width + torch.arange(width, device=kv.device)
        self._write("projections_kv", gather_rows(kv, index))
        self._write("projections_score", gather_rows(score, index))

    def _record_projections(self, kv: torch.Tensor, score: torch.Tensor, past: torch.Tensor) -> None:
        """Append the call's projections [B, S, D] to the recorded ones, the first time after the pending open
        group's (``past % r`` real slots of row b), right-aligned so that each row's newest token is last."""
        recorded_kv, recorded_score = self.projections_kv, self.projections_score
        if recorded_kv is None:
            r = self.ratio
            slots = (past % r - r).unsqueeze(1) + torch.arange(r, device=kv.device)  # -1… for slots before the group
            recorded_kv, recorded_score = gather_rows(self.pending_kv, slots), gather_rows(self.pending_score, slots)
        for name, recorded, new in (("projections_kv", recorded_kv, kv), ("projections_score", recorded_score, score)):
            sequence = torch.cat([recorded, new], dim=1)
            self._write(name, last_columns(sequence, self._projection_width(sequence.shape[1])))

    def rewind(self, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        """Forget the newest ``tokens[b]`` tokens of each row b (rows of a speculative batch keep different
        numbers), leaving ``lengths`` [B] real tokens per row: the state as it was after the earlier of them, from
        what was recorded."""
        if not self.record_past:
            raise ValueError("a DeepSeek-V4.1 cache can be cropped only after activate_past_recording()")
        self._check_rewind(tokens, lengths)
        # a window shorter than W after the rewind only lacks positions before the rows' first tokens: zeros
        self._write("window_kv", self._without_newest(self.window_kv, tokens, self.window))
        self._forget_compressed(lengths)
        if self.pending_kv is not None:
            r = self.ratio
            recorded = 0 if self.projections_kv is None else self.projections_kv.shape[1]
            held = lengths % r  # [B] tokens of the open group after the rewind; slot i at column:
            column = (recorded - tokens - held).unsqueeze(1) + torch.arange(r, device=lengths.device)
            if bool(((column[:, 0] < 0) & (held > 0)).any()):
                raise ValueError(f"cannot rewind {count_for_message(tokens)} tokens: not enough of them were recorded")
            if self.projections_kv is not None:  # else no row has an open group left: the pending slots go unread
                column = column.masked_fill(torch.arange(r, device=lengths.device) >= held.unsqueeze(1), -1)
                self._write("pending_kv", gather_rows(self.projections_kv, column))
                self._write("pending_score", gather_rows(self.projections_score, column))
                self._write("projections_kv", self._without_newest(self.projections_kv, tokens, 0))
                self._write("projections_score", self._without_newest(self.projections_score, tokens, 0))

    def _check_rewind(self, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        # each row keeps the window of its own last min(W, length) tokens
        short = self.window_kv.shape[1] - tokens < lengths.clamp_max(self.window)
        if bool(short.any()):
            recorded = self.window_kv.shape[1] - self.window
            raise ValueError(f"cannot rewind {count_for_message(tokens)} tokens: only {recorded} were recorded")

    def _without_newest(self, value: torch.Tensor, tokens: torch.Tensor, min_width: int) -> torch.Tensor:
        """``value`` [B, T, ...] (each row's newest column last) without each row's newest ``tokens[b]`` columns:
        every row shifted right by its own count, as wide as the row keeping most (at least ``min_width``), zeros
        in front."""
        width = max(value.shape[1] - int(tokens.min()), min_width)
        return shift_right(value, tokens, width)

    def _forget_compressed(self, lengths: torch.Tensor) -> None:
        """Drop the compressed rows past each row's ``lengths // r`` (as wide as a cache that never held them)."""
        if self.compressed_kv is not None:
            rows = int((lengths // self.ratio).max())
            self.compressed_kv = self.compressed_kv[:, :rows]
            self.index_keys = None if self.index_keys is None else self.index_keys[:, :rows]

    def _write(self, name: str, value: torch.Tensor) -> None:
        """Replace one piece of state (out of place: earlier outputs that alias it stay valid)."""
        setattr(self, name, value)

    def _append(self, name: str, counts: torch.Tensor, new: torch.Tensor, new_counts: torch.Tensor, rows: int) -> None:
        setattr(self, name, append_rows(getattr(self, name), counts, new, new_counts, rows))

    # ---- batch bookkeeping (beam search, num_return_sequences) ----------------------------------------------
    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in self._STATE:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, fn(value))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        for name in self._STATE:
            setattr(self, name, None)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("crop the whole DeepseekV41Cache: a layer's rewind needs each row's length")

    def nbytes(self) -> dict[str, int]:
        """Bytes held per kind of state."""
        return {
            name: getattr(self, name).numel() * getattr(self, name).element_size()
            for name in self._STATE
            if getattr(self, name) is not None
        }


def static_buffer(value: torch.Tensor) -> torch.Tensor:
    """A private copy of ``value`` that later steps update in place, marked as a static input of compiled code
    (so that a CUDA graph reads it where it is instead of copying it in)."""
    value = value.clone(memory_format=torch.contiguous_format)
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(value)
    return value


class DeepseekV41StaticLayerCache(DeepseekV41LayerCache):
    """:class:`DeepseekV41LayerCache` in fixed-size buffers, allocated by the prefill and then updated in place, so
    that a decode step has static shapes and addresses (``torch.compile``, CUDA graphs).

    compressed_kv / index_keys [B, max_cache_len // r + 1, ...]: rows ``[: lengths[b] // r]`` of row b are valid;
    the last row takes the writes of groups a step leaves incomplete (a fixed-shape write needs somewhere to put
    them) and, like every row past a query's compressed length, is never attended to.

    Past recording (:meth:`activate_past_recording` with ``max_rewind`` M) is bounded, in fixed shapes too: the
    window keeps W + M columns, the projections the last r + M tokens. A rewind of t ≤ M tokens shifts them right by
    t (the newest t out, zeros in front) and rebuilds the open group from the projections; compressed rows need no
    undoing: those past a row's new ``lengths // r`` are never attended (each query sees the rows before its own
    position's group), and the groups that complete again write them anew.
    :class:`~.generation.cache.DeepseekV41StaticCache` checks that no rewind reaches past what was kept.
    """

    is_compileable = True

    def __init__(self, window: int, ratio: int, max_cache_len: int):
        super().__init__(window, ratio)
        self.max_rows = max_cache_len // ratio if ratio else 0

    def _window_width(self, available: int) -> int:
        return self.window + self.max_rewind if self.record_past else self.window

    def _projection_width(self, available: int) -> int:
        return self.ratio + self.max_rewind

    def _check_rewind(self, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        pass  # the cache counts what its fixed buffers can still undo (DeepseekV41Cache.rewindable)

    def _without_newest(self, value: torch.Tensor, tokens: torch.Tensor, min_width: int) -> torch.Tensor:
        return shift_right(value, tokens, value.shape[1])  # fixed width: each row shifted right in place

    def _forget_compressed(self, lengths: torch.Tensor) -> None:
        pass  # rows past each row's length are never attended (see the class docstring)

    def _write(self, name: str, value: torch.Tensor) -> None:
        held = getattr(self, name)
        if held is None or held.shape != value.shape or held.dtype != value.dtype:
            setattr(self, name, static_buffer(value))
        else:
            held.copy_(value)

    def _append(self, name: str, counts: torch.Tensor, new: torch.Tensor, new_counts: torch.Tensor, rows: int) -> None:
        held = getattr(self, name)
        if held is None or held.shape[0] != new.shape[0] or held.dtype != new.dtype:
            held = static_buffer(new.new_zeros(new.shape[0], self.max_rows + 1, *new.shape[2:]))
            setattr(self, name, held)
        write_rows(held, counts, new, new_counts, spare=self.max_rows)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in self._STATE:
            value = getattr(self, name)
            if value is not None:
                self._write(name, fn(value))

    def reset(self) -> None:
        """Zeros in place: the buffers (and a compiled step's view of them) stay."""
        self._map(torch.zeros_like)


__all__ = [
    "CacheStep",
    "DeepseekV41LayerCache",
    "DeepseekV41StaticLayerCache",
    "decode_window_slots",
]
