"""Released checkpoints in their native precision (modeling_dsv41/released/native_precision.py): FP8 Linears and FP4
experts kept as stored through transformers' fine-grained FP8 quantization, computed weight-only on the CPU."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

import modeling_dsv41  # noqa: F401  (registers the Auto classes)
from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41 import codec
from modeling_dsv41.numerics import reference_numerics
from modeling_dsv41.released import native_precision
from modeling_dsv41.released.native_precision import WeightOnlyFP4Experts, WeightOnlyFP8Linear
from modeling_dsv41.released.reference_gemms import DequantizedFP8Linear
from modeling_dsv41.released.writing import save_released_checkpoint
from reference_fixture import QUANT_FORMAT_TEXT, stub_tokenizer

# a two-layer text model with every released storage kind: FP8 attention / indexer / shared-expert Linears, an FP8
# `wo_a` and Engram `wkv` (dequantized on load), packed FP4 experts, FP8 Engram tables
TEXT = QUANT_FORMAT_TEXT


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(DeepseekV41Config(text_config=TEXT)).to(torch.bfloat16)
    folder = tmp_path_factory.mktemp("released")
    save_released_checkpoint(model, folder, max_shard_bytes=1 << 20)
    stub_tokenizer().save(str(folder / "tokenizer.json"))
    stored = {}
    for shard in folder.glob("*.safetensors"):
        stored.update(load_file(shard))
    return folder, stored


@pytest.fixture(scope="module")
def native(released):
    return DeepseekV41ForCausalLM.from_pretrained(released[0])


@pytest.fixture(scope="module")
def dequantized(released):
    return DeepseekV41ForCausalLM.from_pretrained(
        released[0], quantization_config=FineGrainedFP8Config(dequantize=True)
    )


def test_a_released_folder_implies_fine_grained_fp8(native):
    config = native.config.quantization_config
    assert (config.scale_fmt, config.expert_dtype, tuple(config.weight_block_size)) == ("ue8m0", "fp4", (32, 32))
    assert not config.dequantize and native.is_quantized
    # saved as transformers' own fine-grained FP8 method
    assert native.config.to_dict()["quantization_config"]["quant_method"] == "fp8"
    layer = native.model.layers[1]
    for name in ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "attn.indexer.wq_b", "ffn.shared_experts.w2"):
        assert isinstance(layer.get_submodule(name), FP8Linear), name
    assert isinstance(layer.ffn.experts, FP8Experts)
    # stored in bf16 by the release, or block-diagonal (wo_a): plain
    for name in ("attn.indexer.wk", "attn.indexer.weights_proj"):
        assert type(layer.get_submodule(name)) is nn.Linear, name
    # stored in FP8 but read raw by the model (its weight's dtype): dequantized, computing as the reference's
    # fp8_gemm in reference numerics
    assert type(layer.engram.wkv) is DequantizedFP8Linear and layer.engram.wkv.weight.dtype == torch.bfloat16
    assert layer.attn.wo_a.weight.dtype == torch.bfloat16 and native.lm_head.weight.dtype == torch.float32


def test_quantized_tensors_are_kept_as_stored(native, released):
    _, stored = released
    layer = native.model.layers[1]
    assert layer.attn.wq_b.weight.dtype == torch.float8_e4m3fn
    assert layer.attn.wq_b.weight_scale_inv.dtype == torch.float8_e8m0fnu
    assert torch.equal(layer.attn.wq_b.weight.view(torch.uint8), stored["layers.1.attn.wq_b.weight"].view(torch.uint8))
    assert torch.equal(
        layer.attn.wq_b.weight_scale_inv.view(torch.uint8), stored["layers.1.attn.wq_b.scale"].view(torch.uint8)
    )
    experts, inter = layer.ffn.experts, TEXT["moe_intermediate_size"]
    for e in range(TEXT["n_routed_experts"]):
        for w, rows in (("w1", slice(None, inter)), ("w3", slice(inter, None))):
            assert torch.equal(experts.gate_up_proj[e, rows], stored[f"layers.1.ffn.experts.{e}.{w}.weight"])
            assert torch.equal(
                experts.gate_up_proj_scale_inv[e, rows].view(torch.uint8),
                stored[f"layers.1.ffn.experts.{e}.{w}.scale"].view(torch.uint8),
            )
        assert torch.equal(experts.down_proj[e], stored[f"layers.1.ffn.experts.{e}.w2.weight"])


def test_quantized_modules_hold_the_stored_bytes(native, dequantized, released):
    """The FP8 Linears and FP4 experts take exactly their checkpoint bytes (weights and scales), against 2 bytes an
    element dequantized. (The whole model is not near its stored size at this width: embeddings, the fp32 head and
    the Engram tables dominate; benchmarks/loading.py measures a stand-in where experts dominate as in the release.)"""
    _, stored = released
    native_bytes, stored_bytes, dequantized_bytes = 0, 0, 0
    for name, module in native.named_modules():
        if isinstance(module, (FP8Linear, FP8Experts)):
            native_bytes += sum(p.numel() * p.element_size() for p in module.parameters())
            dequantized_bytes += sum(
                p.numel() * p.element_size() for p in dequantized.get_submodule(name).parameters()
            )
            prefix = name.removeprefix("model.")
            stored_bytes += sum(
                t.numel() * t.element_size() for key, t in stored.items() if key.startswith(prefix + ".")
            )
    assert native_bytes == stored_bytes
    assert native_bytes < 0.4 * dequantized_bytes, (native_bytes, dequantized_bytes)


def test_native_logits_equal_the_dequantized_path_on_cpu(native, dequantized):
    """Bit-exact, not within a tolerance: the weight-only modules dequantize with the loader's own function into the
    same dtype, and then run the same products on the same shapes, so every value is the same."""
    ids = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = native(ids).logits, dequantized(ids).logits
    assert torch.equal(ours, theirs)
    tokens = native.generate(ids[:1, :12], max_new_tokens=6, do_sample=False)
    assert torch.equal(tokens, dequantized.generate(ids[:1, :12], max_new_tokens=6, do_sample=False))


def test_only_the_selected_experts_are_dequantized(native, monkeypatch):
    experts = native.model.layers[0].ffn.experts
    assert isinstance(experts, WeightOnlyFP4Experts)
    read = []
    original = codec.dequantize_released_weight

    def owner(weight: torch.Tensor) -> int:
        """The expert whose stored bytes ``weight`` (a slice of its rows) lies in."""
        for e in range(experts.num_experts):
            for stored in (experts.gate_up_proj[e], experts.down_proj[e]):
                start = stored.data_ptr()
                if start <= weight.data_ptr() < start + stored.numel() * stored.element_size():
                    return e
        raise AssertionError("dequantized a tensor that is no expert's")

    def recording(weight, scale, columns, dtype):
        read.append(owner(weight))
        return original(weight, scale, columns, dtype)

    monkeypatch.setattr(native_precision, "dequantize_released_weight", recording)
    hidden = torch.randn(5, TEXT["hidden_size"], dtype=torch.bfloat16)
    index = torch.tensor([[1, 3]] * 5)
    with torch.no_grad():
        out = experts(hidden, index, torch.full((5, 2), 0.5))
    assert read == [1, 1, 1, 3, 3, 3] and out.shape == (5, TEXT["hidden_size"])  # gate rows, up rows, down


def test_a_decode_step_of_the_fp4_experts_dequantizes_the_chosen_ones_without_reading_back(native, dequantized):
    """No more slots than experts (decoding): each slot's expert is dequantized from its gathered bytes, with no value
    read back (the loop over experts with tokens reads their counts), and computes what the dequantized model's
    experts compute, bit for bit (the same dequantized values in the same per-slot products)."""
    from benchmarks.op_counts import StepCounter

    experts = native.model.layers[0].ffn.experts
    hidden = torch.randn(1, TEXT["hidden_size"], dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    index, weights = torch.tensor([[3, 1]]), torch.tensor([[0.75, 0.25]])
    with torch.no_grad(), StepCounter() as counter:
        out = experts(hidden, index, weights)
    assert dict(counter.count.syncs) == {}
    with torch.no_grad():
        assert torch.equal(out, dequantized.model.layers[0].ffn.experts(hidden, index, weights))


def test_the_input_gets_a_gradient_through_a_weight_only_linear(native):
    linear = native.model.layers[0].attn.wq_a
    assert isinstance(linear, WeightOnlyFP8Linear)
    x = torch.randn(3, TEXT["hidden_size"], dtype=torch.bfloat16, requires_grad=True)
    linear(x).float().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert linear.weight.grad is None  # frozen, as transformers' FP8Linear


def _trainable_gradients(model, ids: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """Gradient of every parameter that requires one (None for those the loss does not reach, e.g. the indexer)."""
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.fixture(scope="module")
def native_fp32(released):
    return DeepseekV41ForCausalLM.from_pretrained(released[0], dtype=torch.float32)


@pytest.fixture(scope="module")
def dequantized_fp32(released):
    config = FineGrainedFP8Config(dequantize=True)
    return DeepseekV41ForCausalLM.from_pretrained(released[0], dtype=torch.float32, quantization_config=config)


def test_gradients_through_the_native_model_equal_the_dequantized_models(native_fp32, dequantized_fp32):
    """Frozen quantized bases with exact gradients: backward through a weight-only module is backward through the
    dequantized weight it computes with, so the gradient of every parameter left trainable (the embedding below all
    layers, norms, router, mHC, ``wo_a``, the head) equals the dequantized model's. A dropped gradient (an FP8 module
    without backward) would leave the layers below it with none or another one. The two backward passes run the
    same products on the same shapes, but the experts' input gradients reach the layer's input as one sum (their
    backward recomputes them, see WeightOnlyFP4Experts) where the dequantized model adds them one by one with the
    shared expert's and the router's: in fp32, so that this order shows only in the last bits (in bf16 it moves
    ulps, which the layers below carry on); the tolerance allows for that and a BLAS that picks kernels by shape."""
    native, dequantized = native_fp32, dequantized_fp32
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(3))
    ours, theirs = _trainable_gradients(native, ids), _trainable_gradients(dequantized, ids)
    stored = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8)
    quantized = {name for name, p in native.named_parameters() if p.dtype in stored}
    assert quantized and not quantized & ours.keys()  # the stored weights and scales are frozen
    assert "model.embed.weight" in ours and ours["model.embed.weight"].abs().sum() > 0
    assert ours["model.layers.0.attn.wo_a.weight"].abs().sum() > 0  # below layer 1's FP8 Linears and FP4 experts
    for name, grad in ours.items():
        assert (grad is None) == (theirs[name] is None), (name, grad is None, theirs[name] is None)
        if grad is not None:
            torch.testing.assert_close(grad, theirs[name], rtol=1e-3, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_the_input_gets_the_exact_gradient_through_the_weight_only_experts(native, dequantized):
    """The FP4 experts' input gradient is that of the dequantized experts (backward through the dequantized
    weights, each expert's dequantized again for its own products), for every routed expert."""
    ours, theirs = native.model.layers[1].ffn.experts, dequantized.model.layers[1].ffn.experts
    assert isinstance(ours, WeightOnlyFP4Experts)
    hidden = torch.randn(6, TEXT["hidden_size"], dtype=torch.bfloat16, generator=torch.Generator().manual_seed(4))
    index = torch.arange(12).remainder(TEXT["n_routed_experts"]).view(6, 2)
    weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(5))
    grads = []
    for experts in (ours, theirs):
        x, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        experts(x, index, w).pow(2).sum().backward()
        grads.append((x.grad, w.grad))
    for got, expected in zip(*grads):  # the input's and the routing weights'
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-6)  # same products, see above


def _trainer(kind: str, model, output_dir):
    from transformers import Trainer, TrainingArguments

    from modeling_dsv41.training.trainer import DeepseekV41Trainer, DeepseekV41TrainingArguments

    if kind == "dsv41":
        return DeepseekV41Trainer(
            model=model, args=DeepseekV41TrainingArguments(output_dir=str(output_dir), report_to=[])
        )
    return Trainer(model=model, args=TrainingArguments(output_dir=str(output_dir), report_to=[]))


@pytest.mark.parametrize("kind", ["dsv41", "transformers"])
def test_full_fine_tuning_of_the_quantized_weights_is_refused_saying_what_to_do(native, dequantized, kind, tmp_path):
    """Our error (not transformers' "open an issue on GitHub"), from DeepseekV41Trainer and from transformers' own
    Trainer (through the quantizer's ``is_trainable``); the dequantized load of the same folder is taken."""
    with pytest.raises(
        ValueError, match=r"full fine-tuning cannot train them.*FineGrainedFP8Config\(dequantize=True\)"
    ):
        _trainer(kind, native, tmp_path)
    assert all(
        not p.requires_grad for m in native.modules() if isinstance(m, (FP8Linear, FP8Experts)) for p in m.parameters()
    )
    _trainer(kind, dequantized, tmp_path)


# the Linears the release stores in FP8 (FP8Linear once loaded natively): attention and the shared expert
FP8_TARGETS = [
    "attn.wq_a",
    "attn.wq_b",
    "attn.wkv",
    "attn.wo_b",
    "shared_experts.w1",
    "shared_experts.w2",
    "shared_experts.w3",
]
# the routed experts' fused parameters (packed FP4 once loaded natively), as targeted on the bf16 model
EXPERT_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]


def _load(folder, native: bool, dtype: torch.dtype = torch.bfloat16):
    if native:
        return DeepseekV41ForCausalLM.from_pretrained(folder, dtype=dtype)
    return DeepseekV41ForCausalLM.from_pretrained(
        folder, dtype=dtype, quantization_config=FineGrainedFP8Config(dequantize=True)
    )


def _adapted(base, start: dict[str, torch.Tensor] | None = None, **lora):
    """``base`` with LoRA on :data:`FP8_TARGETS` and :data:`EXPERT_PARAMETERS` (``lora`` overrides), its factors
    copied from ``start`` if given (PEFT draws the initial factors in the base weight's dtype where it is bf16, in
    fp32 next to FP8)."""
    from peft import LoraConfig, get_peft_model

    lora = {"target_modules": FP8_TARGETS, "target_parameters": EXPERT_PARAMETERS, **lora}
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, **lora))
    if start is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(start[name])
    return model


def _lora_factors(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


class _SameBatch(torch.utils.data.Dataset):
    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(6))

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> int:
        return index

    @classmethod
    def collate(cls, _: list[int]) -> dict[str, torch.Tensor]:
        return {"input_ids": cls.ids, "labels": cls.ids}


def _lora_trained(base, kind: str, output_dir, start: dict[str, torch.Tensor] | None = None):
    """``base`` adapted (:func:`_adapted`), trained 3 steps; its initial factors and the training losses."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from modeling_dsv41.training.trainer import DeepseekV41Trainer, DeepseekV41TrainingArguments

    class Losses(TrainerCallback):
        def __init__(self):
            self.seen: list[float] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.seen.append(logs["loss"])

    model = _adapted(base, start)
    initial = {n: p.detach().clone() for n, p in _lora_factors(model).items()}
    knobs = dict(
        output_dir=str(output_dir),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=5e-3,
        lr_scheduler_type="constant",
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        remove_unused_columns=False,
        use_cpu=True,
    )
    if kind == "dsv41":
        args, trainer_cls = DeepseekV41TrainingArguments(bias_update_speed=0.0, **knobs), DeepseekV41Trainer
    else:
        args, trainer_cls = TrainingArguments(**knobs), Trainer
    losses = Losses()
    trainer_cls(
        model=model, args=args, train_dataset=_SameBatch(), data_collator=_SameBatch.collate, callbacks=[losses]
    ).train()
    return model.eval(), initial, losses.seen


def _quantized_bytes(model) -> dict[str, torch.Tensor]:
    stored = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8)
    return {  # by the base model's names (PEFT nests the adapted modules' own under `base_layer`)
        n.replace("base_layer.", ""): p.detach().view(torch.uint8).clone()
        for n, p in model.named_parameters()
        if p.dtype in stored
    }


@pytest.mark.parametrize("kind", ["dsv41", "transformers"])
def test_lora_on_attention_and_experts_trains_natively_as_on_the_dequantized_model(released, kind, tmp_path):
    """LoRA on the natively loaded FP8 Linears and FP4 experts trains under both trainers (finite losses, every
    factor moves, the stored bytes stay as loaded); after 3 steps its adapters equal those trained on the dequantized
    base from the same factors. Both run in fp32: the native expert adapters add their delta to the output
    (``x·Wᵀ + s·(x·Aᵀ)·Bᵀ``, nothing dequantized kept for the backward) where PEFT's on the bf16 experts fold it into
    the weight first, and in bf16 those two roundings differ by an ulp that Adam's normalized steps amplify; in fp32
    the tolerance only allows for a BLAS that picks kernels by shape. Each saved adapter loads onto the other base
    with the same logits (fp32 too: in bf16, PEFT's fold of the trained delta into the bf16 expert weights rounds
    it by up to half an ulp of the weight, which moves these logits by up to 0.04)."""
    from peft import PeftModel

    folder = released[0]
    base = _load(folder, native=True, dtype=torch.float32)
    stored = _quantized_bytes(base)
    native, initial, losses = _lora_trained(base, kind, tmp_path / "native")
    dequantized, _, _ = _lora_trained(
        _load(folder, native=False, dtype=torch.float32), kind, tmp_path / "dequantized", start=initial
    )
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))), losses
    ours, theirs = _lora_factors(native), _lora_factors(dequantized)
    assert ours.keys() == theirs.keys()
    assert (
        any("shared_experts.w2" in n for n in ours) and sum("ffn.experts" in n for n in ours) == 8
    )  # 2 layers × 2 × A/B
    assert not [n for n, p in ours.items() if torch.equal(p, initial[n])]  # every factor of every adapter moved
    for name, param in ours.items():
        # Adam's first updates are ≈ lr·sign(g): where a gradient is near zero, the last-bit differences of the
        # gradients (the order of one sum) can move an element by up to 2·lr, so elementwise bounds cannot hold;
        # the factor's update as a whole agrees (measured ≤ 0.01 relative); a dropped or wrong gradient is off by O(1)
        update = theirs[name] - initial[name]
        assert (param - theirs[name]).norm() <= 0.05 * update.norm(), name
    after = _quantized_bytes(base)
    assert after.keys() == stored.keys() and all(torch.equal(after[n], stored[n]) for n in stored)

    ids = _SameBatch.ids
    for trained, onto in ((native, False), (dequantized, True)):
        trained.save_pretrained(tmp_path / f"adapter-{onto}")
        reloaded = PeftModel.from_pretrained(_load(folder, onto, torch.float32), tmp_path / f"adapter-{onto}").eval()
        assert _lora_factors(reloaded).keys() == ours.keys()
        with torch.no_grad():
            # the same factors on the same dequantized weights: only bf16 rounding of the summation order differs
            torch.testing.assert_close(
                reloaded(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=1e-3, atol=1e-3
            )


def test_expert_adapters_have_the_logical_shape_and_act(released):
    """``target_parameters`` on the natively loaded FP4 experts builds exactly the adapters PEFT builds on the bf16
    experts (names and shapes: per expert [out, in] of the logical weight, not of the packed bytes), and they act:
    with the same non-zero factors the native logits equal the dequantized model's, and the expert adapters alone
    move them. In fp32: the native experts add the delta to the output, PEFT's on the bf16 experts fold it into the
    weight first, and in bf16 the fold's rounding differs."""
    folder, ids = released[0], torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(7))
    torch.manual_seed(0)
    dequantized = _adapted(_load(folder, native=False, dtype=torch.float32), init_lora_weights=False)
    native = _adapted(_load(folder, native=True, dtype=torch.float32), start=_lora_factors(dequantized))
    shapes = {n: p.shape for n, p in _lora_factors(native).items()}
    assert shapes == {n: p.shape for n, p in _lora_factors(dequantized).items()}
    prefix = "base_model.model.model.layers.1.ffn.experts."
    E, D, inter = TEXT["n_routed_experts"], TEXT["hidden_size"], TEXT["moe_intermediate_size"]
    assert shapes[prefix + "base_layer.lora_A.default.weight"] == (4 * E, D)  # gate_up_proj: in = D
    assert shapes[prefix + "base_layer.lora_B.default.weight"] == (2 * inter, 4 * E)
    assert shapes[prefix + "lora_A.default.weight"] == (4 * E, inter)  # down_proj: in = I
    with torch.no_grad():
        ours, theirs = native(ids).logits, dequantized(ids).logits
        # x·(W + BA)ᵀ against x·Wᵀ + (x·Aᵀ)·Bᵀ in fp32: the same to rounding
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        with native.disable_adapter():
            plain = native(ids).logits
        experts_only = dict(_lora_factors(native))
        for name, factor in experts_only.items():
            if "ffn.experts" not in name:
                factor.zero_()  # only the expert adapters left
        assert (native(ids).logits - plain).abs().max() > 1e-2


def test_expert_adapters_act_where_the_fp4_kernels_would_run(released):
    """Where transformers' FP4 kernels run, the experts are its own ``FP8Experts``, whose kernels take no weight
    delta: adapted, they run the weight-only computation with the delta (the same logits as the weight-only
    modules'), so no inert adapter there either. Checked on the CPU with the kernels' module class holding the same
    tensors (its kernel forward is never called)."""
    folder, ids = released[0], torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(12))
    kernel_path = _load(folder, native=True)
    for layer in kernel_path.model.layers:
        weight_only = layer.ffn.experts
        with torch.device("meta"):
            experts = FP8Experts(
                weight_only.config, block_size=weight_only.block_size, scale_fmt="ue8m0", expert_dtype="fp4"
            )
        experts.load_state_dict(weight_only.state_dict(), assign=True)
        layer.ffn.experts = experts.requires_grad_(False)
    torch.manual_seed(4)
    weight_only = _adapted(_load(folder, native=True), init_lora_weights=False, target_modules=[])
    kernel_path = _adapted(kernel_path, start=_lora_factors(weight_only), target_modules=[])
    assert type(kernel_path.base_model.model.model.layers[0].ffn.experts.get_base_layer()) is FP8Experts
    with torch.no_grad():
        torch.testing.assert_close(kernel_path(ids).logits, weight_only(ids).logits, rtol=1e-4, atol=1e-4)


def test_expert_adapter_gradients_equal_the_dequantized_models(released):
    """Gradients to every LoRA factor (attention and experts) and to the experts' input equal the dequantized
    model's. In fp32: natively the delta is added to the output, on the bf16 experts PEFT folds it into the weight
    (their bf16 roundings differ); the tolerance only allows for a BLAS that picks kernels by shape."""
    folder, ids = released[0], torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(8))
    torch.manual_seed(1)
    dequantized = _adapted(_load(folder, native=False, dtype=torch.float32), init_lora_weights=False)
    native = _adapted(_load(folder, native=True, dtype=torch.float32), start=_lora_factors(dequantized))
    grads = []
    for model in (native, dequantized):
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in _lora_factors(model).items()})
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads[0].items() if "ffn.experts" in n)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], rtol=1e-3, atol=1e-6, msg=lambda m: f"{name}: {m}")

    hidden = torch.randn(6, TEXT["hidden_size"], generator=torch.Generator().manual_seed(9))
    index = torch.arange(12).remainder(TEXT["n_routed_experts"]).view(6, 2)
    weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(10))
    inputs = []
    for model in (native, dequantized):
        x = hidden.clone().requires_grad_()
        model.base_model.model.model.layers[1].ffn.experts(x, index, weights).pow(2).sum().backward()
        inputs.append(x.grad)
    assert inputs[0].abs().sum() > 0
    torch.testing.assert_close(inputs[0], inputs[1], rtol=1e-3, atol=1e-6)


def _merged_against_adapted(model, ids) -> tuple[nn.Module, float, torch.Tensor, torch.Tensor]:
    """``model`` merged, the relative error of its logits' change from the base's (the delta a merge must keep), and
    the adapted and merged logits."""
    with torch.no_grad():
        adapted = model(ids).logits
        with model.disable_adapter():
            plain = model(ids).logits
        merged = model.merge_and_unload()
        ours = merged(ids).logits
    return merged, ((ours - adapted).norm() / (adapted - plain).norm()).item(), adapted, ours


def test_nothing_dequantized_waits_for_the_backward(released, monkeypatch):
    """LoRA training on the native base keeps no dequantized weight between the forward and the backward (the FP8
    Linears and FP4 experts dequantize again in the backward; the expert deltas go to the output): what autograd saves
    is activations and the stored bytes. Kept alive until the end, every dequantized tensor has its own storage."""
    torch.manual_seed(4)
    model = _adapted(_load(released[0], native=True), init_lora_weights=False)
    dequantized, original = [], codec.dequantize_released_weight

    def recording(*args):
        dequantized.append(original(*args))
        return dequantized[-1]

    monkeypatch.setattr(native_precision, "dequantize_released_weight", recording)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.untyped_storage().data_ptr()) or t, lambda t: t
    ):
        loss = model(input_ids=_SameBatch.ids, labels=_SameBatch.ids).loss
    forward_dequantized = len(dequantized)
    loss.backward()
    assert forward_dequantized > 0 and len(dequantized) > forward_dequantized  # the backward dequantized again
    assert not {t.untyped_storage().data_ptr() for t in dequantized[:forward_dequantized]} & set(saved)
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n and "ffn.experts" in n)


def test_merging_into_a_native_base_merges_into_dequantized_copies(released):
    """``merge_and_unload`` on a native base keeps the delta: each adapted FP8 Linear becomes a bf16 ``nn.Linear``
    and the FP4 experts bf16 ``DeepseekV41Experts`` (dequantized base + delta), the rest stays quantized, and the
    merged logits equal the adapted model's. In-place merging, which would round the delta into FP8 / FP4, is
    refused."""
    from modeling_dsv41.moe import DeepseekV41Experts

    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(11))
    torch.manual_seed(2)
    model = _adapted(_load(released[0], native=True), init_lora_weights=False)
    with pytest.raises(ValueError, match="round its delta away.*merge_and_unload"):
        model.merge_adapter()
    merged, error, _, _ = _merged_against_adapted(model, ids)
    layer = merged.model.layers[1]
    assert type(layer.attn.wq_a) is nn.Linear and layer.attn.wq_a.weight.dtype == torch.bfloat16
    assert type(layer.ffn.experts) is DeepseekV41Experts and layer.ffn.experts.gate_up_proj.dtype == torch.bfloat16
    assert layer.ffn.experts.gate_up_proj.shape == (
        TEXT["n_routed_experts"],
        2 * TEXT["moe_intermediate_size"],
        TEXT["hidden_size"],
    )
    assert isinstance(layer.attn.indexer.wq_b, WeightOnlyFP8Linear)  # not adapted: still FP8
    # A merged Linear rounds base + delta to bf16 once, where the adapted one adds the fp32 LoRA path to the bf16
    # product; the sparse top-k choices (indexer, routing) turn some of those ulps into other choices. Measured 5%
    # of the delta (PEFT's own merge on the dequantized bf16 base: 4%); a delta rounded into FP8 would be mostly lost.
    assert error < 0.1, error

    # merged experts: each holds its dequantized weight plus the delta, computed in fp32 and rounded to bf16 once
    torch.manual_seed(3)
    experts_only = _adapted(_load(released[0], native=True), init_lora_weights=False, target_modules=[])
    wrapper = experts_only.base_model.model.model.layers[0].ffn.experts  # down_proj's, around gate_up_proj's
    fp4 = wrapper.get_base_layer()
    lora_a, lora_b, scaling = wrapper._factors(["default"])(1)[0]
    columns = 2 * fp4.down_proj.shape[-1]
    expected = (
        codec.dequantize_released_weight(fp4.down_proj[1], fp4.down_proj_scale_inv[1], columns, torch.float32)
        + scaling * lora_b.float() @ lora_a.float()
    )
    merged, error, _, _ = _merged_against_adapted(experts_only, ids)
    experts = merged.model.layers[0].ffn.experts
    assert type(experts) is DeepseekV41Experts
    torch.testing.assert_close(experts.down_proj[1].float(), expected, rtol=2**-8, atol=1e-6)  # one bf16 rounding
    assert error < 0.1, error


def test_expert_adapters_of_the_packed_width_are_an_error_not_inert(released, monkeypatch, tmp_path):
    """Without our dispatch PEFT's own ``target_parameters`` wrapper would adapt the packed bytes [E, 2·I, D/2] (an
    adapter of half the experts' input width) and the delta would round away with the bytes: an error from both
    trainers and at the first forward, never a silent no-op."""
    from peft import LoraConfig, get_peft_model

    from modeling_dsv41.released import native_lora

    model = DeepseekV41ForCausalLM.from_pretrained(released[0])
    monkeypatch.setattr(native_lora, "_native_lora_module", lambda *args, **kwargs: None)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["wq_a"], target_parameters=EXPERT_PARAMETERS))
    packed = model.base_model.model.model.layers[0].ffn.experts
    assert packed.in_features == TEXT["moe_intermediate_size"] // 2  # down_proj's packed width: inert
    for kind in ("dsv41", "transformers"):
        with pytest.raises(ValueError, match=r"adapters built on their packed FP4 bytes.*would do nothing"):
            _trainer(kind, model, tmp_path)
    with pytest.raises(ValueError, match="would do nothing.*dequantize=True"):
        model(input_ids=torch.randint(3, 500, (1, 9)))


def test_dequantize_true_loads_plain_bf16(dequantized):
    layer = dequantized.model.layers[1]
    assert type(layer.attn.wq_a) is nn.Linear and layer.attn.wq_a.weight.dtype == torch.bfloat16
    assert layer.ffn.experts.gate_up_proj.dtype == torch.bfloat16
    assert getattr(dequantized.config, "quantization_config", None) is None


def test_the_released_quantizer_refuses_dequantize():
    config = native_precision.DeepseekV41FP8Config(dequantize=True)
    quantizer = native_precision.DeepseekV41FP8Quantizer(config, pre_quantized=True)
    with pytest.raises(ValueError, match="keeps the released weights quantized"):
        quantizer.validate_environment(device_map=None)


def test_a_native_model_saves_as_fine_grained_fp8_and_reloads_natively(native, tmp_path):
    native.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert (saved["quant_method"], saved["scale_fmt"], saved["expert_dtype"]) == ("fp8", "ue8m0", "fp4")
    stored = {}
    for shard in tmp_path.glob("*.safetensors"):
        stored.update(load_file(shard))
    assert stored["model.layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.0.attn.wq_a.weight_scale_inv"].dtype == torch.float8_e8m0fnu
    assert stored["model.layers.0.ffn.experts.gate_up_proj"].dtype == torch.int8
    again = DeepseekV41ForCausalLM.from_pretrained(tmp_path)
    assert isinstance(again.model.layers[0].ffn.experts, WeightOnlyFP4Experts)
    ours, theirs = native.state_dict(), again.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(
            tensor.view(torch.uint8), theirs[name].view(torch.uint8)
        ), name
    with pytest.raises(ValueError, match="saved after a native load"):
        DeepseekV41ForCausalLM.from_pretrained(tmp_path, quantization_config=FineGrainedFP8Config(dequantize=True))


def test_where_the_fp8_kernels_run_transformers_modules_are_kept(monkeypatch):
    """On a GPU with transformers' FP8 kernels the quantizer keeps its `FP8Linear` / `FP8Experts` (DeepGEMM / Triton
    dispatch) with our backward (FP8KernelLinear / FP4KernelExperts); elsewhere it swaps in the weight-only
    subclasses. Checked on the meta device: this machine has no such GPU."""
    config = DeepseekV41Config(text_config=TEXT)
    for usable, device_map, weight_only in ((True, {"": "cuda:0"}, False), (True, None, True), (False, "cuda", True)):
        monkeypatch.setattr(native_precision, "_fp8_kernels_usable", lambda: usable)
        with torch.device("meta"):
            model = DeepseekV41ForCausalLM(config)
        quantizer = native_precision.DeepseekV41FP8Quantizer(
            native_precision.released_quantization_config(model), pre_quantized=True
        )
        quantizer.validate_environment(device_map=device_map)
        quantizer.preprocess_model(model)
        linear, experts = model.model.layers[0].attn.wq_a, model.model.layers[0].ffn.experts
        assert type(linear) is (WeightOnlyFP8Linear if weight_only else native_precision.FP8KernelLinear)
        assert type(experts) is (WeightOnlyFP4Experts if weight_only else native_precision.FP4KernelExperts)
        assert isinstance(linear, FP8Linear) and isinstance(experts, FP8Experts)
        assert experts.gate_up_proj.dtype == torch.int8 and experts.gate_up_proj.shape == (4, 256, 128)


def test_the_loading_benchmark_device_check_runs_the_weight_only_path_on_cpu(released, native):
    """benchmarks/loading.py's native-vs-dequantized check (which benchmarks/gpu.sh runs on CUDA, where transformers'
    FP8 kernels can run) on the CPU: both loads through ``device_map``, the weight-only modules, logits bit-exact as
    in the test above, every greedy token the same."""
    from benchmarks.loading import native_against_dequantized

    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(2))
    result = native_against_dequantized(str(released[0]), "cpu", ids)
    expected = {}
    for module in native.modules():
        if isinstance(module, (FP8Linear, FP8Experts)):
            expected[type(module).__name__] = expected.get(type(module).__name__, 0) + 1
    assert set(expected) == {"WeightOnlyFP8Linear", "WeightOnlyFP4Experts"}
    assert result["modules"] == expected
    assert result["max_abs_logit_diff"] == 0.0
    assert result["argmax_equal"] == result["positions"] == ids.numel()
    assert result["memory"] == {}  # allocation figures are CUDA's only


def _forward_only_kernel(
    input, weight, weight_scale_inv, block_size=None, bias=None, activation_scale=None, allow_deepgemm=True
):
    """Stands in for transformers' FP8 / FP4 kernel (``finegrained_fp8.fp8_linear``) on the CPU: the same product,
    and, as the kernel, no backward."""
    columns = 2 * weight.shape[-1] if weight.dtype == torch.int8 else weight.shape[-1]
    with torch.no_grad():
        dense = codec.dequantize_released_weight(weight, weight_scale_inv, columns, input.dtype)
        return torch.nn.functional.linear(input, dense, bias)


@pytest.fixture
def kernel_path(released, monkeypatch):
    """The stand-in loaded as on a GPU with transformers' FP8 kernels, the kernel call replaced by the forward-only
    fake above (this machine has neither the GPU nor the ``kernels`` package)."""
    from transformers.integrations import finegrained_fp8

    monkeypatch.setattr(native_precision, "_fp8_kernels_usable", lambda: True)
    monkeypatch.setattr(native_precision, "_on_accelerator", lambda device_map: True)
    monkeypatch.setattr(finegrained_fp8, "fp8_linear", _forward_only_kernel)
    model = DeepseekV41ForCausalLM.from_pretrained(released[0])
    layer = model.model.layers[1]
    assert type(layer.attn.wq_a) is native_precision.FP8KernelLinear
    assert type(layer.ffn.experts) is native_precision.FP4KernelExperts
    x = torch.randn(2, TEXT["hidden_size"], dtype=torch.bfloat16, requires_grad=True)
    assert _forward_only_kernel(x, layer.attn.wq_a.weight, layer.attn.wq_a.weight_scale_inv).grad_fn is None
    return model


def test_on_the_kernel_path_the_input_gets_the_weight_only_modules_gradient(kernel_path, native):
    """FP8KernelLinear / FP4KernelExperts wrap the kernel call (here a fake without backward) in an autograd
    function whose backward goes through the dequantized weights: each module's input gradient, and the routing
    weights' through the experts, equal those of the weight-only module on the same parameters. The products are
    the same; the tolerance only allows for a BLAS that picks kernels by shape."""
    ours, theirs = kernel_path.model.layers[1], native.model.layers[1]
    generator = torch.Generator().manual_seed(7)

    def upstream(width: int) -> torch.Tensor:  # the same output gradient for both, bf16 values
        return torch.randn(6, width, generator=torch.Generator().manual_seed(width)).to(torch.bfloat16)

    hidden = torch.randn(6, TEXT["hidden_size"], dtype=torch.bfloat16, generator=generator)
    for name in ("attn.wq_a", "attn.wkv", "ffn.shared_experts.w2"):
        kernel, weight_only = ours.get_submodule(name), theirs.get_submodule(name)
        x = torch.randn(6, weight_only.in_features, dtype=torch.bfloat16, generator=generator)
        grads = []
        for module in (kernel, weight_only):
            leaf = x.clone().requires_grad_()
            module(leaf).backward(upstream(weight_only.out_features))
            grads.append(leaf.grad)
        assert grads[0].abs().sum() > 0
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-6, msg=lambda m: f"{name}: {m}")

    index = torch.arange(12).remainder(TEXT["n_routed_experts"]).view(6, 2)
    weights = torch.rand(6, 2, generator=generator)
    grads = []
    for experts in (ours.ffn.experts, theirs.ffn.experts):
        x, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        out = experts(x, index, w)
        out.backward(upstream(TEXT["hidden_size"]).to(out.dtype))  # bf16 (kernel path) or fp32: the same values
        grads.append((x.grad, w.grad))
    for got, expected in zip(grads[0], grads[1]):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-5)


def test_in_reference_numerics_the_native_modules_compute_as_the_reference_s_kernels(kernel_path, native):
    """With ``emulate_quantization`` (the default), in reference numerics the FP8 Linears, on the kernel path too,
    and Engram ``wkv`` (dequantized on load) compute as the reference's ``fp8_gemm`` (``codec.fp8_gemm_linear``:
    the input quantized to FP8); the FP4 experts, kernel or weight-only, as its per-expert ``fp4_gemm`` loop, each
    token's result independent of the batch (a decode step's few slots too). Outside the mode, as before."""
    ours, theirs = kernel_path.model.layers[1], native.model.layers[1]
    generator = torch.Generator().manual_seed(5)
    for name in ("attn.wq_a", "attn.indexer.wq_b", "ffn.shared_experts.w2", "engram.wkv"):
        weight_only = theirs.get_submodule(name)
        x = torch.randn(6, weight_only.in_features, dtype=torch.bfloat16, generator=generator)
        if name == "engram.wkv":
            dense, kernel = weight_only.weight, None
        else:
            columns = weight_only.weight.shape[-1]
            dense = codec.dequantize_released_weight(
                weight_only.weight, weight_only.weight_scale_inv, columns, x.dtype
            )
            kernel = ours.get_submodule(name)
        expected = codec.fp8_gemm_linear(x, dense)
        with torch.no_grad():
            plain = weight_only(x)
            with reference_numerics():
                got = [module(x) for module in (weight_only, kernel) if module is not None]
        assert all(torch.equal(out, expected) for out in got), name
        assert torch.equal(plain, torch.nn.functional.linear(x, dense)) and not torch.equal(plain, expected), name
    hidden = torch.randn(6, TEXT["hidden_size"], dtype=torch.bfloat16, generator=generator)
    index = torch.arange(12).remainder(TEXT["n_routed_experts"]).view(6, 2)
    weights = torch.rand(6, 2, generator=generator)
    with torch.no_grad():
        plain = theirs.ffn.experts(hidden, index, weights)
        with reference_numerics():
            emulated = theirs.ffn.experts(hidden, index, weights)
            assert torch.equal(ours.ffn.experts(hidden, index, weights), emulated)
            decode_step = theirs.ffn.experts(hidden[:1], index[:1], weights[:1])  # per-slot outside the mode
    assert torch.equal(decode_step, emulated[:1]) and not torch.equal(plain, emulated)


def test_on_the_kernel_path_no_gradient_is_dropped(kernel_path, monkeypatch):
    """Through the whole model (kernels in every FP8 Linear and the FP4 experts): every trainable parameter's
    gradient, the embedding's below all layers included, equals the one autograd gives when the same forward is
    differentiable (transformers' modules on a fake kernel with a backward). Tolerance: our experts' backward is the
    weight-only experts' (fp32 SwiGLU), transformers' eager FP4 experts compute the SwiGLU in bf16."""
    from transformers.integrations import finegrained_fp8

    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(3))
    ours = _trainable_gradients(kernel_path, ids)

    def differentiable_kernel(input, weight, weight_scale_inv, block_size=None, bias=None, *args):
        columns = 2 * weight.shape[-1] if weight.dtype == torch.int8 else weight.shape[-1]
        dense = codec.dequantize_released_weight(weight, weight_scale_inv, columns, input.dtype)
        return torch.nn.functional.linear(input, dense, bias)

    monkeypatch.setattr(finegrained_fp8, "fp8_linear", differentiable_kernel)
    monkeypatch.setattr(finegrained_fp8, "_apply_if_grad", lambda function, direct, *args: direct(*args))
    monkeypatch.setattr(native_precision.FP8KernelLinear, "forward", FP8Linear.forward)
    monkeypatch.setattr(native_precision.FP4KernelExperts, "forward", FP8Experts.forward)
    theirs = _trainable_gradients(kernel_path, ids)
    assert ours.keys() == theirs.keys() and ours["model.embed.weight"].abs().sum() > 0
    for name, grad in ours.items():
        assert (grad is None) == (theirs[name] is None), (name, grad is None, theirs[name] is None)
        if grad is not None:
            cos = torch.nn.functional.cosine_similarity(grad.flatten().float(), theirs[name].flatten().float(), 0)
            assert cos > 0.999, (name, cos)  # measured ≥ 0.9995
            assert (grad - theirs[name]).abs().max() <= 0.05 * theirs[name].abs().max(), name  # measured ≤ 0.036
