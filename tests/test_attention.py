"""The attention's slot layout and blockwise softmax (the reference kernel's), checked against plain formulas."""

import torch

from modeling_dsv41.attention import (
    SPARSE_ATTENTION_BLOCK,
    decode_window_slots,
    prefill_window_slots,
    sink_attention,
    topk_selection,
)


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
