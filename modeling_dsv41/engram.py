"""Engram: hashed n-gram memory written into the residual stream (DeepSeek-V4.1, docs/design.md §4).

Two pieces:

- :class:`DeepseekV41NgramHasher` turns token ids into table row ids. Tokens are first mapped onto a
  *compressed* vocabulary (tokens that normalize alike share an id), then for every position the 2-gram
  .. ``engram_max_ngram_size``-gram ending there is hashed with per-layer multipliers into a prime-sized
  bucket range per (n-gram size, head). The compressed map, primes and multipliers reproduce DeepSeek's
  reference bit for bit, because the released tables are indexed by them.
- :class:`DeepseekV41Engram` looks those rows up, projects them to one key per hyper-connection copy
  plus a shared value, and adds the value to each copy behind a gate that measures how well the key
  matches that copy of the stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from sympy import isprime
from torch import nn
from transformers import initialization as init
from transformers.utils import logging

from .recompute import recomputed
from .codec import RELEASED_BLOCK_SIZE, dequantize_fp8_rows
from .validation import check_on_device, reads_values_on_host

logger = logging.get_logger(__name__)

# Compressed id of a position that takes no part in any n-gram (image spans, padding). Look-back stops there.
DEAD = -1
# Lower bound on |dot| before the signed square root of the gate, as in the training kernel.
_GATE_CLAMP = 1e-6


# ----------------------------------------------------------------------------------------------------
# Compressed vocabulary
# ----------------------------------------------------------------------------------------------------
def _compressed_token_normalizer():
    """NFKC → NFD → strip accents → lowercase → collapse [ \\t\\r\\n]+ to one space → strip.

    A token that is only whitespace keeps a single space instead of becoming empty: it is swapped for a
    private-use sentinel around ``Strip``.
    """
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )


def build_compressed_token_map(tokenizer) -> tuple[list[int], int]:
    """Map every token id to a compressed id; returns ``(lookup, compressed_vocab_size)``.

    Each token is decoded alone by the raw ``tokenizers`` backend (no clean-up of spaces) and keyed by
    its normalized text, or by the raw text when normalization leaves nothing. A token whose decoding
    holds U+FFFD (a partial UTF-8 byte token) is keyed by its raw vocabulary string instead, in the same
    key space: such a key can equal a normalized text (byte 0xE6 is ``"æ"`` in byte-level BPE) and then
    both tokens share an id, exactly as in the reference. Compressed ids are handed out in token-id order.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` or a transformers fast tokenizer.
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    vocab_size = len(tokenizer) if hasattr(tokenizer, "backend_tokenizer") else backend.get_vocab_size(True)
    normalizer = _compressed_token_normalizer()
    key_to_id: dict[str, int] = {}
    lookup = []
    for token_id in range(vocab_size):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        lookup.append(key_to_id.setdefault(key, len(key_to_id)))
    return lookup, len(key_to_id)


def default_compressed_token_map(
    vocab_size: int, compressed_vocab_size: int, device: torch.device | str = "cpu"
) -> torch.LongTensor:
    """The map a model built from a config starts with: token id → ``id % compressed_vocab_size``.

    It lets such a model run, train, save and reload with no tokenizer. It is not the map any released table was
    trained with: loading released weights builds the map from their tokenizer (``load_tokenizer``).
    """
    return torch.arange(vocab_size, dtype=torch.long, device=device) % compressed_vocab_size


# ----------------------------------------------------------------------------------------------------
# Hash constants
# ----------------------------------------------------------------------------------------------------
def engram_primes(num_layers: int, max_ngram_size: int, n_heads: int, engram_vocab_size: int) -> list:
    """Bucket moduli ``[layer][n-gram size - 2][head]``: the smallest primes ≥ ``engram_vocab_size`` not yet used.

    The search restarts at ``engram_vocab_size`` for every n-gram size but never reuses a prime, across
    layers too, so each (layer, n-gram, head) column gets a distinct modulus.
    """
    used: set[int] = set()
    primes = []
    for _ in range(num_layers):
        per_ngram = []
        for _ in range(max_ngram_size - 1):
            heads, candidate = [], engram_vocab_size
            for _ in range(n_heads):
                while candidate in used or not isprime(candidate):
                    candidate += 1
                used.add(candidate)
                heads.append(candidate)
            per_ngram.append(heads)
        primes.append(per_ngram)
    return primes


def engram_hash_multipliers(layer_ids: Sequence[int], max_ngram_size: int, compressed_vocab_size: int) -> torch.Tensor:
    """One odd multiplier per (layer, look-back), ``[len(layer_ids), max_ngram_size]`` int64.

    Drawn from ``numpy.random.default_rng(10007 * layer_id)`` and bounded so that
    ``compressed_id * multiplier`` never overflows int64.
    """
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = [
        np.random.default_rng(10007 * layer_id).integers(0, bound, size=(max_ngram_size,), dtype=np.int64) * 2 + 1
        for layer_id in layer_ids
    ]
    return torch.from_numpy(np.stack(rows))


class DeepseekV41NgramHasher(nn.Module):
    """Row ids of every Engram table for every position.

    Buffers:
        token_map (`[vocab_size]` int64, persistent): token id → compressed id, ``-1`` where unknown. It
            comes from the tokenizer (:meth:`load_tokenizer`) or from a saved state dict; until then it holds
            :func:`default_compressed_token_map` (``uses_default_token_map``; a forward pass under it warns once).
        multipliers (`[n_layers, max_ngram]`), primes (`[n_layers, max_ngram-1, n_heads]`), offsets
            (`[n_layers, n_cols]`): int64, derived from the config alone, hence not saved.

    Calling the module returns ``[B, S, n_engram_layers, n_cols]`` int64 row ids, where
    ``n_cols = (max_ngram - 1) * n_heads`` ordered n-gram size major, head minor, and the third axis
    follows ``config.engram_layer_ids`` (an Engram layer reads index ``DeepseekV41Engram.hash_index``).
    """

    def __init__(self, config):
        super().__init__()
        self.layer_ids = tuple(spec.layer_id for spec in config.layer_plan if spec.has_engram)
        if not self.layer_ids:
            raise ValueError("DeepseekV41NgramHasher needs at least one entry in engram_layer_ids")
        self.max_ngram_size = config.engram_max_ngram_size
        self.n_heads = config.engram_n_heads
        self.num_hash_columns = (self.max_ngram_size - 1) * self.n_heads
        self.pad_token_id = config.engram_pad_token_id
        self.compressed_vocab_size = config.engram_compressed_vocab_size
        self.engram_vocab_size = config.engram_vocab_size
        self.num_embeddings = tuple(config.engram_num_embeddings)

        primes, multipliers, offsets = self._hash_constants()
        rows_needed = (offsets[:, -1] + primes[:, -1, -1]).tolist()
        for layer_id, rows, needed in zip(self.layer_ids, self.num_embeddings, rows_needed):
            if rows < needed:
                raise ValueError(
                    f"Engram layer {layer_id}: engram_num_embeddings is {rows} but its hash buckets need {needed} rows"
                )
        self.register_buffer("token_map", default_compressed_token_map(config.vocab_size, self.compressed_vocab_size))
        self._default_map_placed = True  # False once a checkpoint or a tokenizer gave the map
        self._default_map_check: tuple | None = None  # ((storage, device, version) of token_map, still default?)
        self.register_buffer("multipliers", multipliers, persistent=False)
        self.register_buffer("primes", primes, persistent=False)
        self.register_buffer("offsets", offsets, persistent=False)

    def _hash_constants(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        primes = torch.tensor(
            engram_primes(len(self.layer_ids), self.max_ngram_size, self.n_heads, self.engram_vocab_size),
            dtype=torch.long,
            device="cpu",  # real values even under transformers' meta-device init (from_pretrained)
        )
        multipliers = engram_hash_multipliers(self.layer_ids, self.max_ngram_size, self.compressed_vocab_size)
        flat = primes.flatten(1)
        offsets = flat.cumsum(-1) - flat  # each column's bucket range starts where the previous one ends
        return primes, multipliers, offsets

    def init_buffers(self) -> None:
        """(Re)compute the derived buffers, and put the default map in ``token_map`` unless it was loaded.

        For ``_init_weights``: transformers allocates non-persistent buffers empty when loading a checkpoint. A
        checkpoint without ``token_map`` (the released one) thus leaves ``has_token_map`` False, and
        ``from_pretrained`` builds the map from the tokenizer.
        """
        primes, multipliers, offsets = self._hash_constants()
        init.copy_(self.primes, primes)
        init.copy_(self.multipliers, multipliers)
        init.copy_(self.offsets, offsets)
        self._default_map_placed = not getattr(self.token_map, "_is_hf_initialized", False)
        init.copy_(self.token_map, default_compressed_token_map(self.token_map.numel(), self.compressed_vocab_size))

    @property
    def history_size(self) -> int:
        """How many past compressed ids an incremental step needs (``max_ngram - 1``)."""
        return self.max_ngram_size - 1

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "token_map" in state_dict:
            self._default_map_placed = False

    @property
    def uses_default_token_map(self) -> bool:
        """Whether the default map is in use: it was put in at construction (not loaded from a checkpoint nor built
        from a tokenizer) and ``token_map`` still holds it. The contents are checked again whenever the buffer was
        replaced or written in place, so a map filled with ``token_map.copy_(...)`` does not count as the default."""
        token_map = self.token_map
        if not self._default_map_placed:
            return False
        if token_map.is_meta:
            return True
        key = (token_map.data_ptr(), token_map.device, token_map._version)
        if self._default_map_check is None or self._default_map_check[0] != key:
            default = default_compressed_token_map(token_map.numel(), self.compressed_vocab_size, token_map.device)
            self._default_map_check = (key, torch.equal(token_map, default))
        return self._default_map_check[1]

    def _holds_default_map(self) -> bool | torch.Tensor:
        """:attr:`uses_default_token_map` without a host sync, for compiled code: ``False``, or whether ``token_map``
        holds the default map as a 0-d bool tensor, computed from its contents on every call."""
        if not self._default_map_placed:
            return False
        token_map = self.token_map
        default = default_compressed_token_map(token_map.numel(), self.compressed_vocab_size, token_map.device)
        return (token_map == default).all()

    @property
    def has_token_map(self) -> bool:
        """Whether ``token_map`` came from a tokenizer or a checkpoint (not the default map)."""
        return not self.uses_default_token_map and bool((self.token_map >= 0).any())

    @torch.no_grad()
    def load_tokenizer(self, tokenizer) -> None:
        """Fill ``token_map`` from the tokenizer the checkpoint was trained with."""
        lookup, compressed_size = build_compressed_token_map(tokenizer)
        if compressed_size != self.compressed_vocab_size:
            # every multiplier derives from this size: a mismatch would silently rehash the whole table
            raise ValueError(
                f"this tokenizer compresses to {compressed_size} ids but engram_compressed_vocab_size is "
                f"{self.compressed_vocab_size}: it is not the tokenizer the Engram tables were trained with"
            )
        if len(lookup) > self.token_map.numel():
            raise ValueError(f"the tokenizer has {len(lookup)} tokens, more than vocab_size {self.token_map.numel()}")
        if not 0 <= self.pad_token_id < len(lookup):
            # look-back past a sequence start reads the pad token's compressed id: it must be a real token
            raise ValueError(
                f"engram_pad_token_id {self.pad_token_id} is not a token of this tokenizer ({len(lookup)} tokens)"
            )
        self.token_map.fill_(DEAD)
        self.token_map[: len(lookup)] = torch.tensor(lookup, dtype=torch.long, device=self.token_map.device)
        self._default_map_placed = False

    def compress(
        self,
        input_ids: torch.LongTensor,
        image_mask: torch.BoolTensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.LongTensor:
        """Compressed ids ``[B, S]``, ``DEAD`` (-1) at image-span positions and where ``attention_mask`` is 0.

        Padding counts as dead, so with left padding the look-back of a row stops at its first real token.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        dead = torch.zeros_like(input_ids, dtype=torch.bool)
        for name, mask in (("image_mask", image_mask), ("attention_mask", attention_mask)):
            if mask is not None and mask.shape != input_ids.shape:
                raise ValueError(
                    f"{name} must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(mask.shape)}"
                )
        if image_mask is not None:
            dead |= image_mask.bool()
        if attention_mask is not None:
            dead |= ~attention_mask.bool()
        # a bool, or under torch.compile the same test as a 0-d tensor (a host-side answer would break the graph)
        uses_default = self._holds_default_map() if torch.compiler.is_compiling() else self.uses_default_token_map
        if uses_default is True:
            logger.warning_once(
                "Engram hashes with the default compressed token map (token id mod engram_compressed_vocab_size): "
                "fine for a model trained from scratch, wrong for released Engram tables, which need the map of "
                "their tokenizer: `model.model.engram_hasher.load_tokenizer(tokenizer)` on a "
                "DeepseekV41ForCausalLM (`model.engram_hasher.load_tokenizer(tokenizer)` on a DeepseekV41Model), "
                "or from_pretrained with `engram_tokenizer=`"
            )
        vocab = self.token_map.numel()
        in_range = (input_ids >= 0) & (input_ids < vocab)
        compressed = self.token_map[input_ids.where(in_range, 0)]
        if uses_default is not False:  # the default map is arithmetic: ids a resize added beyond it fold alike
            beyond = (input_ids >= vocab) & uses_default
            compressed = torch.where(beyond, input_ids % self.compressed_vocab_size, compressed)
            in_range = in_range | beyond
        invalid = ~dead & (~in_range | (compressed < 0))
        if not torch.compiler.is_compiling() and not reads_values_on_host(input_ids):
            check_on_device(~invalid.any(), "input ids without a compressed Engram id (outside the map's tokenizer)")
        elif not torch.compiler.is_compiling() and invalid.any():
            bad = input_ids[invalid].unique()[:8].tolist()
            raise ValueError(
                f"input ids {bad} have no compressed Engram id (outside the tokenizer the map was built from)"
            )
        return compressed.masked_fill(dead, DEAD)

    def hash_ids_from_compressed(
        self, compressed: torch.LongTensor, past_compressed: torch.LongTensor | None = None
    ) -> torch.LongTensor:
        """Row ids ``[B, S, n_layers, n_cols]`` for the positions of ``compressed`` ``[B, S]``.

        ``past_compressed`` ``[B, history_size]`` holds the compressed ids just before them (``DEAD`` where
        there are none); ``None`` means the sequence starts here. A decode cache keeps them (:meth:`hash_ids`).
        """
        batch, seq_len = compressed.shape
        lookback = self.history_size
        if past_compressed is None:
            past_compressed = compressed.new_full((batch, lookback), DEAD)
        elif past_compressed.shape != (batch, lookback):
            raise ValueError(f"past_compressed must be [{batch}, {lookback}], got {tuple(past_compressed.shape)}")
        sequence = torch.cat([past_compressed, compressed], dim=1)  # [B, lookback + S]
        pad_id = self.token_map[self.pad_token_id]

        # tokens[..., k] is the id k positions back; once the look-back meets a dead id (or the start of
        # the sequence) it and everything older reads as the pad id
        tokens, blocked = [], torch.zeros_like(compressed, dtype=torch.bool)
        for shift in range(self.max_ngram_size):
            source = sequence[:, lookback - shift : lookback - shift + seq_len]
            blocked = blocked | (source == DEAD)
            tokens.append(torch.where(blocked, pad_id, source))
        products = torch.stack(tokens, dim=-1).unsqueeze(2) * self.multipliers  # [B, S, n_layers, max_ngram]

        # XOR-ing one more look-back at a time turns the (n-1)-gram hash into the n-gram hash
        rolling, hashes = products[..., 0], []
        for n in range(2, self.max_ngram_size + 1):
            rolling = torch.bitwise_xor(rolling, products[..., n - 1])
            hashes.append(rolling.unsqueeze(-1) % self.primes[:, n - 2])  # [B, S, n_layers, n_heads]
        return torch.cat(hashes, dim=-1) + self.offsets

    def forward(
        self,
        input_ids: torch.LongTensor,
        image_mask: torch.BoolTensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.LongTensor:
        """``input_ids`` ``[B, S]`` (a whole sequence from its start) → row ids ``[B, S, n_layers, n_cols]``.

        ``image_mask`` is True on image-span positions (``token_types >= 0``); ``attention_mask`` is the
        usual 1/0 padding mask over the same positions.
        """
        return self.hash_ids_from_compressed(self.compress(input_ids, image_mask, attention_mask))

    def hash_ids(
        self,
        input_ids: torch.LongTensor | None,
        image_mask: torch.BoolTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        step=None,
    ) -> torch.LongTensor:
        """Row ids ``[B, S, n_layers, n_cols]`` of one forward call's tokens ``input_ids`` ``[B, S]``.

        Without a ``cache`` the sequence starts here (as calling the module). With a decode cache
        (:class:`~.generation.cache.DeepseekV41Cache`) and its ``step`` for this call, the n-grams look back into
        the compressed ids the cache kept of earlier calls, and the cache keeps this call's: each row's
        ``step.lengths - step.past`` real tokens lead ``input_ids``.
        """
        if input_ids is None:
            raise ValueError(
                "Engram hashes token ids: pass input_ids (alongside inputs_embeds if you supply embeddings yourself)"
            )
        if cache is None:
            return self(input_ids, image_mask, attention_mask)
        compressed = self.compress(input_ids, image_mask, attention_mask)
        hash_ids = self.hash_ids_from_compressed(compressed, cache.engram_past(self.history_size))
        cache.update_engram_history(compressed, step.lengths - step.past, self.history_size)
        return hash_ids


# ----------------------------------------------------------------------------------------------------
# The Engram block
# ----------------------------------------------------------------------------------------------------
def dequantize_engram_table(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """FP8 e4m3 table rows ``[..., D]`` times their E8M0 scales ``[..., D/32]`` (one per 32 columns), in ``dtype``.

    Works on a whole table or on gathered rows. The product is exact in bf16 for the released tables.
    """
    return dequantize_fp8_rows(weight, scale, RELEASED_BLOCK_SIZE).to(dtype)


class DeepseekV41Fp8EngramTable(nn.Module):
    """An Engram table kept as stored in the released checkpoint (FP8 e4m3 + E8M0 scales), for inference.

    Rows are dequantized to bf16 on lookup. Not trainable.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim, dtype=torch.float8_e4m3fn), requires_grad=False
        )
        self.scale = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim // RELEASED_BLOCK_SIZE, dtype=torch.float8_e8m0fnu),
            requires_grad=False,
        )

    def forward(self, indices: torch.LongTensor, device: torch.device | None = None) -> torch.Tensor:
        """Rows ``indices`` in bf16 on ``device`` (default: the table's). Only the FP8 rows and their scales
        travel; they are dequantized where they land."""
        weight, scale = self.weight[indices], self.scale[indices]
        if device is not None:
            weight, scale = weight.to(device, non_blocking=True), scale.to(device, non_blocking=True)
        return dequantize_engram_table(weight, scale)


def _gather_pinned(table: torch.Tensor, indices: torch.LongTensor) -> torch.Tensor:
    """``table[indices]`` into page-locked memory, so the copy to an accelerator can run asynchronously."""
    out = torch.empty((indices.numel(), *table.shape[1:]), dtype=table.dtype, pin_memory=True)
    torch.index_select(table, 0, indices.flatten(), out=out)
    return out.view(*indices.shape, *table.shape[1:])


class DeepseekV41Engram(nn.Module):
    """Adds an n-gram memory read to every hyper-connection copy of the residual stream, gated.

    The ``n_cols`` rows fetched per position are concatenated and ``wkv`` maps them to one key per copy
    plus a value shared by the copies. Copy ``c`` receives ``gate_c · value`` with
    ``gate_c = σ(signed_sqrt(⟨rms(h_c), q_c·k_c·rms(key_c)⟩ / √D))``, computed in fp32.
    """

    def __init__(self, config, layer_id: int):
        super().__init__()
        spec = config.layer_plan[layer_id]
        if not spec.has_engram:
            raise ValueError(f"layer {layer_id} is not an Engram layer ({list(config.engram_layer_ids)})")
        self.layer_id = layer_id
        self.hash_index = spec.engram_index
        self.hidden_size = config.hidden_size
        self.hc_mult = config.hc_mult
        self.eps = config.rms_norm_eps
        num_rows = config.engram_num_embeddings[self.hash_index]
        head_dim = config.engram_head_dim
        num_columns = (config.engram_max_ngram_size - 1) * config.engram_n_heads

        if getattr(config, "engram_table_dtype", "float") == "fp8":
            self.embed = DeepseekV41Fp8EngramTable(num_rows, head_dim)
        else:
            self.embed = nn.Embedding(num_rows, head_dim)
        self.wkv = nn.Linear(num_columns * head_dim, self.hidden_size * (self.hc_mult + 1), bias=False)
        # only their product is ever used; both kept because the checkpoint stores both
        self.q_weight = nn.Parameter(torch.ones(self.hc_mult, self.hidden_size))
        self.k_weight = nn.Parameter(torch.ones(self.hc_mult, self.hidden_size))

    @property
    def table_device(self) -> torch.device:
        """Where the table lives: any device, independently of the rest of the layer (see :meth:`lookup`)."""
        return self.embed.weight.device

    def lookup(self, hash_ids: torch.LongTensor, device: torch.device | str) -> torch.Tensor:
        """The table rows that ``hash_ids`` ``[B, S, n_cols]`` address, ``[B, S, n_cols * head_dim]`` on ``device``.

        The rows are gathered where the table lives (an accelerator, host memory, pinned or memory-mapped) and only
        they travel to ``device``: the table itself never moves. From a pinned table they are gathered into pinned
        memory and copied without blocking the host.
        """
        device = torch.device(device)
        ids = hash_ids.to(self.table_device)
        if isinstance(self.embed, DeepseekV41Fp8EngramTable):
            rows = self.embed(ids, device)
        elif (
            self.table_device.type == "cpu"
            and device.type != "cpu"
            and self.embed.weight.is_pinned()
            and not (torch.is_grad_enabled() and self.embed.weight.requires_grad)
        ):
            rows = _gather_pinned(self.embed.weight, ids).to(device, non_blocking=True)
        else:
            rows = self.embed(ids).to(device, non_blocking=True)
        return rows.flatten(-2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        hash_ids: torch.LongTensor | None = None,
        token_mask: torch.BoolTensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states ``[B, S, hc_mult, D]``; hash_ids ``[B, S, n_cols]`` (this layer's slice of the hasher
        output) or the ``rows`` they address, already gathered by :meth:`lookup` (``DeepseekV41Model`` gathers
        them before the first layer runs); token_mask ``[B, S]`` with False where the gate is shut (image spans;
        those positions come back unchanged). Returns ``[B, S, hc_mult, D]`` in the dtype of ``hidden_states``.
        """
        if rows is None:
            if hash_ids is None:
                raise ValueError("the Engram block needs hash_ids or the table rows they address")
            rows = self.lookup(hash_ids, hidden_states.device)  # [B, S, n_cols * head_dim]
        kv = self.wkv(rows.to(self.wkv.weight.dtype))  # [B, S, (hc + 1) * D]: one key per copy, the value
        return recomputed(self._gated_add, hidden_states, kv, self.q_weight, self.k_weight, token_mask)

    def _gated_add(
        self,
        hidden_states: torch.Tensor,
        kv: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        token_mask: torch.BoolTensor | None,
    ) -> torch.Tensor:
        """The gate and the write, in fp32; recomputed in the backward (:func:`~.recompute.recomputed`), which keeps
        the stream and ``wkv``'s output rather than their fp32 copies and products."""
        key, value = kv.split([self.hc_mult * self.hidden_size, self.hidden_size], dim=-1)
        key = key.float().unflatten(-1, (self.hc_mult, self.hidden_size))  # [B, S, hc, D]
        h = hidden_states.float()
        weight = q_weight.float() * k_weight.float()
        # normalized per (position, copy) over D, not jointly over the copies
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * weight * key).sum(-1) * rstd * self.hidden_size**-0.5  # [B, S, hc]
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(_GATE_CLAMP).sqrt(), dot))
        if token_mask is not None:
            gate = gate.masked_fill(~token_mask.bool().unsqueeze(-1), 0)
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(hidden_states.dtype)


__all__ = [
    "DEAD",
    "DeepseekV41Engram",
    "DeepseekV41Fp8EngramTable",
    "DeepseekV41NgramHasher",
    "build_compressed_token_map",
    "default_compressed_token_map",
    "dequantize_engram_table",
    "engram_hash_multipliers",
    "engram_primes",
]
