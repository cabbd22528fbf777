"""Decode cache of DeepSeek-V4.1: everything incremental decoding needs, per layer and per batch row.

A CSA2 layer needs far less than every past K=V vector:

* every layer: the window K=V of the last ``sliding_window`` tokens (a fixed size);
* each KV source (``kv_source_layer_ids``): its compressed K=V, one row per ``r`` tokens, plus for ``r > 1`` the
  fp32 ``wkv``/``wgate`` projections of the group still filling up, so the group pools exactly as in a full
  pass once its last token arrives;
* each key owner (KV sources with an indexer): its index keys, one row per compressed row. Every index source
  scores against the complete keys of its owner, whichever layer emitted a latent in this step;
* Engram: the last ``max_ngram - 1`` compressed token ids of each row.

Top-k selections and candidate blocks depend on the new queries only, so they are recomputed in each step and
handed to consumer layers through that step's :class:`~.attention.CompressedContext`; nothing of them is kept.

:class:`DeepseekV41StaticCache` holds the same state in buffers sized once (for ``max_cache_len`` columns) and
updated in place, for ``generate(cache_implementation="static")`` and compiled decode steps. Both roll back over
their last tokens once ``activate_past_recording()`` has made them keep what a rollback needs (any number of tokens,
or up to a ``max_rewind`` given there: the static cache needs it for its fixed buffers, and DSpark gives it, so
that the dynamic cache keeps a fixed amount rather than every token since): all rows alike
(``crop``: transformers' assisted generation), or each row by its own count (``crop_rows``: DSpark speculative
decoding, whose rows keep different numbers of drafted tokens).

Rows count positions from their own first real token (a left-padded prompt is aligned to start at 0), so rows
of one batch sit at different positions and complete their compression groups at different steps:
``lengths`` holds each row's count of real tokens, and compressed rows are stored left-aligned per batch row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from ..engram import DEAD


@dataclass
class CacheStep:
    """Where the tokens of one forward call sit in each row of a :class:`DeepseekV41Cache`.

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


def _count(tokens: torch.Tensor) -> int | list[int]:
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
                raise ValueError(f"cannot rewind {_count(tokens)} tokens: not enough of them were recorded")
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
            raise ValueError(f"cannot rewind {_count(tokens)} tokens: only {recorded} were recorded")

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


class DeepseekV41Cache(Cache):
    """The decode cache of :class:`~.modeling_dsv41.DeepseekV41ForCausalLM`: one :class:`DeepseekV41LayerCache` per
    layer, each row's real-token count, and Engram's n-gram history.

    Memory: the window part is fixed (``num_layers × W × head_dim`` per row); compressed K=V and index keys grow by
    one row every ``r`` tokens for each KV source; the pending groups and the Engram history are constant.

    ``get_seq_length()`` counts the input columns consumed so far, prompt padding included (what ``generate``
    slices the next inputs by); ``lengths`` counts each row's real tokens. ``reorder_cache`` (beam search) and
    batch repeat/select are supported, and so are ``crop`` (assisted generation) and ``crop_rows`` (per row) of
    tokens decoded after ``activate_past_recording()``: while recording, the cache also keeps every window K=V,
    open-group projection and Engram id since then (memory growing with the decoded tokens, as a per-token cache
    does), or with a ``max_rewind`` M the last M more of each. After ``crop_rows`` the rows hold different column
    counts: ``get_seq_length()`` is the longest row's.
    """

    def __init__(self, config):
        text = config.get_text_config()
        super().__init__(
            layers=[DeepseekV41LayerCache(text.sliding_window, spec.compress_ratio) for spec in text.layer_plan]
        )
        self.seen_tokens = 0
        self.lengths: torch.Tensor | None = None  # [B] real tokens per row
        self.engram_history: torch.Tensor | None = None  # [B, max_ngram - 1] compressed ids, DEAD where none
        self.behind: torch.Tensor | None = None  # [B] columns each row holds fewer than the longest (crop_rows)
        self.record_past = False
        self.max_rewind: int | None = None  # tokens a crop may remove while recording (None: any number)
        self._undoable: tuple[int, int] = (0, 0)  # (tokens undoable, at this column count): see rewindable

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def activate_past_recording(
        self, max_rewind: int | None = None, recurrent_states_to_keep: int | None = None
    ) -> None:
        """Make :meth:`crop` possible from now on: of any number of tokens (the cache then keeps every token's
        state since), or with ``max_rewind`` of at most that many at a time (DSpark: a draft block and its first
        token), keeping a fixed amount (the window's and open groups' last ``max_rewind`` tokens more).

        ``recurrent_states_to_keep`` is what transformers' assisted decoding passes: the draft length when the
        recording starts, which its candidate generators may raise later (the "heuristic" schedule adds 2 after a
        fully accepted draft). It does not bound a crop, so this cache then records any number of tokens."""
        del recurrent_states_to_keep  # a linear-attention state count; no bound on this cache's rollbacks (above)
        if max_rewind is not None and max_rewind < 1:
            raise ValueError(f"max_rewind must be a positive number of tokens, got {max_rewind}")
        for layer in self.layers:
            layer.activate_past_recording(max_rewind)
        self.record_past, self.max_rewind = True, max_rewind
        self._undoable = (0, self.get_seq_length())

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` columns (transformers' convention: a negative count), decoded since
        :meth:`activate_past_recording`. ``crop(0)`` keeps everything."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes minus the number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0:
            return
        if -tokens_to_remove > self.get_seq_length():
            raise ValueError(f"cannot remove {-tokens_to_remove} tokens from a cache holding {self.get_seq_length()}")
        self.crop_rows(torch.full_like(self.lengths, -tokens_to_remove))

    def crop_rows(self, tokens: torch.Tensor) -> None:
        """Forget the newest ``tokens[b]`` tokens of each row b (a [B] tensor, ≥ 0), decoded since
        :meth:`activate_past_recording`: speculative decoding keeps a different number of each row's drafted tokens,
        so that rows advance by their own accepted lengths. ``get_seq_length()`` then counts the columns of the row
        holding most."""
        if not self.record_past:
            raise ValueError("a DeepSeek-V4.1 cache can be cropped only after activate_past_recording()")
        tokens = tokens.to(self.lengths.device)
        lengths = self.lengths - tokens
        if bool(((tokens < 0) | (lengths < 0)).any()):
            raise ValueError(
                f"cannot remove {_count(tokens)} tokens from rows holding {self.lengths.tolist()} real tokens"
            )
        most, rewindable = int(tokens.max()), self.rewindable
        if most > rewindable:  # (without a max_rewind, each layer says what it did not record)
            raise ValueError(
                f"cannot remove {most} tokens: the cache can undo only its newest {rewindable} now "
                f"(activate_past_recording(max_rewind={self.max_rewind}))"
            )
        for layer in self.layers:
            layer.rewind(tokens, lengths)
        if self.engram_history is not None:
            self._rewind_engram_history(tokens)
        self._store("lengths", lengths)
        behind = tokens if self.behind is None else self.behind + tokens
        caught_up = int(behind.min())  # columns the longest row lost
        self.behind = behind - caught_up
        self._count_columns(-caught_up)
        if self.max_rewind is not None:
            self._undoable = (rewindable - most, self.get_seq_length())  # what every row can still undo

    @property
    def rewindable(self) -> int:
        """The tokens every row can undo now: with a ``max_rewind``, that at most, less what crops took, plus the
        columns forwarded since (counted from the column count, so that a forward, compiled, updates no Python
        state); without, any number (each layer refuses what it did not record)."""
        if self.max_rewind is None:
            return self.get_seq_length()
        undoable, at = self._undoable
        return min(self.max_rewind, undoable + self.get_seq_length() - at)

    def _rewind_engram_history(self, tokens: torch.Tensor) -> None:
        history = self.engram_history
        if int(tokens.max()) >= history.shape[1]:
            raise ValueError(f"cannot rewind {_count(tokens)} tokens: not enough Engram ids were recorded")
        width = history.shape[1] - int(tokens.min())
        self.engram_history = shift_right(history, tokens, width, DEAD)

    def _count_columns(self, columns: int) -> None:
        """Add ``columns`` (negative: remove them) to the input columns consumed."""
        self.seen_tokens += columns

    def engram_past(self, size: int) -> torch.Tensor | None:
        """The ``size`` compressed ids before the next call's tokens [B, size] (None before the prefill)."""
        return None if self.engram_history is None else self.engram_history[:, -size:]

    @property
    def is_empty(self) -> bool:
        """Nothing recorded yet: the next forward is the prefill."""
        return self.seen_tokens == 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def window(self) -> int:
        """The sliding window W (every layer's)."""
        return self.layers[0].window

    @property
    def batch_size(self) -> int:
        return -1 if self.lengths is None else self.lengths.shape[0]

    def step(self, new_tokens: torch.Tensor, seq_len: int, compress_rotary: Callable) -> CacheStep:
        """Describe a forward call adding ``new_tokens[b]`` real tokens to row b (``seq_len`` columns)."""
        device = new_tokens.device
        prefill = self.is_empty
        if prefill:
            past = torch.zeros_like(new_tokens)
        else:
            past = self.lengths
            if past.shape[0] != new_tokens.shape[0]:
                raise ValueError(f"the cache holds {past.shape[0]} rows but the inputs have {new_tokens.shape[0]}")
        positions = past.unsqueeze(1) + torch.arange(seq_len, device=device)
        window_slots = None if prefill else decode_window_slots(past, seq_len, self.window)
        return CacheStep(
            past, past + new_tokens, positions, self._columns_after(seq_len), prefill, compress_rotary, window_slots
        )

    def _columns_after(self, seq_len: int) -> int:
        """Input columns consumed after a call of ``seq_len`` (the longest row's, after :meth:`crop_rows`)."""
        return self.seen_tokens + seq_len

    def finish_step(self, step: CacheStep, seq_len: int) -> None:
        self._store("lengths", step.lengths)
        self._count_columns(seq_len)

    def _store(self, name: str, value: torch.Tensor) -> None:
        """Replace one piece of per-row state (``lengths``, ``engram_history``)."""
        setattr(self, name, value)

    def update_engram_history(self, compressed: torch.Tensor, new_tokens: torch.Tensor, size: int) -> None:
        """Keep each row's last ``size`` compressed ids; its ``new_tokens[b]`` real ones lead ``compressed`` [B, S]."""
        past = self.engram_history
        if past is None:
            past = compressed.new_full((compressed.shape[0], size), DEAD)
        sequence = torch.cat([past, compressed], dim=1)
        keep = self._engram_width(size, sequence.shape[1])
        # row b's newest id sits at past width + new_tokens[b] - 1 (compressed is left-aligned): keep the last `keep`
        start = new_tokens + past.shape[1] - keep
        self._store(
            "engram_history",
            gather_rows(sequence, start.unsqueeze(1) + torch.arange(keep, device=compressed.device), DEAD),
        )

    def _engram_width(self, size: int, available: int) -> int:
        """Compressed ids kept of ``available``: the ``size`` the next call reads; while recording, every one or at
        most ``max_rewind`` more."""
        if not self.record_past:
            return size
        return available if self.max_rewind is None else min(available, size + self.max_rewind)

    def _map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in ("lengths", "engram_history"):
            if getattr(self, name) is not None:
                self._store(name, fn(getattr(self, name)))
        if self.behind is not None:
            self.behind = fn(self.behind)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_rows(lambda t: t[indices])
        if self.behind is not None and self.behind.numel():  # the longest row kept holds every column counted
            caught_up = int(self.behind.min())
            self.behind = self.behind - caught_up
            self._count_columns(-caught_up)
            undoable, at = self._undoable
            self._undoable = (undoable, at - caught_up)  # the rows kept can undo what they could

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        super().reset()
        self.seen_tokens, self.lengths, self.engram_history, self.behind = 0, None, None, None
        self._undoable = (0, 0)

    def nbytes(self) -> dict[str, int]:
        """Bytes held, summed over layers per kind of state (``window_kv``, ``compressed_kv``, …, ``engram``)."""
        total: dict[str, int] = {}
        for layer in self.layers:
            for name, size in layer.nbytes().items():
                total[name] = total.get(name, 0) + size
        for name, value in (("lengths", self.lengths), ("engram_history", self.engram_history)):
            if value is not None:
                total[name] = value.numel() * value.element_size()
        return total


def _static_buffer(value: torch.Tensor) -> torch.Tensor:
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
    position's group), and the groups that complete again write them anew. :class:`DeepseekV41StaticCache` checks
    that no rewind reaches past what was kept.
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
            setattr(self, name, _static_buffer(value))
        else:
            held.copy_(value)

    def _append(self, name: str, counts: torch.Tensor, new: torch.Tensor, new_counts: torch.Tensor, rows: int) -> None:
        held = getattr(self, name)
        if held is None or held.shape[0] != new.shape[0] or held.dtype != new.dtype:
            held = _static_buffer(new.new_zeros(new.shape[0], self.max_rows + 1, *new.shape[2:]))
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


class DeepseekV41StaticCache(DeepseekV41Cache):
    """The decode cache for ``generate(..., cache_implementation="static")`` and compiled decoding: as
    :class:`DeepseekV41Cache`, for sequences of at most ``max_cache_len`` columns (prompt padding included), with every
    buffer sized by the prefill and updated in place, so that every decode step runs the same shapes on the same
    memory (one ``torch.compile`` graph, capturable as a CUDA graph).

    The column count is a tensor (a Python int would be a new constant to compile at every step). Eager steps also
    count it on the host, so that ``get_seq_length()`` (which ``generate`` and the overflow check ask for) reads
    nothing back; after a compiled step it reads the tensor.
    """

    def __init__(self, config, max_cache_len: int, **kwargs):
        text = config.get_text_config()
        Cache.__init__(
            self,
            layers=[
                DeepseekV41StaticLayerCache(text.sliding_window, spec.compress_ratio, max_cache_len)
                for spec in text.layer_plan
            ],
        )
        self.max_cache_len = max_cache_len
        self.record_past = False
        self.max_rewind: int | None = None  # tokens a crop may remove while recording (see activate_past_recording)
        self._undoable: tuple[int, int] = (0, 0)  # (tokens undoable, at this column count): see rewindable
        self.seen: torch.Tensor | None = None  # 0-d long: columns consumed
        self._seen_on_host: int | None = 0  # the same while only eager steps counted it (None: read ``seen``)
        self.behind: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None
        self.engram_history: torch.Tensor | None = None
        self._empty = True

    def activate_past_recording(
        self, max_rewind: int | None = None, recurrent_states_to_keep: int | None = None
    ) -> None:
        """Make :meth:`crop` able to remove up to ``max_rewind`` of the newest tokens (DSpark: the draft block size)
        at any point: the buffers then keep ``max_rewind`` more window columns, open-group projections and Engram
        ids. Without ``max_rewind`` (transformers' assisted generation, which passes ``recurrent_states_to_keep``: a
        draft length its schedule may raise later), a crop of any length is kept possible: ``max_cache_len`` more
        columns, the memory of a per-token cache."""
        del recurrent_states_to_keep  # not a bound on a crop (see DeepseekV41Cache.activate_past_recording)
        if max_rewind is not None and max_rewind < 1:
            raise ValueError(f"max_rewind must be a positive number of tokens, got {max_rewind}")
        if not self._empty:
            raise ValueError("activate the static cache's past recording before the prefill (it sizes the buffers)")
        super().activate_past_recording(max_rewind or self.max_cache_len)

    def _rewind_engram_history(self, tokens: torch.Tensor) -> None:
        self._store("engram_history", shift_right(self.engram_history, tokens, self.engram_history.shape[1], DEAD))

    def _engram_width(self, size: int, available: int) -> int:
        return size + self.max_rewind if self.record_past else size

    def _count_columns(self, columns: int) -> None:
        self.seen.add_(columns)
        self._count_on_host(columns)

    def _count_on_host(self, columns: int) -> None:
        """Keep the host's count, or give it up inside a compiled graph (whose Python runs only while tracing)."""
        if torch.compiler.is_compiling() or self._seen_on_host is None:
            self._seen_on_host = None
        else:
            self._seen_on_host += columns

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self._empty:
            return 0
        return int(self.seen) if self._seen_on_host is None else self._seen_on_host

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_cache_len

    @property
    def is_empty(self) -> bool:
        return self._empty

    def step(self, new_tokens: torch.Tensor, seq_len: int, compress_rotary: Callable) -> CacheStep:
        if not torch.compiler.is_compiling() and self.get_seq_length() + seq_len > self.max_cache_len:
            raise ValueError(
                f"the static cache holds {self.max_cache_len} positions; {self.get_seq_length()} are used and "
                f"{seq_len} more were passed (size it with max_cache_len)"
            )
        return super().step(new_tokens, seq_len, compress_rotary)

    def _columns_after(self, seq_len: int) -> int:
        return self.max_cache_len  # a bound without reading the column count back; the buffers are this wide

    def finish_step(self, step: CacheStep, seq_len: int) -> None:
        self._store("lengths", step.lengths)
        if self._empty:
            self.seen = _static_buffer(torch.tensor(seq_len, device=step.lengths.device))
            self._seen_on_host = 0
            self._count_on_host(seq_len)
            self._undoable = (
                self.max_rewind,
                seq_len,
            )  # the prefill keeps each row's last tokens (zeros before its first)
        else:
            self._count_columns(seq_len)
        self._empty = False

    def _store(self, name: str, value: torch.Tensor) -> None:
        held = getattr(self, name)
        if held is None or held.shape != value.shape:
            setattr(self, name, _static_buffer(value))
        else:
            held.copy_(value)

    def reset(self) -> None:
        """Empties the cache; buffers are kept (zeroed) for the next sequence of the same batch size."""
        Cache.reset(self)
        for value in (self.seen, self.lengths):
            if value is not None:
                value.zero_()
        if self.engram_history is not None:
            self.engram_history.fill_(DEAD)  # as if there were none: the next prefill starts a sequence
        self._empty, self._undoable, self.behind, self._seen_on_host = True, (0, 0), None, 0


class DeepseekV41DSparkCache:
    """The DSpark draft head's decode state: per draft block, a ring [B, W, D] of the K=V of each row's last W main
    positions (slot ``p % W`` holds position ``p``, as the reference's ``window_kv_cache``), and how many positions
    each row has written.

    Only accepted positions are written (speculative decoding verifies a draft before its tokens' hidden states
    reach the rings), so a rejected draft needs no rollback here.
    """

    def __init__(self, num_blocks: int, window: int):
        self.window = window
        self.rings: list[torch.Tensor | None] = [None] * num_blocks
        self.lengths: torch.Tensor | None = None  # [B] positions written (the next one to write)

    def filled(self) -> torch.Tensor:
        """[B] ring slots holding a position: ``min(W, lengths)``."""
        return self.lengths.clamp_max(self.window)

    def write(self, block: int, kv: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Write kv [B, S, D] of ``positions`` [B, S] (where ``valid``) into ring ``block``. Of positions that share
        a slot only the newest is written, so the write is deterministic."""
        bsz, _, dim = kv.shape
        valid = torch.ones_like(positions, dtype=torch.bool) if valid is None else valid.bool()
        newest = torch.where(valid, positions, -1).amax(dim=1, keepdim=True)  # [B, 1]
        keep = valid & (positions > newest - self.window)
        ring = self.rings[block]
        if ring is None:
            ring = kv.new_zeros(bsz, self.window, dim)
        row, col = keep.nonzero(as_tuple=True)
        self.rings[block] = ring.index_put((row, positions[row, col] % self.window), kv[row, col].to(ring.dtype))
        if block == len(self.rings) - 1:
            written = (newest.squeeze(1) + 1).clamp_min(0)
            self.lengths = written if self.lengths is None else torch.maximum(self.lengths, written)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (rows that are done leave a speculative batch)."""
        self.rings = [None if ring is None else ring[indices] for ring in self.rings]
        self.lengths = None if self.lengths is None else self.lengths[indices]


__all__ = [
    "CacheStep",
    "DeepseekV41Cache",
    "DeepseekV41DSparkCache",
    "DeepseekV41LayerCache",
    "DeepseekV41StaticCache",
    "DeepseekV41StaticLayerCache",
]
