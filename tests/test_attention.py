"""The attention's slot layout and blockwise softmax (the reference kernel's), checked against plain formulas; its
slot-gather backward, query chunking and attention maps."""

import pytest
import torch

from modeling_dsv41 import attention
from modeling_dsv41.attention import (
    SPARSE_ATTENTION_BLOCK,
    CompressedContext,
    decode_window_slots,
    gather_slots,
    prefill_window_slots,
    sink_attention,
    topk_selection,
)
from modeling_dsv41.rotary import apply_rotary
from tiny_models import tiny_model


def dense_sink_attention(q, kv, slots, sink, scale):
    """softmax over the picked rows plus a sink logit, written out directly in fp64."""
    q, kv, sink = q.double(), kv.double(), sink.double()
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for s in range(q.shape[1]):
            picked = slots[b, s][slots[b, s] >= 0]
            logits = torch.einsum("hd,kd->hk", q[b, s], kv[b, picked]) * scale  # [H, k]
            weights = torch.cat([logits, sink.unsqueeze(1)], 1).softmax(-1)[:, :-1]
            out[b, s] = weights @ kv[b, picked]
    return out


def test_blockwise_softmax_equals_the_plain_formula_across_blocks():
    """More slots than one block, empty slots scattered through them, a query with no slot at all."""
    generator = torch.Generator().manual_seed(0)
    bsz, seq, heads, dim, rows = 2, 5, 3, 16, 200
    q = torch.randn(bsz, seq, heads, dim, generator=generator)
    kv = torch.randn(bsz, rows, dim, generator=generator)
    sink = torch.randn(heads, generator=generator)
    width = 2 * SPARSE_ATTENTION_BLOCK + 7
    slots = torch.randint(0, rows, (bsz, seq, width), generator=generator)
    slots = slots.masked_fill(torch.rand(bsz, seq, width, generator=generator) < 0.3, -1)
    slots[0, 1, : SPARSE_ATTENTION_BLOCK] = -1  # a whole empty first block: the running max starts late
    slots[1, 2] = -1  # nothing to attend to
    out = sink_attention(q, kv, slots, sink, dim**-0.5)
    expected = dense_sink_attention(q, kv, slots, sink, dim**-0.5)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[1, 2], torch.zeros(heads, dim))


def test_window_slots_follow_the_reference_layout():
    # full pass: oldest first, empty slots last
    assert prefill_window_slots(5, 3, torch.device("cpu")).tolist() == [
        [0, -1, -1], [0, 1, -1], [0, 1, 2], [1, 2, 3], [2, 3, 4]
    ]
    assert prefill_window_slots(2, 4, torch.device("cpu")).tolist() == [[0, -1], [0, 1]]
    # decode: keys cover positions past - W … past + S - 1; empty slots (before the first token) come first
    slots = decode_window_slots(torch.tensor([1, 6]), 2, 3)
    assert slots.tolist() == [
        [[-1, 2, 3], [2, 3, 4]],  # row at past 1: query at position 1 sees 0..1, then position 2 sees 0..2
        [[1, 2, 3], [2, 3, 4]],
    ]


def test_topk_selection_is_ascending_with_unreachable_picks_emptied():
    scores = torch.tensor([[[0.5, 3.0, -torch.inf, 1.0], [2.0, 0.1, 0.3, 9.0]]])
    compress_lens = torch.tensor([2, 4])
    # query 0 reaches rows 0-1 only: its third pick (row 3, reachable by score but past its length) is emptied
    assert topk_selection(scores, compress_lens, 3).tolist() == [[[0, 1, -1], [0, 2, 3]]]
    assert topk_selection(scores, compress_lens, 10).shape == (1, 2, 4)  # k never exceeds the rows there are


def advanced_indexing_gather(kv, slots):
    """The slot gather as it was before :func:`gather_slots`: advanced indexing, whose backward is ``index_put_``."""
    rows = torch.arange(kv.shape[0]).view(-1, 1, 1)
    return kv[rows, slots.clamp_min(0)]


def sink_attention_grads(q, kv, slots, sink, upstream):
    q, kv, sink = (t.detach().clone().requires_grad_() for t in (q, kv, sink))
    out = sink_attention(q, kv, slots, sink, q.shape[-1] ** -0.5)
    out.backward(upstream)
    return out.detach(), q.grad, kv.grad, sink.grad


def test_slot_gather_backward_matches_the_advanced_indexing_path(monkeypatch):
    """Same forward bits; gradients of q, kv and the sinks equal the ``index_put_`` path's up to the order in which
    the rows picked by many slots sum their gradient (fp32: a few ulp)."""
    generator = torch.Generator().manual_seed(1)
    bsz, seq, heads, dim, rows = 2, 7, 3, 16, 40  # few rows: each is picked by many slots
    q = torch.randn(bsz, seq, heads, dim, generator=generator)
    kv = torch.randn(bsz, rows, dim, generator=generator)
    sink = torch.randn(heads, generator=generator)
    slots = torch.randint(0, rows, (bsz, seq, 2 * SPARSE_ATTENTION_BLOCK + 5), generator=generator)
    slots = slots.masked_fill(torch.rand(slots.shape, generator=generator) < 0.2, -1)
    upstream = torch.randn(bsz, seq, heads, dim, generator=generator)

    ours = sink_attention_grads(q, kv, slots, sink, upstream)
    monkeypatch.setattr(attention, "gather_slots", advanced_indexing_gather)
    before = sink_attention_grads(q, kv, slots, sink, upstream)
    assert torch.equal(ours[0], before[0])
    for name, mine, theirs in zip(("q", "kv", "sink"), ours[1:], before[1:]):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=name)
    assert ours[2][:, 0].abs().sum() > 0  # row 0 is both a real pick and where empty slots read: only picks count


def attention_model(dtype=torch.float32, **text_overrides):
    """The tiny model without Engram (its attention is what these tests look at)."""
    return tiny_model(engram_layer_ids=[], engram_num_embeddings=[], **text_overrides).to(dtype)


def set_query_chunk_size(model, chunk):
    for layer in model.model.layers:
        layer.attn.query_chunk_size = chunk
        if layer.attn.indexer is not None:
            layer.attn.indexer.query_chunk_size = chunk


def test_chunked_queries_reproduce_the_whole_pass():
    """Chunk sizes that split the window, the compressed groups and the candidate blocks unevenly; index
    selection is active (index_topk 8 of up to 75 rows) and layer 5 selects inside layer 3's candidate blocks.

    Every per-query op is the same in both passes, but the indexer's scores are one GEMM with C·heads instead of
    S·heads rows, which a BLAS may block differently; in fp32 a last-ulp score difference flipped a top-k pick in
    one full-suite run (logits 0.05 apart). In float64 such a flip would need scores within 1e-15 of each other, so
    the passes must agree to the fp32 head's rounding. A chunk misaligned by one query (lengths, candidates or
    slots) moves these logits by more than 1e-2."""
    model = attention_model(torch.float64)
    ids = torch.randint(3, 500, (2, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(ids, use_cache=False).logits
        for chunk in (64, 37, 1):
            set_query_chunk_size(model, chunk)
            torch.testing.assert_close(model(ids, use_cache=False).logits, whole, rtol=1e-5, atol=1e-5)


def test_query_chunk_size_must_be_positive():
    from configuration import DeepseekV41TextConfig

    with pytest.raises(ValueError, match="query_chunk_size"):
        DeepseekV41TextConfig(query_chunk_size=0)


@pytest.mark.slow
def test_forward_peak_memory_grows_linearly_with_sequence_length():
    """Peak RSS rise of one forward (each in a fresh process, see benchmarks/memory.py) at 4× the tokens stays
    within 4.5× (4× is linear); holding the indexer's [S, heads, S / ratio] scores whole measured 9.9× there."""
    from benchmarks.memory import memory_config, peak_forward_bytes

    chunk = memory_config().text_config.query_chunk_size
    short, long = peak_forward_bytes(4096, chunk), peak_forward_bytes(16384, chunk)
    assert long <= 4.5 * short, (short, long)


def test_attention_map_recombines_into_the_output():
    """probs [B, H, S, K] over the slots that slot_index names (window key positions, then compressed rows), times
    those K=V rows, is the attention before its output projections: the module's own output follows."""
    model = attention_model()
    text = model.config.text_config
    attn = model.model.layers[1].attn  # ratio 2: KV and index source, index_topk 8 of up to 20 rows
    bsz, seq = 2, 41
    x = torch.randn(bsz, seq, text.hidden_size, generator=torch.Generator().manual_seed(0))
    rotation = model.model.compress_rotary(torch.arange(seq))
    ctx = CompressedContext()
    with torch.no_grad():
        out, (probs, slot_index) = attn(x, rotation, ctx, output_attentions=True)
        # with the map asked for, the output is computed from it (the map on the gradient path, as transformers'
        # eager attention): fp32 here, so the fused online softmax and this differ by fp32 rounding only
        torch.testing.assert_close(out, attn(x, rotation, CompressedContext()), rtol=1e-5, atol=1e-6)
        window = min(seq, text.sliding_window)
        assert probs.shape == (bsz, text.num_attention_heads, seq, slot_index.shape[-1])
        assert torch.equal(slot_index[0, :, :window], prefill_window_slots(seq, text.sliding_window, x.device))
        assert torch.equal(slot_index[..., window:], ctx.selection)
        assert (probs[slot_index.unsqueeze(1).expand_as(probs) < 0] == 0).all()

        rot = rotation.unsqueeze(0).expand(bsz, -1, -1)
        keys = torch.cat([attn._window_kv(x, rot), ctx.compress_kv], dim=1)  # [window; compressed] rows
        rows = torch.cat([slot_index[..., :window], torch.where(ctx.selection >= 0, ctx.selection + seq, -1)], -1)
        values = gather_slots(keys, rows) * (rows >= 0).unsqueeze(-1)
        mixed = torch.einsum("bhsk,bskd->bshd", probs, values)
        mixed = apply_rotary(mixed, rot, inverse=True).view(bsz, seq, attn.n_groups, -1)
        torch.testing.assert_close(attn.wo_b(attn.wo_a(mixed).flatten(2)), out, rtol=1e-5, atol=1e-6)


def test_attention_map_of_a_decode_step_matches_the_full_pass():
    """The last query's map from a cached decode step names the same window positions and compressed rows, with
    the same probabilities, as the full forward's last query."""
    model = attention_model()
    maps = []

    def recording(forward):
        def wrapped(*args, **kwargs):
            out, attn_map = forward(*args, **{**kwargs, "output_attentions": True})
            maps.append(attn_map)
            return out

        return wrapped

    layer = model.model.layers[3].attn  # ratio 1 KV source, index source and candidate source
    layer.forward = recording(layer.forward)
    ids = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, use_cache=False)
        cache = model(ids[:, :-1], use_cache=True).cache
        model(ids[:, -1:], cache=cache)
    (full_probs, full_index), _, (step_probs, step_index) = maps
    assert torch.equal(step_index[:, -1], full_index[:, -1])
    torch.testing.assert_close(step_probs[:, :, -1], full_probs[:, :, -1], rtol=1e-5, atol=1e-6)
