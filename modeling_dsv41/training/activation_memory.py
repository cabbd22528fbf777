"""What the activations of a LoRA step on DeepSeek-V4.1 hold, term by term, as the code computes them: the model behind
the planner's activation rows (:mod:`.planning`), checked against measured steps in tests/test_training_plan.py.

The step is the planner's: LoRA of the README's targets (attention ``wq_a``/``wq_b``/``wkv``/``wo_b``, shared and
routed experts) on the natively loaded frozen weights, bf16 activations, fp32 adapters (PEFT casts each adapted input
to fp32), every decoder layer checkpointed (transformers' gradient checkpointing). Its peak is the larger of two
moments:

* **the loss**: every layer's checkpointed input is held (:func:`checkpointed_input_terms`), and the fp32 logits,
  their log-softmax and its gradient (``3 × tokens × vocab × 4`` bytes);
* **a layer's backward**: the layer runs its forward again and keeps what it saves for its backward
  (:func:`layer_saved_terms`) on top of the inputs of the layers below it, plus its largest transient
  (:func:`layer_peak_bytes`): mHC's expand forms its [hc, hc, D] fp32 products at once (the reference's
  arithmetic), the sparse attention's backward recomputes a query chunk's keys and probabilities block by block, the
  indexer quantizes its queries and scores a query chunk against every compressed row.

With ``offload_activations`` (:mod:`.offload`) the checkpointed inputs live in host memory and only the layer running
its backward has its inputs back on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ACTIVATION_BYTES = 2  # bf16
FP32 = 4
INDEX = 8  # int64 slots, selections, routing indices


def attended_slots(config, ratio: int, seq_len: int) -> int:
    """K=V slots a query of a layer with compression ratio ``ratio`` attends to at ``seq_len`` (the longest query
    attends to most): the window, plus for compressed layers the top-k compressed rows."""
    window = min(config.sliding_window, seq_len)
    if ratio == 0:
        return window
    return window + min(config.index_topk, seq_len // ratio)


def layer_saved_terms(config, layer_id: int, seq_len: int, rank: int = 16) -> dict[str, float]:
    """Bytes per token that decoder layer ``layer_id``'s forward keeps for its backward, by term (its input, held as
    the checkpointed input, left out). The terms of :data:`ATTENTION_SIDE` are still held while the sparse attention
    runs its backward; the others are freed by then."""
    a = ACTIVATION_BYTES
    d, hc, heads, hd = config.hidden_size, config.hc_mult, config.num_attention_heads, config.head_dim
    q_rank, out_width, inter = config.q_lora_rank, config.o_groups * config.o_lora_rank, config.moe_intermediate_size
    spec = config.layer_plan[layer_id]
    top_k, ratio = config.num_experts_per_tok, spec.compress_ratio
    compressed = seq_len // ratio if ratio else 0
    experts = 1 + top_k  # the shared expert and every routed slot
    terms = {
        # RMSNorm inputs (recomputed in the backward) of attn_norm, q_norm, kv_norm
        "attention norms": a * (d + q_rank + hd),
        # PEFT's fp32 copies of the adapted inputs and the rank-r intermediates of wq_a, wkv, wq_b
        "LoRA inputs, wq_a wkv wq_b": FP32 * (2 * d + q_rank) + 3 * FP32 * rank,
        # q and the output, one log-sum-exp per head, the K=V rows (window and compressed), the slots
        "sparse attention": 2 * a * heads * hd
        + FP32 * heads
        + a * hd * (seq_len + compressed) / seq_len
        + INDEX * attended_slots(config, ratio, seq_len),
        "LoRA input, wo_b": FP32 * out_width + FP32 * rank,
        # each sub-block keeps its output and its mixes (comb, post, pre), the FFN's its input stream too
        "mHC": a * hc * d + 2 * a * d + 2 * FP32 * (hc * hc + 2 * hc),
        "ffn_norm": a * d,
        "router": 2 * FP32 * config.n_routed_experts + 3 * FP32 * top_k + FP32,
        # the SwiGLU's bf16 gate and up projections (recomputed in the backward), routing weights, slot order
        "SwiGLU": 2 * a * inter * experts + FP32 * top_k + 2 * INDEX * top_k,
        # fp32 copies of the experts' adapted inputs: gate and up cast x each, down its hidden activation
        "LoRA inputs, experts": FP32 * (2 * d + inter) * experts + 3 * FP32 * rank * experts,
    }
    if spec.is_kv_source:
        # ratio > 1: the fp32 projections and their softmax weights; then the latents' norm input
        terms["compressor"] = (2 * FP32 * hd if ratio > 1 else 0) + a * hd / ratio
        if spec.is_index_source:
            terms["compressor"] += a * config.index_head_dim / ratio  # the index keys' norm input
    if spec.has_engram:
        # wkv's keys and value, and the stream it writes (a new tensor, the sub-blocks' input)
        terms["Engram"] = a * (hc + 1) * d + a * hc * d
    return terms


# what the layer still holds while its sparse attention runs its backward (the FFN's and wo_b's are done by then)
ATTENTION_SIDE = ("attention norms", "LoRA inputs, wq_a wkv wq_b", "sparse attention", "compressor", "Engram")
# what it holds when its indexer scores (before the attention runs)
BEFORE_INDEXER = ("attention norms", "LoRA inputs, wq_a wkv wq_b", "compressor", "Engram")


def layer_constant_bytes(config) -> float:
    """Bytes a layer's forward keeps whatever the sequence length: fp32 copies of frozen bf16 weights the input
    gradient needs (``wo_a``'s grouped product, the router)."""
    return FP32 * (
        config.num_attention_heads * config.head_dim * config.o_lora_rank
        + config.n_routed_experts * config.hidden_size
    )


def layer_saved_bytes_per_token(config, layer_id: int, seq_len: int, rank: int = 16) -> float:
    """:func:`layer_saved_terms` summed."""
    return float(sum(layer_saved_terms(config, layer_id, seq_len, rank).values()))


def layer_peak_bytes(config, layer_id: int, seq_len: int, batch_size: int = 1, rank: int = 16) -> tuple[str, float]:
    """(moment, bytes) of the most a layer holds while it runs its forward again and its backward, on top of the
    checkpointed inputs: the largest of

    * the end of its forward: everything it saves, the gradient of its output already waiting, and mHC's expand
      forming its [hc, hc, D] fp32 products (the reference's arithmetic);
    * its sparse attention's backward: what the attention side saved, the gradients of the attention output and of
      the stream, and one query chunk's recomputation: fp32 q and output gradient (and the pair, one product), q's
      gradient, a block's keys and their gradients, the block's [H, k] probabilities and gradients, the fp32 K=V rows
      and their gradient;
    * its indexer (index sources): its queries, and the larger of their FP4 QDQ (emulated quantization: fp32
      temporaries of all the queries) and one query chunk's scores against every compressed row [C, heads, T] in
      fp32 while they are rounded to bf16.
    """
    a, hc, d, heads, hd = (
        ACTIVATION_BYTES,
        config.hc_mult,
        config.hidden_size,
        config.num_attention_heads,
        config.head_dim,
    )
    tokens = seq_len * batch_size
    spec = config.layer_plan[layer_id]
    ratio = spec.compress_ratio
    compressed = seq_len // ratio if ratio else 0
    chunk = min(config.query_chunk_size, seq_len) * batch_size
    block = min(64, attended_slots(config, ratio, seq_len))
    terms = layer_saved_terms(config, layer_id, seq_len, rank)
    constant = layer_constant_bytes(config)
    stream_grad = a * hc * d + FP32 * hc
    moments = {
        "the end of its forward (mHC's expand)": (sum(terms.values()) + stream_grad + FP32 * (hc * hc + hc) * d)
        * tokens
        + constant,
        "its sparse attention's backward": (
            sum(terms.get(k, 0) for k in ATTENTION_SIDE) + a * heads * hd + stream_grad
        )
        * tokens
        + FP32 * chunk * (3 * heads * hd + 2 * block * hd + 5 * heads * block)
        + 2 * FP32 * hd * (seq_len + compressed) * batch_size,
    }
    if spec.is_index_source and compressed:
        index_heads, index_dim = config.index_n_heads, config.index_head_dim
        index_q = a * index_heads * (index_dim + 1)  # its queries and head weights
        scores = 6 * chunk * index_heads * compressed
        # the FP4 QDQ of all its queries at once: five fp32 / int32 temporaries of their shape (codec.py)
        qdq = 5 * FP32 * tokens * index_heads * index_dim if config.emulate_quantization else 0
        moments["its indexer"] = (
            sum(terms.get(k, 0) for k in BEFORE_INDEXER) + a * heads * hd + index_q + stream_grad
        ) * tokens + max(scores, qdq)
    return max(moments.items(), key=lambda item: item[1])


def checkpointed_input_terms(config, seq_len: int) -> tuple[dict[str, float], dict[str, float]]:
    """Bytes per token the checkpointed layers' inputs hold: (per decoder layer, shared by the layers). Each layer
    keeps its input stream [hc, D] and pre-mix [hc], and its router the experts it chose (read by the bias
    balancing); the layers share the compressed context, the Engram rows and the rotations."""
    a, hc, d = ACTIVATION_BYTES, config.hc_mult, config.hidden_size
    per_layer = {"stream": a * hc * d + FP32 * hc, "routed expert ids": INDEX * config.num_experts_per_tok}
    plan = config.layer_plan
    columns = (config.engram_max_ngram_size - 1) * config.engram_n_heads * sum(spec.has_engram for spec in plan)
    # the Engram layers' table rows, gathered before the layers run, and their hash ids
    shared = {"Engram rows": columns * (a * config.engram_head_dim + INDEX), "compressed context": 0.0}
    for spec in plan:
        ratio = spec.compress_ratio
        if spec.is_kv_source:
            keys = config.index_head_dim if spec.is_index_source else 0
            shared["compressed context"] += a * (config.head_dim + keys) / ratio
        if spec.is_index_source:
            shared["compressed context"] += INDEX * min(config.index_topk, seq_len // ratio)
        if spec.is_candidate_source:
            blocks = -(-(seq_len // ratio) // config.candidate_block_size)
            shared["compressed context"] += INDEX * min(config.candidate_topk_blocks, blocks)
    kinds = {spec.is_compressed for spec in plan}
    shared["rotations"] = len(kinds) * FP32 * config.qk_rope_head_dim
    return per_layer, shared


@dataclass
class ActivationPeak:
    """The activation bytes of a step at its peak (see the module docstring), by term; ``moment`` names it, ``other``
    is the other candidate moment and its bytes; ``host_bytes`` what offloading puts in host memory."""

    moment: str
    terms: dict[str, float] = field(default_factory=dict)
    other: tuple[str, float] = ("", 0.0)
    host_bytes: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def activation_peak(
    config, seq_len: int, batch_size: int = 1, rank: int = 16, offload_activations: bool = False
) -> ActivationPeak:
    """The larger of the loss and the worst layer's backward (see the module docstring), in bytes."""
    tokens = seq_len * batch_size
    a, hc, d, n_layers = ACTIVATION_BYTES, config.hc_mult, config.hidden_size, config.num_hidden_layers
    per_layer, shared = checkpointed_input_terms(config, seq_len)
    layer_input, shared_inputs = sum(per_layer.values()) * tokens, sum(shared.values()) * tokens
    layer_ids = INDEX * config.num_experts_per_tok * tokens  # one layer's chosen experts: module state, on the device
    # held to the end of the backward: the embedding's output and the labels; to the loss's backward: the final
    # stream (the last collapse's input), the final norm's input and the LM head's fp32 copy of its input
    root = (a * d + INDEX) * tokens
    head = (a * hc * d + FP32 * hc + a * d + FP32 * d) * tokens

    def inputs_held(layers: int) -> float:
        """Checkpointed inputs on the device while ``layers`` layers (the lowest) still await their backward."""
        if offload_activations:  # only the layer running its backward has its inputs back
            return layer_ids * n_layers + (layer_input - layer_ids + shared_inputs) * min(layers, 1)
        return layer_input * layers + shared_inputs

    loss = ActivationPeak(
        "the loss",
        {
            "checkpointed layer inputs": inputs_held(0 if offload_activations else n_layers),
            "logits + loss": 3 * FP32 * config.vocab_size * tokens + root + head,
        },
    )
    layers = []
    for layer_id in range(n_layers):
        moment, held = layer_peak_bytes(config, layer_id, seq_len, batch_size, rank)
        layers.append(
            ActivationPeak(
                f"layer {layer_id}'s backward, {moment}",
                {
                    "checkpointed layer inputs": inputs_held(layer_id + 1),
                    "recomputed layer": held + root,
                },
            )
        )
    worst = max(layers, key=lambda peak: peak.total)
    peak, other = (worst, loss) if worst.total >= loss.total else (loss, worst)
    peak.other = (other.moment, other.total)
    if offload_activations:
        peak.host_bytes = (layer_input - layer_ids) * n_layers + shared_inputs  # a shared tensor is copied once
    return peak


__all__ = [
    "ActivationPeak",
    "activation_peak",
    "attended_slots",
    "checkpointed_input_terms",
    "layer_constant_bytes",
    "layer_saved_bytes_per_token",
    "layer_peak_bytes",
    "layer_saved_terms",
]
