"""The backbone against transformers' conventions: labels, padding, inputs_embeds, logits_to_keep, gradient
checkpointing, hidden states, save/load and the Auto classes, input errors, text-only configs, sparse MoE
dispatch and the quantization emulation switch. Tiny random models in fp32 on CPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

import modeling_dsv41  # noqa: F401  (registers the Auto classes)
from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM, DeepseekV41Model
from tiny_models import tiny_config, tiny_model

SEQ = 40  # > 2 × sliding_window (16), so windows slide and the indexer (top-8) really selects
EXPERTS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
PAD = 2  # the tiny preset's pad_token_id


@pytest.fixture(scope="module")
def model() -> DeepseekV41ForCausalLM:
    return tiny_model()


@pytest.fixture(scope="module")
def input_ids() -> torch.Tensor:
    return torch.randint(3, 500, (2, SEQ), generator=torch.Generator().manual_seed(1))


def logits_of(model, **inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


@pytest.fixture(scope="module")
def reference(model, input_ids):
    """The plain run every other path is compared with: ids only, all positions, hidden states."""
    with torch.no_grad():
        return model(input_ids=input_ids, output_hidden_states=True)


ALONE = 27  # real tokens of row 1 in the padding tests (odd: its last ratio-2 group is incomplete)


@pytest.fixture(scope="module")
def row1_alone(model, input_ids):
    """Row 1's first ``ALONE`` tokens run as a batch of one, without padding."""
    with torch.no_grad():
        return model(input_ids=input_ids[1:, :ALONE], output_hidden_states=True)


# ---------------------------------------------------------------------------------------------------
# labels and logits_to_keep
# ---------------------------------------------------------------------------------------------------
def test_loss_is_shifted_cross_entropy_ignoring_minus_100(model, input_ids, reference):
    labels = input_ids.clone()
    labels[0, :5] = -100
    labels[1, 30:] = -100
    with torch.no_grad():
        out = model(input_ids=input_ids, labels=labels)
    assert torch.equal(out.logits, reference.logits)
    # position t predicts token t + 1; the last position has no target
    logits = out.logits.double()
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    assert out.logits.dtype == torch.float32
    # same CE up to fp32 summation order (computed here in fp64)
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-6, atol=1e-6)


def test_logits_to_keep_int_and_tensor(model, input_ids, reference):
    # the fp32 LM head over 3 rows rather than 40 may take other GEMM blocking (measured: 1.8e-7 apart on a 0.8
    # logit scale); a wrong slice is off by O(0.1)
    close = dict(rtol=0, atol=1e-6)
    full = reference.logits
    last3 = logits_of(model, input_ids=input_ids, logits_to_keep=3)
    assert last3.shape == (2, 3, full.shape[-1])
    torch.testing.assert_close(last3, full[:, -3:], **close)
    index = torch.tensor([0, 17, SEQ - 1])
    picked = logits_of(model, input_ids=input_ids, logits_to_keep=index)
    torch.testing.assert_close(picked, full[:, index], **close)


def test_return_dict_false_gives_a_tuple(model, input_ids, reference):
    with torch.no_grad():
        out = model(input_ids=input_ids, return_dict=False)
    assert isinstance(out, tuple)
    assert torch.equal(out[0], reference.logits)


# ---------------------------------------------------------------------------------------------------
# padding: every real token computes what it computes in its row alone
# ---------------------------------------------------------------------------------------------------
# A row alone is a batch of one; GEMMs of another batch size may block differently, so the comparison
# allows fp32 rounding noise (observed ≤ 3e-7 on logits of magnitude ~0.7), orders of magnitude below any
# leak of padding into a real token.
FP32_NOISE = {"rtol": 1e-5, "atol": 1e-5}


def test_right_padding_changes_no_real_token(model, input_ids, reference, row1_alone):
    padded = input_ids.clone()
    padded[1, ALONE:] = PAD
    mask = torch.ones_like(padded)
    mask[1, ALONE:] = 0
    batch = logits_of(model, input_ids=padded, attention_mask=mask)
    torch.testing.assert_close(batch[1, :ALONE], row1_alone.logits[0], **FP32_NOISE)
    torch.testing.assert_close(batch[0], reference.logits[0], **FP32_NOISE)


def test_left_padding_matches_each_row_alone(model, input_ids, reference, row1_alone):
    start = SEQ - ALONE
    padded = torch.full_like(input_ids, PAD)
    padded[0] = input_ids[0]
    padded[1, start:] = input_ids[1, :ALONE]
    mask = torch.ones_like(padded)
    mask[1, :start] = 0
    with torch.no_grad():
        out = model(input_ids=padded, attention_mask=mask, output_hidden_states=True)
    torch.testing.assert_close(out.logits[1, start:], row1_alone.logits[0], **FP32_NOISE)
    torch.testing.assert_close(out.logits[0], reference.logits[0], **FP32_NOISE)
    # hidden states come back in the caller's (left-padded) layout too
    torch.testing.assert_close(out.hidden_states[-1][1, start:], row1_alone.hidden_states[-1][0], **FP32_NOISE)


# ---------------------------------------------------------------------------------------------------
# inputs_embeds
# ---------------------------------------------------------------------------------------------------
def test_inputs_embeds_with_ids_for_engram_equals_ids_path(model, input_ids, reference):
    embeds = model.get_input_embeddings()(input_ids)
    from_embeds = logits_of(model, input_ids=input_ids, inputs_embeds=embeds)
    assert torch.equal(from_embeds, reference.logits)
    # the embeddings really are used: changing them changes the result
    assert not torch.equal(logits_of(model, input_ids=input_ids, inputs_embeds=embeds * 2), from_embeds)


def test_inputs_embeds_alone_with_engram_is_a_clear_error(model, input_ids):
    embeds = model.get_input_embeddings()(input_ids)
    with pytest.raises(ValueError, match="Engram hashes token ids"):
        model(inputs_embeds=embeds)


def test_inputs_embeds_alone_without_engram():
    model = tiny_model(tiny_config(engram_layer_ids=[], engram_num_embeddings=[]))
    ids = torch.randint(3, 500, (1, SEQ))
    embeds = model.get_input_embeddings()(ids)
    assert torch.equal(logits_of(model, inputs_embeds=embeds), logits_of(model, input_ids=ids))


def test_no_inputs_is_a_clear_error(model):
    with pytest.raises(ValueError, match="input_ids or inputs_embeds"):
        model()


# ---------------------------------------------------------------------------------------------------
# gradient checkpointing and hidden states
# ---------------------------------------------------------------------------------------------------
def loss_and_grads(model, input_ids):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    return loss.detach(), grads


@pytest.fixture(scope="module")
def qdq_loss_and_grads(input_ids):
    return loss_and_grads(tiny_model(), input_ids)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_gives_same_loss_and_grads(input_ids, qdq_loss_and_grads, use_reentrant):
    loss, grads = qdq_loss_and_grads
    model = tiny_model()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    loss_ckpt, grads_ckpt = loss_and_grads(model, input_ids)
    assert torch.equal(loss, loss_ckpt)
    # reentrant checkpointing back-propagates zeros into every float output of a layer, so the index keys (which
    # only feed a top-k) get zero gradients instead of none: the same update
    extra = grads_ckpt.keys() - grads.keys()
    assert grads.keys() <= grads_ckpt.keys() and all(".attn.indexer." in name for name in extra)
    assert all(not grads_ckpt[name].any() for name in extra)
    assert use_reentrant or not extra
    # recomputation replays the same ops, so the gradients are bit-identical, including those that reach
    # layers 0-2 only through the compressed KV that layer 3 hands to layers 4 and 5 (reentrant checkpointing
    # tracks tensor arguments only: the layers pass that KV as one)
    for name, grad in grads.items():
        assert torch.equal(grads_ckpt[name], grad), name


def test_output_hidden_states_are_what_each_sub_block_reads(model, input_ids, reference):
    """transformers' layout, [B, S, D] per layer: the residual copies collapsed with the weights the next
    sub-block (or the final norm) collapses them with, so the last one, normed, is last_hidden_state."""
    assert 2 not in model.config.text_config.engram_layer_ids
    text = model.config.text_config
    assert len(reference.hidden_states) == text.num_hidden_layers + 1
    for hidden in reference.hidden_states:
        assert hidden.shape == (2, SEQ, text.hidden_size)
    assert torch.equal(reference.hidden_states[0], model.model.embed(input_ids))
    with torch.no_grad():
        base = model.model(input_ids=input_ids, output_hidden_states=True)
        seen = []
        # layer 2 has no Engram, which would add to the copies before the collapse
        hook = model.model.layers[2].attn_norm.register_forward_hook(lambda m, args, out: seen.append(args[0]))
        try:
            model.model(input_ids=input_ids)
        finally:
            hook.remove()
    torch.testing.assert_close(base.last_hidden_state, model.model.norm(base.hidden_states[-1]), rtol=0, atol=0)
    torch.testing.assert_close(seen[0], base.hidden_states[2], rtol=0, atol=0)  # layer 2's attention input
    with torch.no_grad():
        base = model.model(input_ids=input_ids[:, :8])
    assert base.hidden_states is None
    assert base.last_hidden_state.shape == (2, 8, text.hidden_size)


# ---------------------------------------------------------------------------------------------------
# save / load and the Auto classes
# ---------------------------------------------------------------------------------------------------
FP32_KEPT = ("hc_attn_fn", "hc_ffn_base", "attn.attn_sink", "gate.bias", "gate.bias_vl", "lm_head.weight")


def assert_state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def test_save_pretrained_round_trip_is_bit_exact(tmp_path, model, input_ids, reference):
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    stored = load_file(tmp_path / "model.safetensors")  # the released names, as transformers' models save
    assert torch.equal(stored["engram_hasher.token_map"], model.model.engram_hasher.token_map)
    loaded = DeepseekV41ForCausalLM.from_pretrained(tmp_path).eval()
    assert_state_equal(loaded.state_dict(), model.state_dict())
    assert loaded.model.engram_hasher.has_token_map
    # the derived (non-persistent) hash constants are rebuilt, not left empty
    for name in ("primes", "multipliers", "offsets"):
        assert torch.equal(getattr(loaded.model.engram_hasher, name), getattr(model.model.engram_hasher, name)), name
    assert torch.equal(logits_of(loaded, input_ids=input_ids), reference.logits)


def test_bf16_load_keeps_fp32_params_and_round_trips(tmp_path, model):
    model.save_pretrained(tmp_path / "fp32")
    bf16 = DeepseekV41ForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16)
    original = model.state_dict()
    for name, tensor in bf16.state_dict().items():
        if not tensor.is_floating_point():
            assert torch.equal(tensor, original[name]), name
        elif any(name.endswith(k) or f".{k}" in name for k in FP32_KEPT):
            assert tensor.dtype == torch.float32, name
            assert torch.equal(tensor, original[name]), name
    assert bf16.model.layers[0].attn.wq_a.weight.dtype == torch.bfloat16
    assert bf16.model.layers[1].ffn.gate.bias_vl.dtype == torch.float32
    # the ratio-2 compressor pools in fp32 (reference dtypes); the ratio-1 one is a plain projection
    assert bf16.model.layers[1].attn.compressor.wkv.weight.dtype == torch.float32
    assert torch.equal(
        bf16.model.layers[1].attn.compressor.wgate.weight, model.model.layers[1].attn.compressor.wgate.weight
    )
    assert bf16.model.layers[3].attn.compressor.wkv.weight.dtype == torch.bfloat16
    bf16.save_pretrained(tmp_path / "bf16")
    again = DeepseekV41ForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert_state_equal(again.state_dict(), bf16.state_dict())


def test_auto_classes_resolve_to_ours(tmp_path, model):
    model.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config) is DeepseekV41Config
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)) is DeepseekV41ForCausalLM
    assert type(AutoModelForImageTextToText.from_pretrained(tmp_path)) is DeepseekV41ForCausalLM
    backbone = AutoModel.from_pretrained(tmp_path, experts_implementation="grouped_mm")
    assert type(backbone) is DeepseekV41Model
    assert backbone.layers[0].ffn.experts.config._experts_implementation == "grouped_mm"  # reaches the experts
    assert torch.equal(backbone.layers[0].attn.wq_a.weight, model.model.layers[0].attn.wq_a.weight)


# ---------------------------------------------------------------------------------------------------
# input errors
# ---------------------------------------------------------------------------------------------------
def image_inputs(vit_grid=(9, 13), seq=SEQ):
    """One image per row of a batch of one: ids, pixel values, grid and token types of a well-formed span."""
    tok_h, tok_w = -(-vit_grid[0] // 3), -(-vit_grid[1] // 3)
    span = [0] + ([1] * tok_w + [2]) * tok_h + [3]
    types = torch.full((1, seq), -1)
    types[0, 4 : 4 + len(span)] = torch.tensor(span)
    ids = torch.randint(3, 500, (1, seq))
    ids[types >= 0] = 510
    pixels = torch.randn(vit_grid[0] * vit_grid[1], 3, 14, 14)
    return {
        "input_ids": ids,
        "pixel_values": pixels,
        "image_grid_hw": torch.tensor([vit_grid]),
        "image_token_types": types,
    }


def test_image_inputs_run(model):
    inputs = image_inputs()
    out = logits_of(model, **inputs)
    assert out.shape == (1, SEQ, model.config.text_config.vocab_size) and torch.isfinite(out).all()
    # the image reaches the text: other pixels, other logits after the span
    other = logits_of(model, **(inputs | {"pixel_values": inputs["pixel_values"] + 1}))
    assert not torch.equal(other[0, -1], out[0, -1])


def test_images_without_vision_config_is_a_clear_error():
    config = tiny_config(vision=False)
    model = tiny_model(config)
    with pytest.raises(ValueError, match="no vision_config"):
        model(**image_inputs())


@pytest.mark.parametrize("missing", ["image_grid_hw", "image_token_types"])
def test_pixel_values_without_grid_or_types_is_a_clear_error(model, missing):
    inputs = image_inputs()
    inputs.pop(missing)
    with pytest.raises(ValueError, match="image_grid_hw and image_token_types"):
        model(**inputs)


def test_image_too_large_for_max_image_tokens_is_a_clear_error(model):
    # a 30×30 patch grid → 10×10 LM tokens → 10·11 + 2 = 112 positions > max_image_tokens (64)
    inputs = image_inputs()
    inputs["pixel_values"] = torch.randn(900, 3, 14, 14)
    inputs["image_grid_hw"] = torch.tensor([[30, 30]])
    with pytest.raises(ValueError, match="max_image_tokens"):
        model(**inputs)


# ---------------------------------------------------------------------------------------------------
# text-only config
# ---------------------------------------------------------------------------------------------------
def test_text_only_config_builds_and_runs(model, input_ids, reference):
    config = tiny_config(vision=False)
    assert not config.has_vision
    text_only = tiny_model(config)
    state = text_only.state_dict()
    assert not any("bias_vl" in k or k.startswith(("model.vision.", "model.aligner.", "model.image_")) for k in state)
    assert all(layer.ffn.gate.bias_vl is None for layer in text_only.model.layers)
    # with the multimodal model's text weights it computes the multimodal model's text logits
    text_only.load_state_dict({k: v for k, v in model.state_dict().items() if k in state})
    with torch.no_grad():
        out = text_only(input_ids=input_ids, labels=input_ids)
    assert torch.isfinite(out.loss)
    assert torch.equal(out.logits, reference.logits)
    # token types alone (embeddings merged by the caller) need no vision tower either
    types = torch.full_like(input_ids, -1)
    assert torch.equal(logits_of(text_only, input_ids=input_ids, image_token_types=types), out.logits)


# ---------------------------------------------------------------------------------------------------
# MoE: only the chosen experts run
# ---------------------------------------------------------------------------------------------------
def test_moe_runs_only_selected_experts(input_ids):
    """An expert no token chose never runs: with its weights NaN (which any dense or masked computation would
    spread) every implementation still gives finite outputs, and its weights get an all-zero gradient."""
    model = tiny_model()
    moe = model.model.layers[2].ffn
    with torch.no_grad():
        moe.gate.bias[3] = -1e4  # expert 3 is never chosen
        moe.experts.gate_up_proj[3] = float("nan")
        moe.experts.down_proj[3] = float("nan")
    for implementation in EXPERTS_IMPLEMENTATIONS:
        model.set_experts_implementation(implementation)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        routed = torch.bincount(moe.last_expert_indices.flatten(), minlength=moe.n_routed_experts)
        assert routed[3] == 0 and routed.sum() == input_ids.numel() * moe.gate.top_k
        assert torch.isfinite(loss), implementation
        for grad in (moe.experts.gate_up_proj.grad, moe.experts.down_proj.grad):
            assert torch.equal(grad[3], torch.zeros_like(grad[3])), implementation
            assert torch.isfinite(grad).all() and grad.abs().sum() > 0, implementation


def _expert(experts, e: int, x: torch.Tensor) -> torch.Tensor:
    """Routed expert ``e`` written out from the released per-expert view: w1 = gate rows, w3 = up rows, w2 = down,
    with the training clamps (up to ±limit, gate above at limit)."""
    inter, limit = experts.intermediate_dim, experts.swiglu_limit
    w1, w3, w2 = experts.gate_up_proj[e, :inter], experts.gate_up_proj[e, inter:], experts.down_proj[e]
    return (F.silu((x @ w1.T).clamp(max=limit)) * (x @ w3.T).clamp(-limit, limit)) @ w2.T


def test_moe_equals_dense_mixture_of_selected_experts():
    """The sparse dispatch computes Σ_k w_k · expert_k(x) + shared(x), token by token."""
    model = tiny_model()
    moe = model.model.layers[0].ffn
    x = 3 * torch.randn(2, 7, model.config.text_config.hidden_size)  # large enough for the clamps to act
    with torch.no_grad():
        out = moe(x)
        flat = x.reshape(-1, x.shape[-1])
        _, weights, indices = moe.gate(flat)
        expected = moe.shared_experts(flat)
        for k in range(indices.shape[1]):
            expected = expected + torch.stack(
                [w * _expert(moe.experts, e, row) for row, e, w in zip(flat, indices[:, k], weights[:, k])]
            )
    torch.testing.assert_close(out.reshape(-1, x.shape[-1]), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# quantization emulation
# ---------------------------------------------------------------------------------------------------
def test_emulate_quantization_changes_the_result_and_trains_straight_through(model, input_ids, qdq_loss_and_grads):
    assert model.config.text_config.emulate_quantization  # the default
    plain = tiny_model(tiny_config(emulate_quantization=False))
    assert_state_equal(model.state_dict(), plain.state_dict())  # same seed, same weights
    assert not torch.equal(logits_of(model, input_ids=input_ids), logits_of(plain, input_ids=input_ids))

    _, grads = qdq_loss_and_grads  # a training step of the same QDQ model
    # wkv feeds the FP8 window KV on every layer; the ratio-2 compressor feeds the FP4 compressed KV
    names = [f"model.layers.{i}.attn.wkv.weight" for i in range(6)]
    names += [f"model.layers.1.attn.compressor.{w}.weight" for w in ("wkv", "wgate")]
    names += ["model.layers.3.attn.compressor.wkv.weight"]
    for name in names:
        assert name in grads, name
        assert torch.isfinite(grads[name]).all() and grads[name].abs().sum() > 0, name


# ---------------------------------------------------------------------------------------------------
# routed experts: implementations, gradients, router biases
# ---------------------------------------------------------------------------------------------------
def _experts_case(dtype: torch.dtype, implementation: str, tokens: int = 24):
    """Fused experts of the tiny text config (weights large enough for both SwiGLU clamps to act), fixed routing,
    and the output and weight gradients of ``implementation``."""
    from modeling_dsv41.moe import DeepseekV41Experts

    text = copy.deepcopy(tiny_config().text_config)
    text._experts_implementation = implementation
    torch.manual_seed(0)
    experts = DeepseekV41Experts(text)
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=1.0)
        experts.down_proj.normal_(std=0.2)
    experts.to(dtype)
    g = torch.Generator().manual_seed(1)
    x = (2 * torch.randn(tokens, text.hidden_size, generator=g)).to(dtype)
    top_k = torch.rand(tokens, text.n_routed_experts, generator=g).topk(text.num_experts_per_tok).indices
    weights = torch.rand(tokens, text.num_experts_per_tok, generator=g)
    out = experts(x, top_k, weights)
    out.float().square().sum().backward()
    return experts, x, out.float(), experts.gate_up_proj.grad.float(), experts.down_proj.grad.float()


@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_implementations_agree_with_eager(implementation, dtype):
    """transformers' kernels scale by the routing weight after ``w2`` and sum in another order than the reference's
    eager loop, so they agree to rounding: fp32 to 1e-5 relative (measured: 4e-7); bf16 to 6 bf16 ulps (2^-8
    relative each) of the largest value: rounding the activation before ``w2`` without rather than with the routing
    weight, measured at 1.2 ulps on the output and 3.1 on the weight gradients (margin for other CPUs' kernels)."""
    experts, x, out, gate_up_grad, down_grad = _experts_case(dtype, "eager")
    inter, limit = experts.intermediate_dim, experts.swiglu_limit
    gate_up = x.float() @ experts.gate_up_proj.float().transpose(1, 2)  # [E, N, 2I]: both clamps really act
    assert (gate_up[..., :inter] > limit).any() and (gate_up[..., inter:].abs() > limit).any()
    _, _, other, other_gate_up_grad, other_down_grad = _experts_case(dtype, implementation)
    for ours, theirs in ((out, other), (gate_up_grad, other_gate_up_grad), (down_grad, other_down_grad)):
        if dtype == torch.float32:
            torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5 * ours.abs().max().item())
        else:
            torch.testing.assert_close(theirs, ours, rtol=0, atol=6 * 2**-8 * ours.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_runs_torchs_grouped_gemm_on_cpu(dtype):
    """On CPU, transformers' ``grouped_mm`` reaches torch's own grouped GEMM (torch ≥ 2.9 has a CPU kernel), forward
    and backward, rather than its per-expert fallback."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        _experts_case(dtype, "grouped_mm")
    calls = {event.key: event.count for event in profile.key_averages()}
    assert calls.get("aten::_grouped_mm", 0) >= 2 + 2  # gate_up and down in the forward, and their input gradients
    assert not [name for name in calls if "fallback" in name]


def test_model_experts_implementation_switch_agrees_with_eager(model, input_ids, reference):
    assert model.config.get_text_config()._experts_implementation == "eager"  # the reference's computation by default
    try:
        for implementation in ("batched_mm", "grouped_mm"):
            model.set_experts_implementation(implementation)
            assert model.config.get_text_config()._experts_implementation == implementation
            # fp32 everywhere: only the summation order differs
            torch.testing.assert_close(logits_of(model, input_ids=input_ids), reference.logits, rtol=1e-5, atol=1e-5)
    finally:
        model.set_experts_implementation("eager")


def test_every_expert_tensor_gets_a_gradient_whatever_the_data(input_ids):
    """One token picks top-k of the experts per layer, the full batch picks them all: the same tensors get
    gradients (zeros for experts nobody chose), so DDP and optimizers see a fixed set of gradients."""
    model = tiny_model()
    grad_sets = []
    for batch in (input_ids, input_ids[:1, :1]):
        model.zero_grad(set_to_none=True)
        model(input_ids=batch, labels=batch).loss.backward()
        grad_sets.append({n for n, p in model.named_parameters() if p.grad is not None})
    assert grad_sets[0] == grad_sets[1]
    experts = model.model.layers[0].ffn.experts
    unused = set(range(experts.num_experts)) - set(model.model.layers[0].ffn.last_expert_indices.flatten().tolist())
    assert unused  # the one-token batch really left experts out
    assert all(torch.equal(experts.down_proj.grad[e], torch.zeros_like(experts.down_proj.grad[e])) for e in unused)
    assert {f"model.layers.{i}.ffn.experts.{t}" for i in range(6) for t in ("gate_up_proj", "down_proj")} <= grad_sets[
        1
    ]


def test_router_biases_are_saved_fp32_buffers(tmp_path, model):
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    for name in ("model.layers.0.ffn.gate.bias", "model.layers.0.ffn.gate.bias_vl"):
        assert name not in params and buffers[name].dtype == torch.float32
    with torch.no_grad():
        model.model.layers[0].ffn.gate.bias.copy_(torch.arange(4.0) / 3)
    try:
        model.save_pretrained(tmp_path)
        stored = load_file(tmp_path / "model.safetensors")  # the released names, as transformers' models save
        assert torch.equal(stored["layers.0.ffn.gate.bias"], torch.arange(4.0) / 3)
        bf16 = DeepseekV41ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
        assert bf16.model.layers[0].ffn.gate.bias.dtype == torch.float32
        assert torch.equal(bf16.model.layers[0].ffn.gate.bias, torch.arange(4.0) / 3)
    finally:
        with torch.no_grad():
            model.model.layers[0].ffn.gate.bias.zero_()


# ---------------------------------------------------------------------------------------------------
# mHC collapse / expand: the reference's forward, a matmul backward
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hyper_connection_mixing_gradients_match_autograd_of_the_formula(dtype):
    """collapse and expand run the reference's broadcast products forward (same bits) and small matmuls backward:
    the gradients agree with autograd of the plain formula to the rounding of a 4-term sum (fp32: 1e-6 relative;
    bf16 inputs' gradients: one bf16 ulp, 2^-8 relative, of the largest, as the two sums may round either way)."""
    from modeling_dsv41.hyper_connections import DeepseekV41HyperConnection as HC

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 4, 32, generator=g).to(dtype)
    out = torch.randn(2, 5, 32, generator=g).to(dtype)
    pre, post = torch.rand(2, 5, 4, generator=g), torch.rand(2, 5, 4, generator=g)
    comb = torch.rand(2, 5, 4, 4, generator=g)
    formulas = {
        "collapse": (HC.collapse, lambda x, pre: (pre.unsqueeze(-1) * x.float()).sum(dim=2).to(x.dtype), (x, pre)),
        "expand": (
            HC.expand,
            lambda out, res, post, comb: (
                post.unsqueeze(-1) * out.unsqueeze(-2) + (comb.unsqueeze(-1) * res.unsqueeze(-2)).sum(dim=2)
            ).to(out.dtype),
            (out, x, post, comb),
        ),
    }
    for name, (ours, formula, inputs) in formulas.items():
        results = []
        for function in (ours, formula):
            leaves = [t.clone().requires_grad_() for t in inputs]
            result = function(*leaves)
            result.float().mul(torch.linspace(-1, 1, result.shape[-1])).sum().backward()
            results.append((result.detach(), [leaf.grad for leaf in leaves]))
        (value, grads), (expected_value, expected_grads) = results
        assert torch.equal(value, expected_value), name
        for grad, expected in zip(grads, expected_grads):
            assert grad.dtype == expected.dtype, name
            ulp = 2**-8 if grad.dtype == torch.bfloat16 else 1e-6
            torch.testing.assert_close(grad, expected, rtol=0, atol=ulp * expected.abs().max().item())


def plain_sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The reference's Sinkhorn on comb logits [hc, hc, N], for autograd to differentiate."""
    comb = torch.exp(comb - comb.amax(dim=1, keepdim=True))
    comb = comb / comb.sum(dim=1, keepdim=True) + eps
    comb = comb / (comb.sum(dim=0, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=0, keepdim=True) + eps)
    return comb


@pytest.mark.parametrize("iters", [1, 2, 20])
def test_sinkhorn_gradients_match_autograd_of_the_formula(iters):
    """The Sinkhorn function runs the reference's ops forward (same bits) and a four-op step backward from its saved
    normalisers: its gradient agrees with autograd of the plain formula to fp32 rounding, both measured against the
    formula's fp64 gradient (ours may not be further off than autograd's own fp32 gradient, plus 1e-6 of the
    largest)."""
    from modeling_dsv41.hyper_connections import _Sinkhorn

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 4, 300, generator=g) * 3
    probe = torch.randn(4, 4, 300, generator=g)
    results = {}
    for name, dtype, function in (
        ("ours", torch.float32, lambda t: _Sinkhorn.apply(t, iters, 1e-6)),
        ("autograd", torch.float32, lambda t: plain_sinkhorn(t, iters, 1e-6)),
        ("fp64", torch.float64, lambda t: plain_sinkhorn(t, iters, 1e-6)),
    ):
        leaf = logits.to(dtype, copy=True).requires_grad_()
        out = function(leaf)
        (out * probe.to(dtype)).sum().backward()
        results[name] = (out.detach(), leaf.grad)
    assert torch.equal(results["ours"][0], results["autograd"][0])
    exact = results["fp64"][1]
    our_error = (results["ours"][1].double() - exact).abs().max()
    autograd_error = (results["autograd"][1].double() - exact).abs().max()
    assert our_error <= autograd_error + 1e-6 * exact.abs().max(), (our_error, autograd_error)


def test_hyper_connection_mixing_compiles_in_one_graph():
    """The custom-backward collapse / expand do not break a ``torch.compile(fullgraph=True)`` graph (compiled decode),
    with or without gradients."""
    from modeling_dsv41.hyper_connections import DeepseekV41HyperConnection as HC

    def mix(out, residual, post, comb, pre):
        return HC.collapse(HC.expand(out, residual, post, comb), pre)

    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 4, 8, generator=g)]
    inputs += [torch.rand(2, 3, 4, generator=g), torch.rand(2, 3, 4, 4, generator=g), torch.rand(2, 3, 4, generator=g)]
    compiled = torch.compile(mix, backend="eager", fullgraph=True)  # fullgraph: any graph break raises
    with torch.no_grad():
        assert torch.equal(compiled(*inputs), mix(*inputs))
    leaves = [t.clone().requires_grad_() for t in inputs]
    compiled(*leaves).sum().backward()
    assert all(leaf.grad is not None for leaf in leaves)
