"""The decode caches of DeepSeek-V4.1: transformers ``Cache`` façades over each layer's decode state
(:mod:`~modeling_dsv41.layer_cache`), with each row's real-token count and Engram's n-gram history (the last
``max_ngram - 1`` compressed token ids of each row); and the DSpark draft head's rings.

:class:`DeepseekV41StaticCache` holds the same state in buffers sized once (for ``max_cache_len`` columns) and
updated in place, for ``generate(cache_implementation="static")`` and compiled decode steps. Both roll back over
their last tokens once ``activate_past_recording()`` has made them keep what a rollback needs (any number of tokens,
or up to a ``max_rewind`` given there: the static cache needs it for its fixed buffers, and DSpark gives it, so
that the dynamic cache keeps a fixed amount rather than every token since): all rows alike
(``crop``: transformers' assisted generation), or each row by its own count (``crop_rows``: DSpark speculative
decoding, whose rows keep different numbers of drafted tokens).

Rows count positions from their own first real token (a left-padded prompt is aligned to start at 0): ``lengths``
holds each row's count of real tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache

from ..engram import DEAD
from ..layer_cache import (
    CacheStep,
    DeepseekV41LayerCache,
    DeepseekV41StaticLayerCache,
    count_for_message,
    decode_window_slots,
    gather_rows,
    shift_right,
    static_buffer,
)


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
                f"cannot remove {count_for_message(tokens)} tokens from rows holding {self.lengths.tolist()} real "
                "tokens"
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
            raise ValueError(f"cannot rewind {count_for_message(tokens)} tokens: not enough Engram ids were recorded")
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
            self.seen = static_buffer(torch.tensor(seq_len, device=step.lengths.device))
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
            setattr(self, name, static_buffer(value))
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
    "DeepseekV41Cache",
    "DeepseekV41DSparkCache",
    "DeepseekV41StaticCache",
]
