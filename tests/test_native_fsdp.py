"""LoRA on a model loaded in the released precision, sharded with FSDP2
(:func:`~modeling_dsv41.training.fsdp.shard_model`): the frozen FP8 weights, E8M0 scales and packed FP4 experts are
sharded as stored, the adapters too, the frozen Engram tables stay where they are. 2 gloo processes on CPU, spawned
from pytest, bounded in time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from gloo_processes import WORLD, spawn
from reference_fixture import QUANT_FORMAT_TEXT, stub_tokenizer
from tiny_models import DSPARK

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")

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
# the routed experts' adapters (PEFT target_parameters: logical-shape factors on the native FP4 experts)
EXPERT_TARGETS = ["experts.gate_up_proj", "experts.down_proj"]
STEPS = 3
LR = 0.5


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """The two-layer stand-in of tests/test_native_precision.py in the released storage format."""
    import modeling_dsv41  # noqa: F401
    from configuration import DeepseekV41Config
    from modeling_dsv41 import DeepseekV41ForCausalLM
    from modeling_dsv41.released.writing import save_released_checkpoint

    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(DeepseekV41Config(text_config=QUANT_FORMAT_TEXT)).to(torch.bfloat16)
    folder = tmp_path_factory.mktemp("released")
    save_released_checkpoint(model, folder, max_shard_bytes=1 << 20)
    stub_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


def lora_model(folder: Path, engram_table_dtype: str):
    """The stand-in loaded natively with LoRA on its FP8 Linears (every factor drawn at random from one seed, so
    that each rank builds the same adapters and every factor gets a gradient at the first step), gradient
    checkpointing on, in training mode."""
    from peft import LoraConfig, get_peft_model

    from configuration import DeepseekV41Config
    from modeling_dsv41 import DeepseekV41ForCausalLM

    config = DeepseekV41Config.from_pretrained(folder)
    config.text_config.engram_table_dtype = engram_table_dtype  # "fp8": kept as stored; "float": dequantized on load
    base = DeepseekV41ForCausalLM.from_pretrained(folder, config=config)
    base.activation_checkpointing_enable()
    torch.manual_seed(1)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=FP8_TARGETS, target_parameters=EXPERT_TARGETS, init_lora_weights=False
    )
    return get_peft_model(base, lora).train()


def _adapters(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def _sgd_steps(model, batches: list[list[torch.Tensor]]) -> None:
    """Plain SGD (an update linear in the gradient: two runs whose gradients differ in the last bits stay that
    close; Adam's first steps, ≈ lr·sign(g), would lift those bits to O(lr) where a gradient is near zero)."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for micro_batches in batches:
        for ids in micro_batches:
            (model(input_ids=ids, labels=ids).loss / len(micro_batches)).backward()
        optimizer.step()
        optimizer.zero_grad()


def _native_lora_sharded_matches_one_process(
    rank: int, tmp: Path, folder: str, engram_table_dtype: str, bf16_compute: bool
) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from modeling_dsv41.training.fsdp import QUANTIZED_DTYPES, shard_model

    ids = torch.randint(3, QUANT_FORMAT_TEXT["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(2))
    halves = [ids[:2], ids[2:]]  # each rank's half; one process accumulates both

    single = lora_model(Path(folder), engram_table_dtype)
    initial = {n: p.detach().clone() for n, p in _adapters(single).items()}
    model = lora_model(Path(folder), engram_table_dtype)
    table = model.base_model.model.model.layers[0].engram.embed
    table_storage = [p.data_ptr() for p in table.parameters()]
    # bf16_compute: as a launch with `mixed_precision: bf16` shards it; the stored FP8 / E8M0 must not be cast
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16_compute else None
    shard_model(model, mp_policy=policy)

    names = dict(model.named_parameters())
    quantized = {n for n, p in names.items() if p.dtype in QUANTIZED_DTYPES and ".engram.embed." not in n}
    assert {p.dtype for n, p in names.items() if n in quantized} == set(QUANTIZED_DTYPES)
    assert any(".experts." in n and n.endswith(".gate_up_proj") for n in quantized)
    for name in quantized | set(_adapters(model)):  # sharded, as stored (no cast): each rank holds its rows
        param = names[name]
        assert isinstance(param, DTensor), name
        local = param.to_local()
        assert local.shape[0] == -(-param.shape[0] // WORLD) or rank == WORLD - 1, name
    for param in table.parameters():  # frozen: left in place, whole, unsharded; the model reads its rows only
        assert not isinstance(param, DTensor) and not param.requires_grad
    seen = {}  # the dtypes the forward computes with
    layer = model.base_model.model.model.layers[1]
    hooks = {
        "wq_a": layer.attn.wq_a.base_layer,
        "lora_A": layer.attn.wq_a.lora_A["default"],
        "experts": layer.ffn.experts.get_base_layer(),
        "lm_head": model.base_model.model.lm_head,
    }
    for key, module in hooks.items():
        weight = "gate_up_proj" if key == "experts" else "weight"
        module.register_forward_pre_hook(lambda m, a, key=key, w=weight: seen.__setitem__(key, getattr(m, w).dtype))
    layer.register_forward_pre_hook(lambda m, a: seen.__setitem__("hc_attn_fn", m.hc_attn_fn.dtype))

    _sgd_steps(single, [halves] * STEPS)
    _sgd_steps(model, [[halves[rank]]] * STEPS)

    assert seen == {
        "wq_a": torch.float8_e4m3fn,
        "experts": torch.int8,
        "lm_head": torch.float32,
        "hc_attn_fn": torch.float32,
        "lora_A": torch.bfloat16 if bf16_compute else torch.float32,
    }, seen
    assert [p.data_ptr() for p in table.parameters()] == table_storage
    ours, theirs = _adapters(model), _adapters(single)
    assert ours.keys() == theirs.keys() == initial.keys()
    assert any("attn.wo_b" in n for n in ours) and any("shared_experts.w2" in n for n in ours)
    worst = 0.0
    for name, param in ours.items():
        full = param.full_tensor().detach()
        assert not torch.equal(full, initial[name]), f"{name} did not train"
        worst = max(worst, ((full - theirs[name]).abs().max() / (theirs[name] - initial[name]).abs().max()).item())
        if not bf16_compute:
            # each rank runs the products one process runs for its half, on the same shapes; only the mean of
            # the two halves' gradients is summed in another order (measured: bit-identical)
            torch.testing.assert_close(full, theirs[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    if rank == 0:
        (tmp / "worst.txt").write_text(f"{worst:.3g}")


@pytest.mark.parametrize(("engram_table_dtype", "bf16_compute"), [("fp8", False), ("float", True)])
def test_lora_on_the_native_base_sharded_on_two_processes_trains_as_one_process(
    released, engram_table_dtype, bf16_compute, tmp_path
):
    """3 SGD steps of LoRA on the FP8 Linears and FP4 experts of the natively loaded stand-in, gradient checkpointing
    on: FSDP2 on 2 processes (each half of the batch) gives the adapters one process gets accumulating both halves.

    With a bf16 ``param_dtype`` the adapters compute in bf16 where one process computes them in fp32, so no
    single-process run is the reference there: that case checks what is sharded and cast (the FP8 / FP4 bases and
    the model's fp32 modules, frozen under LoRA, keep their dtypes) and that every factor trains."""
    spawn(
        _native_lora_sharded_matches_one_process,
        tmp_path,
        str(released),
        engram_table_dtype,
        bf16_compute,
        timeout_s=240,
    )
    print("max |Δ adapter| / max |update|:", (tmp_path / "worst.txt").read_text())


EP_SIZE = 2  # expert_parallel_size of the expert-parallel runs: 2 of the stand-in's 4 experts per EP rank


def _sgd_steps_by_groups(model, groups: list[list[torch.Tensor]]) -> None:
    """:func:`_sgd_steps` of one process summing the micro-batches' gradients as the expert-parallel mesh sums them:
    each EP group's micro-batches accumulated, then the groups' sums added."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=LR)
    count = sum(len(group) for group in groups)
    for _ in range(STEPS):
        total = None
        for group in groups:
            for ids in group:
                (model(input_ids=ids, labels=ids).loss / count).backward()
            grads = [p.grad for p in params]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
            optimizer.zero_grad()
        for param, grad in zip(params, total):
            param.grad = grad
        optimizer.step()
        optimizer.zero_grad()


def _native_lora_expert_parallel_matches_one_process(rank: int, tmp: Path, folder: str, world: int) -> None:
    from torch.distributed.tensor import DTensor

    from modeling_dsv41.released.sharded_reading import local_box
    from modeling_dsv41.training.fsdp import shard_model

    ids = torch.randint(3, QUANT_FORMAT_TEXT["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(2))
    parts = list(ids.chunk(world))  # each rank's part; one process accumulates them all, EP group by EP group
    single = lora_model(Path(folder), "fp8")
    initial = {n: p.detach().clone() for n, p in _adapters(single).items()}
    model = lora_model(Path(folder), "fp8")
    shard_model(model, expert_parallel_size=EP_SIZE)

    # each rank holds experts of its EP rank (the inner mesh dimension) only, as stored (FP4 bytes and E8M0 scales,
    # frozen): all of them on a 1-rank ep_shard, FSDP2's rows of them on 2
    per_ep_rank = QUANT_FORMAT_TEXT["n_routed_experts"] // EP_SIZE
    first = rank % EP_SIZE * per_ep_rank
    stored = dict(single.named_parameters())
    experts = {n: p for n, p in model.named_parameters() if ".experts." in n and "lora_" not in n}
    assert {p.dtype for p in experts.values()} == {torch.int8, torch.float8_e8m0fnu}
    for name, param in experts.items():
        assert isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == ("ep_shard", "ep"), name
        assert not param.requires_grad, name
        box = local_box(param)
        assert first <= box[0][0] and box[0][1] <= first + per_ep_rank, (name, box)
        mine = stored[name][tuple(slice(a, b) for a, b in box)]
        assert torch.equal(param.to_local().view(torch.uint8), mine.view(torch.uint8)), name

    _sgd_steps_by_groups(single, [parts[i : i + EP_SIZE] for i in range(0, world, EP_SIZE)])
    _sgd_steps(model, [[parts[rank]]] * STEPS)

    ours, theirs = _adapters(model), _adapters(single)
    assert ours.keys() == theirs.keys() == initial.keys()
    assert any(".experts." in n for n in ours)
    for name, param in ours.items():
        full = param.full_tensor().detach()
        assert not torch.equal(full, initial[name]), f"{name} did not train"
        # each rank runs, for each source rank and expert, the products one process runs for that part, and the
        # gradients are summed in the same order, each sum of two terms (measured: bit-identical). The order
        # matters: summed part by part, the last bits differ, and over the steps they flip top-k
        # choices (routing, the indexer): measured, the adapters then differ far beyond this tolerance
        torch.testing.assert_close(full, theirs[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_lora_on_the_native_base_with_expert_parallelism_trains_as_one_process(released, tmp_path):
    """3 SGD steps of LoRA on the FP8 Linears and FP4 experts of the natively loaded stand-in with
    ``expert_parallel_size=2`` on 4 processes (ep_shard=2 × ep=2), each process its part of the batch (the FP4
    experts split by expert and their rows over ep_shard, tokens dispatched by all-to-all, the expert adapters applied
    on the ranks that hold their experts), give the adapters one process gets accumulating every part. (The trainer
    test below runs a 1-rank ep_shard.)"""
    world = 2 * EP_SIZE
    spawn(
        _native_lora_expert_parallel_matches_one_process,
        tmp_path,
        str(released),
        world,
        world_size=world,
        timeout_s=240,
    )


def _trainer_adapters(rank: int, folder: Path, output: Path, expert_parallel_size: int) -> dict[str, torch.Tensor]:
    """``DeepseekV41Trainer`` under FSDP2 (the environment ``accelerate launch`` gives with
    ``examples/accelerate/fsdp2_lora.yaml``, fp32) on the natively loaded stand-in with LoRA: 2 steps of 2 rows per
    process, a checkpoint at the end under expert parallelism. Returns the trained adapters, whole."""
    import os

    from modeling_dsv41 import DeepseekV41Trainer, DeepseekV41TrainingArguments

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_WORLD_SIZE=str(WORLD),
        ACCELERATE_USE_FSDP="true",
        FSDP_VERSION="2",
        FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP",
        FSDP_RESHARD_AFTER_FORWARD="true",
        FSDP_OFFLOAD_PARAMS="false",
        FSDP_CPU_RAM_EFFICIENT_LOADING="false",
        ACCELERATE_MIXED_PRECISION="no",
    )
    ids = torch.randint(3, QUANT_FORMAT_TEXT["vocab_size"], (8, 16), generator=torch.Generator().manual_seed(5))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    args = DeepseekV41TrainingArguments(
        output_dir=str(output),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        expert_parallel_size=expert_parallel_size,
        bias_update_speed=0,
        report_to="none",
        logging_steps=1,
        seed=0,
        save_steps=2,
        save_strategy="steps" if expert_parallel_size > 1 else "no",  # FSDP2 alone: tested elsewhere
    )
    trainer = DeepseekV41Trainer(model=lora_model(folder, "fp8"), args=args, train_dataset=rows)
    trainer.train()
    experts = trainer.model.base_model.model.model.layers[0].ffn.experts.get_base_layer()
    names = experts.gate_up_proj.device_mesh.mesh_dim_names or ()
    assert ("ep" in names) == (expert_parallel_size > 1), names  # split by expert, or FSDP2's rows
    assert (output / "checkpoint-2" / "adapter_model.safetensors").is_file() == (expert_parallel_size > 1)
    return {n: p.full_tensor().detach() for n, p in _adapters(trainer.model).items()}


def _trainer_lora_with_and_without_expert_parallelism(rank: int, tmp: Path, folder: str) -> None:
    ours = _trainer_adapters(rank, Path(folder), tmp / "ep", WORLD)
    theirs = _trainer_adapters(rank, Path(folder), tmp / "fsdp", 1)
    assert ours.keys() == theirs.keys() and any(".experts." in n for n in ours)
    for name, tensor in ours.items():
        # the same products on the same rows, each gradient a sum of the two processes' halves either way
        # (measured: bit-identical)
        torch.testing.assert_close(tensor, theirs[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_trainer_lora_of_the_native_base_with_expert_parallelism_trains_as_fsdp2_alone(released, tmp_path):
    """``DeepseekV41Trainer`` with ``expert_parallel_size=2`` trains LoRA (attention, shared and routed experts) of
    the natively loaded stand-in on 2 processes to the adapters of the same run with FSDP2 alone."""
    spawn(_trainer_lora_with_and_without_expert_parallelism, tmp_path, str(released), timeout_s=300)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor


def _each_rank_reads_its_shards_of_the_release(
    rank: int, tmp: Path, folder: str, engram_table_dtype: str, expert_parallel_size: int, world: int
) -> None:
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from configuration import DeepseekV41Config
    from modeling_dsv41 import DeepseekV41ForCausalLM
    from modeling_dsv41.released import sharded_reading
    from modeling_dsv41.released.loading import empty_native_model
    from modeling_dsv41.training.fsdp import load_sharded_weights, shard_model

    config = DeepseekV41Config.from_pretrained(folder)
    config.text_config.engram_table_dtype = engram_table_dtype
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    lora = LoraConfig(r=4, target_modules=FP8_TARGETS, target_parameters=EXPERT_TARGETS)
    whole = get_peft_model(DeepseekV41ForCausalLM.from_pretrained(folder, config=config), lora)
    # today's way: every process loads the whole model, then shards it
    shard_model(whole, mp_policy=policy, expert_parallel_size=expert_parallel_size)

    reads = []  # what each rank reads of the checkpoint: (key, box)
    read = sharded_reading._Files.read
    sharded_reading._Files.read = lambda self, key, box, *out: reads.append((key, box)) or read(self, key, box, *out)
    ours = get_peft_model(empty_native_model(DeepseekV41ForCausalLM, folder, config=config), lora)
    assert all(p.is_meta for n, p in ours.named_parameters())
    shard_model(ours, mp_policy=policy, expert_parallel_size=expert_parallel_size)
    load_sharded_weights(ours, folder)
    sharded_reading._Files.read = read

    theirs = dict(whole.named_parameters())
    for name, param in ours.named_parameters():
        if "lora_" in name:  # PEFT's initialization, drawn from another seed here
            continue
        reference = theirs[name]
        local, expected = (t.to_local() if isinstance(t, DTensor) else t for t in (param, reference))
        assert isinstance(param, DTensor) == isinstance(reference, DTensor), name
        assert local.dtype == expected.dtype and local.shape == expected.shape, name
        assert torch.equal(_bits(local.detach()), _bits(expected.detach())), name
    for (name, buffer), (_, expected) in zip(ours.named_buffers(), whole.named_buffers()):
        assert torch.equal(buffer, expected), name
    # the rank read only its rows of the experts: its share of them, each whole (FP4 bytes and scales)
    expert_reads = [key for key, _ in reads if ".experts." in key and key.endswith(".weight")]
    experts = QUANT_FORMAT_TEXT["n_routed_experts"] * QUANT_FORMAT_TEXT["num_hidden_layers"] * 3
    assert len(expert_reads) == experts // world, len(expert_reads)
    tables = [key for key, _ in reads if ".engram.embed." in key]
    assert not tables if engram_table_dtype == "fp8" else tables  # FP8 tables are memory-mapped, not read
    if expert_parallel_size > 1:  # the experts split by expert on the EP mesh; one bf16 step runs on them
        with pytest.raises(ValueError, match=r"weights are frozen: expert_parallel_size trains LoRA adapters"):
            shard_model(
                empty_native_model(DeepseekV41ForCausalLM, folder, config=config), expert_parallel_size=EP_SIZE
            )
        experts = [p for n, p in ours.named_parameters() if ".experts." in n and "lora_" not in n]
        assert experts and all(p.device_mesh.mesh_dim_names == ("ep_shard", "ep") for p in experts)
        ids = torch.randint(3, QUANT_FORMAT_TEXT["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(rank))
        ours(input_ids=ids, labels=ids).loss.backward()
        grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
        assert all(g is not None and torch.isfinite(g.full_tensor()).all() for g in grads.values())
        assert any(".experts." in n for n in grads)


@pytest.mark.parametrize(
    ("engram_table_dtype", "expert_parallel_size", "world"),
    [("fp8", 1, WORLD), ("float", 1, WORLD), ("fp8", EP_SIZE, 2 * EP_SIZE)],
)
def test_each_rank_reads_its_shards_of_the_release_equal_to_loading_whole_then_sharding(
    released, engram_table_dtype, expert_parallel_size, world, tmp_path
):
    """The model built on the meta device, LoRA added, sharded, then each rank reading only its shards of the released
    checkpoint (``load_sharded_weights``) holds the same bytes as the natively loaded model sharded after loading:
    every FP8 weight and E8M0 scale, FP4 expert, dequantized ``wo_a`` / Engram ``wkv`` and plain tensor, bit for bit.
    With ``expert_parallel_size=2`` on 4 processes, the FP4 experts are split by expert over ``ep`` and by rows of
    those over ``ep_shard`` (each rank reads its part of its experts' bytes and scales only) and a bf16 training step
    runs on the model so read."""
    spawn(
        _each_rank_reads_its_shards_of_the_release,
        tmp_path,
        str(released),
        engram_table_dtype,
        expert_parallel_size,
        world,
        world_size=world,
        timeout_s=240,
    )


def _reads_its_experts_under_expert_parallelism(rank: int, tmp: Path, folder: str) -> None:
    from torch.distributed.tensor import DTensor
    from transformers import FineGrainedFP8Config

    from modeling_dsv41 import DeepseekV41ForCausalLM
    from modeling_dsv41.released import sharded_reading
    from modeling_dsv41.released.loading import empty_dequantized_model
    from modeling_dsv41.training.fsdp import load_sharded_weights, shard_model

    whole = DeepseekV41ForCausalLM.from_pretrained(folder, quantization_config=FineGrainedFP8Config(dequantize=True))
    shard_model(whole, expert_parallel_size=WORLD)  # every process loads the whole model, then shards it

    reads = []
    read = sharded_reading._Files.read
    sharded_reading._Files.read = lambda self, key, box, *out: reads.append((key, box)) or read(self, key, box, *out)
    ours = empty_dequantized_model(DeepseekV41ForCausalLM, folder)
    shard_model(ours, expert_parallel_size=WORLD)
    load_sharded_weights(ours, folder)
    sharded_reading._Files.read = read

    theirs = dict(whole.named_parameters())
    for name, param in ours.named_parameters():
        local, expected = (t.to_local() if isinstance(t, DTensor) else t for t in (param, theirs[name]))
        assert local.dtype == expected.dtype and local.shape == expected.shape, name
        assert torch.equal(local.detach(), expected.detach()), name
    # each rank read the FP4 bytes of its own experts only, each whole
    expert_reads = [key for key, _ in reads if ".experts." in key and key.endswith(".weight")]
    experts = QUANT_FORMAT_TEXT["n_routed_experts"] * QUANT_FORMAT_TEXT["num_hidden_layers"] * 3
    assert len(expert_reads) == experts // WORLD, len(expert_reads)


def test_each_rank_reads_its_experts_of_the_release_under_expert_parallelism(released, tmp_path):
    """Full fine-tuning of the release with expert parallelism: the model built on the meta device as the
    dequantizing load builds it (``empty_dequantized_model``), split by expert over the ranks, then each rank
    dequantizing only its shards as it reads them equals the dequantized model loaded whole, then sharded, bit for
    bit."""
    spawn(_reads_its_experts_under_expert_parallelism, tmp_path, str(released), timeout_s=240)


def test_fsdp2_before_torch_2_12_refuses_integer_parameters_with_the_reason():
    """torch 2.11's fully_shard (the H200 image's torch) makes every shard a Parameter that requires gradients, which
    crashes on the packed FP4 experts (int8) deep inside FSDP2: shard_model says why and what to do instead."""
    from modeling_dsv41.training.fsdp import _check_fsdp2_takes

    packed = nn.Module()
    packed.weight = nn.Parameter(torch.zeros(4, 2, dtype=torch.float8_e4m3fn), requires_grad=False)
    packed.experts = nn.Parameter(torch.zeros(4, 2, dtype=torch.int8), requires_grad=False)
    with pytest.raises(ValueError, match=r"torch 2\.11\.0\+cu130's FSDP2 .* \(here experts, torch.int8.*1 in all"):
        _check_fsdp2_takes(packed, "2.11.0+cu130")
    _check_fsdp2_takes(packed, "2.12.0")
    _check_fsdp2_takes(packed, "3.0.1")
    del packed.experts
    _check_fsdp2_takes(packed, "2.4.1")  # floating parameters only (FP8 included): every FSDP2 shards them


@pytest.fixture(scope="module")
def released_with_dspark(tmp_path_factory) -> Path:
    """The stand-in of :func:`released` with a DSpark draft block, in the released storage format."""
    import modeling_dsv41  # noqa: F401
    from configuration import DeepseekV41Config
    from modeling_dsv41 import DeepseekV41ForCausalLM
    from modeling_dsv41.released.writing import save_released_checkpoint

    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(DeepseekV41Config(text_config={**QUANT_FORMAT_TEXT, **DSPARK})).to(torch.bfloat16)
    folder = tmp_path_factory.mktemp("released_dspark")
    save_released_checkpoint(model, folder, max_shard_bytes=1 << 20)
    stub_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


def _shard_as_torch(version: str, model, **kwargs) -> None:
    """``shard_model`` deciding as it does on torch ``version`` (the FSDP2 it calls is still this torch's)."""
    from modeling_dsv41.training.fsdp import shard_model

    running = torch.__version__
    torch.__version__ = version
    try:
        shard_model(model, **kwargs)
    finally:
        torch.__version__ = running


def _integer_parameters(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if not p.is_floating_point()}


def _packed_experts_held_out_train_as_sharded(rank: int, tmp: Path, folder: str, world: int) -> None:
    from torch.distributed.tensor import DTensor

    from modeling_dsv41.training.fsdp import FSDP2_INTEGER_PARAMETERS, _check_fsdp2_takes

    ids = torch.randint(
        3, QUANT_FORMAT_TEXT["vocab_size"], (2 * world, 16), generator=torch.Generator().manual_seed(2)
    )
    parts = list(ids.chunk(world))
    single = lora_model(Path(folder), "fp8")
    stored = {n: p.detach().clone() for n, p in _integer_parameters(single).items()}
    assert any(".mtp." in n for n in stored) and any(".layers." in n for n in stored)
    # one process, or experts split by expert over every process: nothing refused on the old torch
    assert set(_integer_parameters(single).values()) <= _check_fsdp2_takes(single, "2.11.0", whole_on_each_rank=True)
    if world > 1:  # FSDP2 alone on several processes would hold every layer's experts on each: refused, saying why
        with pytest.raises(ValueError, match=r"torch 2\.11\.0's FSDP2 .* \(here \S*layers\.0\.ffn\.experts.*4 in all"):
            _check_fsdp2_takes(single, "2.11.0")
    model = lora_model(Path(folder), "fp8")
    _shard_as_torch("2.11.0", model, expert_parallel_size=world)

    integer = _integer_parameters(model)
    assert integer.keys() == stored.keys()
    for name, param in integer.items():
        assert not param.requires_grad, name
        if ".mtp." in name or world == 1:  # replicated: whole, as stored
            assert not isinstance(param, DTensor), name
            assert torch.equal(param, stored[name]), name
        else:  # this rank's experts, whole: split by expert only, not by FSDP2
            assert isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == ("ep",), name
            mine = stored[name].chunk(world)[rank]
            assert torch.equal(param.to_local(), mine), name
    # the launch's loading (examples/lora_released.py): built on the meta device, sharded, each rank reading its part
    from peft import LoraConfig, get_peft_model

    from configuration import DeepseekV41Config
    from modeling_dsv41 import DeepseekV41ForCausalLM
    from modeling_dsv41.released.loading import empty_native_model
    from modeling_dsv41.training.fsdp import load_sharded_weights

    config = DeepseekV41Config.from_pretrained(folder)
    config.text_config.engram_table_dtype = "fp8"
    lora = LoraConfig(r=4, target_modules=FP8_TARGETS, target_parameters=EXPERT_TARGETS)
    read = get_peft_model(empty_native_model(DeepseekV41ForCausalLM, folder, config=config), lora)
    _shard_as_torch("2.11.0", read, expert_parallel_size=world)
    load_sharded_weights(read, folder)
    loaded = dict(model.named_parameters())
    for name, param in read.named_parameters():
        if "lora_" not in name:  # PEFT's initialization differs (another seed, init_lora_weights)
            local, expected = (t.to_local() if isinstance(t, DTensor) else t for t in (param, loaded[name]))
            assert isinstance(param, DTensor) == isinstance(loaded[name], DTensor), name
            assert torch.equal(_bits(local.detach()), _bits(expected.detach())), name
    del read

    _sgd_steps(single, [parts] * STEPS)
    _sgd_steps(model, [[parts[rank]]] * STEPS)
    ours, theirs = _adapters(model), _adapters(single)
    assert ours.keys() == theirs.keys() and any(".mtp." in n and ".experts." in n for n in ours)
    for name, param in ours.items():
        full = param.full_tensor().detach()
        # each rank's products are one process's for its part; only the mean over the parts is summed in another
        # order (measured: bit-identical)
        torch.testing.assert_close(full, theirs[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    if (major, minor) >= FSDP2_INTEGER_PARAMETERS:  # this torch's FSDP2 shards them: the same steps, bit for bit
        sharded = lora_model(Path(folder), "fp8")
        _shard_as_torch(torch.__version__, sharded, expert_parallel_size=world)
        assert all(isinstance(p, DTensor) for p in _integer_parameters(sharded).values())  # FSDP2's, the draft's too
        _sgd_steps(sharded, [[parts[rank]]] * STEPS)
        for name, param in _adapters(sharded).items():
            assert torch.equal(param.full_tensor(), ours[name].full_tensor()), name


@pytest.mark.parametrize("world", [1, EP_SIZE])
def test_packed_experts_held_out_of_fsdp2_before_torch_2_12_train_as_sharded(released_with_dspark, world, tmp_path):
    """On a torch whose FSDP2 cannot shard integer tensors (before 2.12), ``shard_model`` keeps the packed FP4
    experts (and their scales) whole on each process, out of FSDP2, where each process holds its experts whole
    anyway: one process, or the backbone's experts split by expert over every process; the DSpark draft block's
    experts are replicated. The model built on the meta device and read rank by rank holds the same bytes as the one
    loaded whole, then sharded; 3 SGD steps of LoRA give one process's adapters, and on this torch the adapters of
    the path that shards them, bit for bit."""
    spawn(
        _packed_experts_held_out_train_as_sharded,
        tmp_path,
        str(released_with_dspark),
        world,
        world_size=world,
        timeout_s=300,
    )
