"""``dsv41 export --format vllm-lora`` (modeling_dsv41.serving.adapter_export): a PEFT LoRA of our model, attention
and shared experts (target_modules) and the fused routed experts (target_parameters), written in the layout vLLM's
DeepSeek-V4 LoRA reads, read back into our model with the same logits; the command of docs/serving.md in a fresh
process; and each input the export refuses."""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
import textwrap

import pytest
import torch
from peft import IA3Config, LoraConfig, get_peft_model
from peft.tuners.lora import ParamWrapper
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers.integrations.finegrained_fp8 import FP8Linear

from documentation import REPO_ROOT, command_lines
from reference_fixture import QUANT_FORMAT_TEXT, stub_tokenizer

from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.cli import main
from modeling_dsv41.placement import meta_instance
from modeling_dsv41.serving.adapter_export import FORMAT, export_serving_adapter, load_serving_adapter
from modeling_dsv41.released.native_lora import ParamWrapper as NativeExpertsLora
from modeling_dsv41.released.writing import save_released_checkpoint

import tiny_models
from tiny_models import DSPARK  # a draft head (mtp.*), which the export leaves out

TARGETS = ["wq_a", "wkv", "wo_b", "w1", "w2", "w3"]
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
BASE, ADAPTER = "dsv41-demo/model", "dsv41-lora/adapter"  # where the README's snippets put them


def tiny_config(**overrides):
    return tiny_models.tiny_config(vision=False, emulate_quantization=False, **DSPARK, **overrides)


def randomized(model, seed: int = 1):
    """Every LoRA factor drawn at random (B too, so every adapter changes the output)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return model.eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A folder laid out as after the README's LoRA snippet (the base in ``dsv41-demo/model``, the adapter in
    ``dsv41-lora/adapter`` with that relative base path), the adapted model, its logits and its export."""
    root = tmp_path_factory.mktemp("serving")
    tiny_models.tiny_model(tiny_config(), engram_map="default").save_pretrained(root / BASE)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)  # the adapter records the base's path as given: relative, as in the README
        base = DeepseekV41ForCausalLM.from_pretrained(BASE).eval()
        model = randomized(
            get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=TARGETS, target_parameters=EXPERTS))
        )
        model.save_pretrained(ADAPTER)
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    export_serving_adapter(model, root / "exported")
    return {"root": root, "model": model, "ids": ids, "logits": logits(model, ids), "exported": root / "exported"}


def fresh_base(trained) -> DeepseekV41ForCausalLM:
    return DeepseekV41ForCausalLM.from_pretrained(trained["root"] / BASE).eval()


def test_keys_are_the_release_names_with_per_expert_factors(trained):
    config = trained["model"].get_base_model().config.text_config
    tensors = load_file(trained["exported"] / "adapter_model.safetensors")
    D, I, E, r = config.hidden_size, config.moe_intermediate_size, config.n_routed_experts, 2
    prefix = "base_model.model."
    assert all(key.startswith(prefix) for key in tensors)
    assert not any(key.removeprefix(prefix).startswith(("mtp.", "model.", "lm_head")) for key in tensors)
    expected = {  # (lora_A, lora_B) shapes
        "layers.0.attn.wq_a": ((r, D), (config.q_lora_rank, r)),
        "layers.1.attn.compressor.wkv": ((r, D), (config.head_dim, r)),
        "layers.0.ffn.shared_experts.w1": ((r, D), (I, r)),
        "layers.0.ffn.shared_experts.w2": ((r, I), (D, r)),
        **{
            f"layers.{i}.ffn.experts.{e}.{w}": ((r, I), (D, r)) if w == "w2" else ((r, D), (I, r))
            for i in range(config.num_hidden_layers)
            for e in range(E)
            for w in ("w1", "w2", "w3")
        },
    }
    for name, shapes in expected.items():
        key = prefix + name
        assert (tensors[f"{key}.lora_A.weight"].shape, tensors[f"{key}.lora_B.weight"].shape) == shapes, name
    serving = json.loads((trained["exported"] / "adapter_config.json").read_text())
    assert serving["dsv41_export"] == {"format": FORMAT, "version": 1, "skipped": serving["dsv41_export"]["skipped"]}
    assert serving["dsv41_export"]["skipped"] == [
        "mtp.0.attn.wkv",
        "mtp.0.attn.wo_b",
        "mtp.0.attn.wq_a",
        "mtp.0.ffn.experts.down_proj",
        "mtp.0.ffn.experts.gate_up_proj",
        "mtp.0.ffn.shared_experts.w1",
        "mtp.0.ffn.shared_experts.w2",
        "mtp.0.ffn.shared_experts.w3",
    ]
    assert serving["base_model_name_or_path"] == BASE
    assert (serving["r"], serving["lora_alpha"], serving["use_rslora"]) == (2, 4, False)
    assert set(serving["target_modules"]) == {"wq_a", "wkv", "wo_b", "w1", "w2", "w3"}

    # each expert's factors are PEFT's own: its delta scaling·B_e·A_e is PEFT's delta of that expert, w1 the first I
    # rows of gate_up_proj and w3 the rest (exact: the same products of the same numbers)
    for module in trained["model"].get_base_model().model.layers[2].ffn.modules():
        if not isinstance(module, ParamWrapper):
            continue
        delta = module.get_delta_weight("default")  # [E, out, in]
        weights = ("w1", "w3") if module.parameter_name == "gate_up_proj" else ("w2",)
        for e in range(E):
            factors = [tensors[f"{prefix}layers.2.ffn.experts.{e}.{w}.lora_{x}.weight"] for w in weights for x in "BA"]
            ours = torch.cat([b @ a for b, a in zip(factors[::2], factors[1::2])]) * module.scaling["default"]
            torch.testing.assert_close(ours, delta[e], rtol=0, atol=0)


def test_the_exported_folder_loads_back_with_the_same_logits(trained, caplog):
    assert (trained["logits"] - logits(fresh_base(trained), trained["ids"])).abs().max() > 1e-2  # the adapter acts
    served = load_serving_adapter(fresh_base(trained), trained["exported"]).eval()
    # the same factors, bit for bit, in the same PEFT layers of the same base: the same computation, exactly (fp32)
    torch.testing.assert_close(logits(served, trained["ids"]), trained["logits"], rtol=0, atol=0)


def test_the_exported_folder_loads_back_in_a_fresh_process(trained, tmp_path):
    """Exported here, read back with ``load_serving_adapter`` onto the base loaded in a new process: the adapter's
    logits, exactly (the same factors in the same layers, fp32)."""
    torch.save({"ids": trained["ids"], "logits": trained["logits"]}, tmp_path / "expected.pt")
    script = textwrap.dedent(
        f"""
        import json, torch
        from modeling_dsv41 import DeepseekV41ForCausalLM
        from modeling_dsv41.serving.adapter_export import load_serving_adapter
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        base = DeepseekV41ForCausalLM.from_pretrained({str(trained["root"] / BASE)!r}).eval()
        served = load_serving_adapter(base, {str(trained["exported"])!r}).eval()
        with torch.no_grad():
            got = served(input_ids=expected["ids"]).logits
        print(json.dumps({{"equal": torch.equal(got, expected["logits"])}}))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"equal": True}


def test_a_saved_adapter_folder_exports_the_same_tensors(trained, tmp_path, caplog, monkeypatch):
    monkeypatch.chdir(trained["root"])  # the adapter's base path is relative
    with caplog.at_level(logging.WARNING):
        export_serving_adapter(ADAPTER, tmp_path / "out")
    assert "left out the DSpark draft head" in caplog.text
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["base_model_name_or_path"] == BASE
    ours, theirs = (load_file(f / "adapter_model.safetensors") for f in (trained["exported"], tmp_path / "out"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_the_documented_command_runs_as_printed(trained):
    (command,) = command_lines("dsv41 export --format vllm-lora ")
    argv = shlex.split(command)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "modeling_dsv41.cli", *argv[1:]],
        cwd=trained["root"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"({FORMAT} version 1, left out" in result.stdout
    written = load_file(trained["root"] / argv[-1] / "adapter_model.safetensors")
    ours = load_file(trained["exported"] / "adapter_model.safetensors")
    assert written.keys() == ours.keys() and all(torch.equal(written[k], ours[k]) for k in ours)


def test_a_rank_pattern_is_folded_into_one_scale(tmp_path):
    base = tiny_models.tiny_model(tiny_config(), engram_map="default")
    ids = torch.randint(3, 500, (1, 10), generator=torch.Generator().manual_seed(0))
    config = LoraConfig(
        r=2,
        lora_alpha=4,
        target_modules=["wo_b", "wq_a"],
        target_parameters=EXPERTS,
        rank_pattern={"wo_b": 4},
        alpha_pattern={"wo_b": 3},
    )
    model = randomized(get_peft_model(base, config))
    expected = logits(model, ids)
    export_serving_adapter(model, tmp_path / "out")
    serving = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert serving["r"] == 4  # the largest rank; every module's B now carries its scale over lora_alpha / 4
    fresh = tiny_models.tiny_model(tiny_config(), engram_map="default")
    served = load_serving_adapter(fresh, tmp_path / "out").eval()
    # the rescaled B factors are rounded once more in fp32 (a relative 6e-8 each): far below 1e-5 on these logits
    torch.testing.assert_close(logits(served, ids), expected, rtol=1e-5, atol=1e-5)


def meta_adapter(**lora):
    """A PEFT model on a meta-device tiny model: enough for the checks that refuse an adapter before any data."""
    return get_peft_model(meta_instance(tiny_config(), DeepseekV41ForCausalLM, torch.float32), LoraConfig(**lora))


@pytest.mark.parametrize(
    "lora, message",
    [
        (
            dict(r=2, target_modules=["wq_a", "wkv"], rank_pattern={"wkv": 4}),
            r"layers\.0\.attn has ranks \{'wq_a': 2, 'wkv': 4\}.*one LoRA slot",
        ),
        (dict(r=2, target_modules=["compressor.wkv", "wgate"], rank_pattern={"wgate": 4}), r"compressor has ranks"),
        (
            dict(r=2, target_parameters=EXPERTS, rank_pattern={"experts.down_proj": 4}),
            r"ffn\.experts has ranks \{.*'down_proj': 4.*one LoRA slot",
        ),
    ],
)
def test_ranks_that_differ_in_one_vllm_slot_are_refused(tmp_path, lora, message):
    with pytest.raises(ValueError, match=message):
        export_serving_adapter(meta_adapter(**lora), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "config, message",
    [
        (LoraConfig(r=2, target_modules=["wq_a"], use_dora=True), "DoRA"),
        (LoraConfig(r=2, target_modules=["wq_a"], modules_to_save=["lm_head"]), "modules_to_save"),
        (LoraConfig(r=2, target_modules=["wq_a"], lora_bias=True), "lora_bias"),
        (IA3Config(target_modules=["wq_a"], feedforward_modules=[]), "IA3 adapter.*LoRA adapters only"),
    ],
)
def test_what_vllm_does_not_serve_is_refused(tmp_path, config, message):
    config.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match=message):
        export_serving_adapter(tmp_path / "adapter", tmp_path / "out", base=tiny_config())


@pytest.mark.parametrize("targets, adapted", [(["lm_head"], "lm_head"), (["embed"], "model.embed")])
def test_an_adapted_embedding_or_head_is_refused(tmp_path, targets, adapted):
    """vLLM's DeepSeek-V4 model takes no LoRA on its embed_tokens / lm_head: an adapter of either is refused (with
    the attention adapted beside it), not written under names vLLM would not find."""
    with pytest.raises(ValueError, match=rf"adapts {adapted}: vLLM's DeepSeek-V4 LoRA serves no adapter on the token"):
        export_serving_adapter(meta_adapter(r=2, target_modules=["wq_a", *targets]), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_bitsandbytes_base_is_refused(tmp_path):
    LoraConfig(r=2, target_modules=["wq_a"]).save_pretrained(tmp_path / "adapter")
    base = tiny_config()
    base.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with pytest.raises(ValueError, match="bitsandbytes-quantized base"):
        export_serving_adapter(tmp_path / "adapter", tmp_path / "out", base=base)


def test_an_adapter_of_another_base_is_refused(trained, tmp_path):
    # another architecture's module names
    llama = tmp_path / "llama"
    LoraConfig(r=2, target_modules=["q_proj", "v_proj"]).save_pretrained(llama)
    save_file(
        {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 64)},
        llama / "adapter_model.safetensors",
    )
    with pytest.raises(ValueError, match="does not fit DeepSeek-V4.1.*another base"):
        export_serving_adapter(llama, tmp_path / "out", base=tiny_config())
    # our names, another size: the experts of the tiny adapter do not fit wider experts
    with pytest.raises(ValueError, match=r"ffn\.experts.*DeepSeek-V4.1 of this config takes.*another base"):
        export_serving_adapter(trained["root"] / ADAPTER, tmp_path / "out", base=tiny_config(moe_intermediate_size=64))
    # and the serving layout into a model of another size
    with pytest.raises(ValueError, match="another base"):
        load_serving_adapter(tiny_models.tiny_model(tiny_config(q_lora_rank=16)), trained["exported"])


def test_a_base_of_another_model_type_is_refused(trained, tmp_path):
    """An adapter checked against another model type's config, and the serving layout loaded into a model that is
    not ours: each a clear error naming what it got."""
    with pytest.raises(ValueError, match=r"its base is a llama model, not DeepSeek-V4\.1 \(deepseek_v41"):
        export_serving_adapter(trained["root"] / ADAPTER, tmp_path / "out", base=LlamaConfig())
    with pytest.raises(TypeError, match="takes a DeepseekV41ForCausalLM.*got Linear"):
        load_serving_adapter(torch.nn.Linear(4, 4), trained["exported"])


def test_loading_onto_a_bitsandbytes_base_is_refused(trained):
    base = fresh_base(trained)
    base.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with pytest.raises(ValueError, match=r"bitsandbytes-quantized \(NF4 / int8\).*bf16 or natively"):
        load_serving_adapter(base, trained["exported"])
    assert not hasattr(base, "peft_config")  # refused before any adapter went in


def test_experts_of_different_ranks_are_refused_on_reading(trained, tmp_path):
    tensors = load_file(trained["exported"] / "adapter_model.safetensors")
    key = "base_model.model.layers.1.ffn.experts.3.w2.lora_"
    tensors[key + "A.weight"] = torch.cat([tensors[key + "A.weight"]] * 2)
    tensors[key + "B.weight"] = torch.cat([tensors[key + "B.weight"]] * 2, dim=1) / 2
    (tmp_path / "ranks").mkdir()
    save_file(tensors, tmp_path / "ranks" / "adapter_model.safetensors")
    (tmp_path / "ranks" / "adapter_config.json").write_text((trained["exported"] / "adapter_config.json").read_text())
    with pytest.raises(ValueError, match=r"experts of layers\.1\.ffn\.experts have ranks \[2, 4\]"):
        load_serving_adapter(fresh_base(trained), tmp_path / "ranks")


def test_the_command_reports_a_refused_adapter_in_one_line(tmp_path, capsys):
    LoraConfig(r=2, target_modules=["wq_a"], use_dora=True).save_pretrained(tmp_path / "adapter")
    argv = ["export", "--format", "vllm-lora", str(tmp_path / "adapter"), str(tmp_path / "out"), "--base", "tiny"]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("dsv41 export: error: ") and "DoRA" in line
    with pytest.raises(SystemExit) as exit_info:  # --format is required
        main(["export", str(tmp_path / "adapter"), str(tmp_path / "out")])
    assert exit_info.value.code == 2 and "--format" in capsys.readouterr().err


def test_an_adapter_of_the_natively_loaded_release_round_trips(tmp_path):
    """LoRA on the release kept in FP8 / FP4 (our FP8 Linear and FP4 experts layers): the same keys and logical
    shapes, the same export, and read back into a natively loaded model, the same logits."""
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(DeepseekV41Config(text_config=QUANT_FORMAT_TEXT)).to(torch.bfloat16)
    save_released_checkpoint(model, tmp_path / "released", max_shard_bytes=1 << 20)
    stub_tokenizer().save(str(tmp_path / "released" / "tokenizer.json"))  # the Engram hasher's token map
    native = DeepseekV41ForCausalLM.from_pretrained(tmp_path / "released", dtype=torch.float32)
    assert any(isinstance(m, FP8Linear) for m in native.modules())  # kept as stored
    adapted = randomized(
        get_peft_model(
            native, LoraConfig(r=2, target_modules=["wq_a", "wkv", "w1", "w2", "w3"], target_parameters=EXPERTS)
        )
    )
    assert any(isinstance(m, NativeExpertsLora) for m in adapted.modules())  # on the packed FP4 experts
    ids = torch.randint(3, 500, (1, 10), generator=torch.Generator().manual_seed(0))
    expected = logits(adapted, ids)
    export_serving_adapter(adapted, tmp_path / "out")
    tensors = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert tensors["base_model.model.layers.1.ffn.experts.3.w2.lora_A.weight"].shape == (2, 128)  # I, not I/2
    fresh = DeepseekV41ForCausalLM.from_pretrained(tmp_path / "released", dtype=torch.float32)
    served = load_serving_adapter(fresh, tmp_path / "out").eval()
    torch.testing.assert_close(logits(served, ids), expected, rtol=0, atol=0)  # the same factors in the same layers
