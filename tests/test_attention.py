"""The attention's slot layout and blockwise softmax (the reference kernel's), checked against plain formulas; its
recomputing backward against autograd of the same forward, its slot-gather backward, query chunking and attention
maps."""

import pytest
import torch

from modeling_dsv41 import attention, sparse_attention
from modeling_dsv41.attention import CompressedContext, prefill_window_slots, topk_selection
from modeling_dsv41.sparse_attention import (
    SPARSE_ATTENTION_BLOCK,
    gather_slots,
    sink_attention,
    sink_attention_forward,
)
from modeling_dsv41.layer_cache import decode_window_slots
from modeling_dsv41.numerics import reference_numerics, reference_numerics_active
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


@pytest.mark.parametrize("step_bytes", [0, None], ids=["steps of the kernel's 64 slots", "all slots in one step"])
def test_blockwise_softmax_equals_the_plain_formula_across_blocks(monkeypatch, step_bytes):
    """More slots than one block, empty slots scattered through them, a query with no slot at all; in the kernel's
    blocks (as in reference numerics) or in as few steps as the memory bound allows (otherwise: here one)."""
    if step_bytes is not None:
        monkeypatch.setattr(sparse_attention, "SPARSE_ATTENTION_STEP_BYTES", step_bytes)
    generator = torch.Generator().manual_seed(0)
    bsz, seq, heads, dim, rows = 2, 5, 3, 16, 200
    q = torch.randn(bsz, seq, heads, dim, generator=generator)
    kv = torch.randn(bsz, rows, dim, generator=generator)
    sink = torch.randn(heads, generator=generator)
    width = 2 * SPARSE_ATTENTION_BLOCK + 7
    slots = torch.randint(0, rows, (bsz, seq, width), generator=generator)
    slots = slots.masked_fill(torch.rand(bsz, seq, width, generator=generator) < 0.3, -1)
    slots[0, 1, :SPARSE_ATTENTION_BLOCK] = -1  # a whole empty first block: the running max starts late
    slots[1, 2] = -1  # nothing to attend to
    out = sink_attention(q, kv, slots, sink, dim**-0.5)
    expected = dense_sink_attention(q, kv, slots, sink, dim**-0.5)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[1, 2], torch.zeros(heads, dim))
    _, grad_q, _, grad_sink = sink_attention_grads(q, kv, slots, sink, torch.ones_like(q))
    assert torch.equal(grad_q[1, 2], torch.zeros(heads, dim)) and grad_sink.isfinite().all()


def test_the_online_softmax_takes_the_kernels_blocks_in_reference_numerics_and_fewer_steps_otherwise():
    """A decode step's query (one token) takes all its slots at once; a long pass keeps the kernel's 64, the memory
    of its gathered keys bounded; reference numerics always takes 64, the reference kernel's rounding points."""
    one_token = torch.zeros(1, 1, 16, 512)
    long_pass = torch.zeros(4, 2048, 16, 512)
    assert sparse_attention.slots_per_step(one_token) >= 8192
    assert sparse_attention.slots_per_step(long_pass) == SPARSE_ATTENTION_BLOCK
    with reference_numerics():
        assert sparse_attention.slots_per_step(one_token) == SPARSE_ATTENTION_BLOCK


def test_window_slots_follow_the_reference_layout():
    # full pass: oldest first, empty slots last
    assert prefill_window_slots(5, 3, torch.device("cpu")).tolist() == [
        [0, -1, -1],
        [0, 1, -1],
        [0, 1, 2],
        [1, 2, 3],
        [2, 3, 4],
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


def autograd_sink_attention(q, kv, slots, sink, scale):
    """The baseline: autograd of the forward itself, which keeps every block's keys and probabilities."""
    return sink_attention_forward(q, kv, slots, sink, scale)[0]


def sink_attention_grads(q, kv, slots, sink, upstream, attend=sink_attention, numerics=False):
    q, kv, sink = (t.detach().clone().requires_grad_() for t in (q, kv, sink))
    with reference_numerics(numerics):
        out = attend(q, kv, slots, sink, q.shape[-1] ** -0.5)
    out.backward(upstream)  # outside the mode, as a training loop calls it
    return out.detach(), q.grad, kv.grad, sink.grad


def attention_inputs(seed, dtype=torch.float32, bsz=2, seq=7, heads=3, dim=16, rows=40, width=None):
    """Few rows (each picked by many slots), empty slots scattered through several blocks, one whole empty block."""
    generator = torch.Generator().manual_seed(seed)
    width = width or 2 * SPARSE_ATTENTION_BLOCK + 5
    q = torch.randn(bsz, seq, heads, dim, generator=generator)
    kv = torch.randn(bsz, rows, dim, generator=generator)
    sink = torch.randn(heads, generator=generator)
    slots = torch.randint(0, rows, (bsz, seq, width), generator=generator)
    slots = slots.masked_fill(torch.rand(slots.shape, generator=generator) < 0.2, -1)
    slots[0, 1, :SPARSE_ATTENTION_BLOCK] = -1
    upstream = torch.randn(bsz, seq, heads, dim, generator=generator)
    return q.to(dtype), kv.to(dtype), slots, sink, upstream.to(dtype)


@pytest.mark.parametrize("numerics", [False, True], ids=["plain", "reference numerics"])
def test_recomputing_backward_equals_autograd_in_fp32(numerics):
    """Same forward bits; the gradients of q, kv (window and compressed rows alike: any row a slot picks) and the
    sinks within 1e-6 of their largest entry (measured: 4e-7 plain, 2.4e-7 in reference numerics; the two sum the
    same terms in another order: the recomputed probabilities are exp(logit - lse), not the blockwise rescaling)."""
    q, kv, slots, sink, upstream = attention_inputs(1)
    ours = sink_attention_grads(q, kv, slots, sink, upstream, numerics=numerics)
    autograd = sink_attention_grads(q, kv, slots, sink, upstream, autograd_sink_attention, numerics)
    assert torch.equal(ours[0], autograd[0])
    for name, mine, theirs in zip(("q", "kv", "sink"), ours[1:], autograd[1:]):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6 * theirs.abs().max().item(), msg=name)
    assert ours[2][:, 0].abs().sum() > 0  # row 0 is both a real pick and where empty slots read: only picks count


@pytest.mark.parametrize("numerics", [False, True], ids=["plain", "reference numerics"])
def test_recomputing_backward_in_bf16_is_as_close_as_rounding(numerics):
    """In bf16 the forward rounds each block's probabilities for the PV product (against the running maximum) and
    autograd differentiates through that rounding; the recomputation takes exact probabilities and δ from the bf16
    output. The two agree to bf16 rounding: ‖ours − autograd‖ / ‖autograd‖ measured 2.5-3.2e-3 (q, kv, sink), the
    bound is 6e-3; q's and kv's are the closer of the two to the fp64 gradient (1.7e-3 against 2.4e-3)."""
    q, kv, slots, sink, upstream = attention_inputs(0, torch.bfloat16, seq=33, heads=8, dim=64, rows=300, width=209)
    ours = sink_attention_grads(q, kv, slots, sink, upstream, numerics=numerics)
    autograd = sink_attention_grads(q, kv, slots, sink, upstream, autograd_sink_attention, numerics)
    exact = sink_attention_grads(
        q.double(), kv.double(), slots, sink.double(), upstream.double(), autograd_sink_attention
    )
    assert torch.equal(ours[0], autograd[0])
    for name, mine, theirs, truth in zip(("q", "kv", "sink"), ours[1:], autograd[1:], exact[1:]):
        mine, theirs, truth = mine.double(), theirs.double(), truth.double()
        assert (mine - theirs).norm() <= 6e-3 * theirs.norm(), name
        if name != "sink":
            assert (mine - truth).norm() <= (theirs - truth).norm(), name


def test_backward_recomputes_in_the_numerics_of_its_forward(monkeypatch):
    """The autograd engine runs a backward without the forward's torch-function modes: the recomputation re-enters
    reference numerics when (and only when) its forward ran in it."""
    seen = []
    backward = sparse_attention.sink_attention_backward

    def spy(*args):
        seen.append(reference_numerics_active())
        return backward(*args)

    monkeypatch.setattr(sparse_attention, "sink_attention_backward", spy)
    q, kv, slots, sink, upstream = attention_inputs(2)
    q.requires_grad_()
    sink_attention_grads(q, kv, slots, sink, upstream, numerics=True)
    out = sink_attention(q, kv, slots, sink, 0.25)
    with reference_numerics():  # a mode around the backward alone is not the forward's
        out.backward(upstream)
    assert seen == [True, False]


def saved_bytes(function, *args):
    """Bytes autograd keeps for the backward of ``function(*args)``, each storage counted once."""
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function(*args)
    return sum(storages.values())


def test_recomputing_backward_keeps_only_its_inputs_output_and_row_statistics():
    """What the backward keeps: q, kv, the slots, the sink, the output and one fp32 log-sum-exp per row and head;
    autograd of the forward keeps fp32 keys of every slot and several [H, K] tensors per block on top."""
    q, kv, slots, sink, _ = attention_inputs(3, torch.bfloat16, seq=64, heads=4, dim=64, rows=100, width=256)
    q, kv, sink = (t.requires_grad_() for t in (q, kv, sink))
    bsz, seq, heads, dim = q.shape
    expected = q.nbytes + kv.nbytes + slots.nbytes + sink.nbytes + q.nbytes + bsz * seq * heads * 4
    assert saved_bytes(sink_attention, q, kv, slots, sink, dim**-0.5) == expected
    assert saved_bytes(autograd_sink_attention, q, kv, slots, sink, dim**-0.5) > 15 * expected


def test_slot_gather_backward_matches_the_advanced_indexing_path(monkeypatch):
    """autograd's gather backward (the attention map of ``output_attentions`` is differentiated through it): same
    forward bits; gradients of q, kv and the sinks equal the ``index_put_`` path's up to the order in which the rows
    picked by many slots sum their gradient (fp32: a few ulp)."""
    q, kv, slots, sink, upstream = attention_inputs(1)
    ours = sink_attention_grads(q, kv, slots, sink, upstream, autograd_sink_attention)
    monkeypatch.setattr(sparse_attention, "gather_slots", advanced_indexing_gather)
    before = sink_attention_grads(q, kv, slots, sink, upstream, autograd_sink_attention)
    assert torch.equal(ours[0], before[0])
    for name, mine, theirs in zip(("q", "kv", "sink"), ours[1:], before[1:]):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=name)


def attention_model(dtype=torch.float32, **text_overrides):
    """The tiny model without Engram (its attention is what these tests look at)."""
    return tiny_model(engram_layer_ids=[], engram_num_embeddings=[], **text_overrides).to(dtype)


def set_query_chunk_size(model, chunk):
    for layer in model.model.layers:
        layer.attn.query_chunk_size = chunk
        if layer.attn.indexer is not None:
            layer.attn.indexer.query_chunk_size = chunk


def test_model_gradients_equal_autograd_attention(monkeypatch):
    """Every parameter's gradient of an fp32 training step on the tiny model (window-only, ratio-2 and ratio-1
    layers, index selection active, three query chunks per layer) with the recomputing attention, against autograd
    of its forward, within 3e-5 of each gradient's largest entry. Rounding only: the largest gaps (1e-5, mHC's base
    and scale, sums over every token) are what autograd itself shows between two query chunkings (8e-6)."""
    model = tiny_model().train()
    set_query_chunk_size(model, 17)
    ids = torch.randint(3, 500, (2, 41), generator=torch.Generator().manual_seed(0))

    def gradients():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    ours = gradients()
    monkeypatch.setattr(attention, "sink_attention", autograd_sink_attention)
    autograd = gradients()
    assert ours.keys() == autograd.keys() and any(".attn_sink" in name for name in ours)
    for name, grad in autograd.items():
        torch.testing.assert_close(ours[name], grad, rtol=3e-5, atol=3e-5 * grad.abs().max().item(), msg=name)


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
