"""docs/released-model.md's launch of LoRA on the release (``examples/lora_released.py`` under
``examples/accelerate/fsdp2_lora.yaml``), run as printed on 4 CPU processes (gloo) on a released-format stand-in: the
flags that size the run (processes, sequence length, steps, rank) and the paths are the only ones changed. Before
torch 2.12, whose FSDP2 cannot shard the packed FP4 experts, the printed launch is refused, saying what runs, and the
tests below run it with ``--expert_parallel_size 4`` added (each process holding its experts whole).

- Training: the adapters after 3 steps equal those of one process running the same script unsharded (the same
  rows, in 4 micro-batches of accumulation instead of 4 processes), and a checkpoint holds the adapter.
- Resuming: the run stopped after its checkpoint and launched again with ``--resume_from_checkpoint last`` ends with
  the same adapters. With rank 2 on 4 processes, two processes hold empty shards of every ``lora_A``: the case where
  accelerate's preparation once merged them into one optimizer parameter.
- The adapter saved at the end loads on the natively loaded base in one process (``PeftModel.from_pretrained``),
  as saved, and changes its logits.
- Memory: each process's peak proportional set size (PSS: a page of the page cache or of a shared library counted
  divided among the processes mapping it, ``tests/pss_probe``) while loading stays within 1.3 x (its shards of the
  stored weights + its quarter of the Engram tables) above its PSS at the end of its imports; over the first steps
  too (not met yet: an expected failure, see the test).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from documentation import REPO_ROOT, command_lines

LAUNCH_TIMEOUT_S = 900  # ~2 min on 2 idle cores; a loaded machine is several times slower
PROCESSES = 4
PSS_BUDGET = 1.3
# 261.7 MiB stored ("several hundred MB", issue 38): 8 decoder layers of 128 FP4 experts (211.3 MiB with the rest)
# and two FP8 Engram tables (50.4 MiB); a step routes to 2 experts per token, so the experts cost time only to read
STAND_IN = dict(
    vocab_size=512,
    hidden_size=256,
    moe_intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=4,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=64,
    o_lora_rank=32,
    o_groups=2,
    n_routed_experts=128,
    num_experts_per_tok=2,
    sliding_window=16,
    compress_ratios=[0, 2] * 4,
    kv_source_layer_ids=[1],
    index_source_layer_ids=[1],
    index_n_heads=4,
    index_head_dim=64,
    index_topk=8,
    candidate_source_layer_id=-1,
    engram_layer_ids=[0, 4],
    engram_num_embeddings=[200000, 200000],
    engram_vocab_size=100,
    engram_n_heads=2,
    engram_head_dim=128,
    engram_compressed_vocab_size=256,
    num_nextn_predict_layers=0,
)
SEQ_LEN, STEPS, RANK = 16, 3, 2


def printed_launch() -> list[str]:
    """The docs' launch of examples/lora_released.py (argv)."""
    found = [shlex.split(line) for line in command_lines("accelerate launch") if "examples/lora_released.py" in line]
    assert len(found) == 1, found
    return found[0]


def with_flags(argv: list[str], **values) -> list[str]:
    """``argv`` with the values of the given ``--flags`` replaced (each must be printed)."""
    argv = list(argv)
    for name, value in values.items():
        argv[argv.index(f"--{name}") + 1] = str(value)
    return argv


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A folder laid out as the docs' command expects: the repository's ``examples/``, the stand-in in the released
    format (as ``hf download`` leaves it) and a JSON-lines data file."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    import modeling_dsv41  # noqa: F401
    from configuration import DeepseekV41Config
    from modeling_dsv41 import DeepseekV41ForCausalLM
    from modeling_dsv41.released.writing import save_released_checkpoint

    root = tmp_path_factory.mktemp("lora_launch")
    (root / "examples").symlink_to(REPO_ROOT / "examples")
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(DeepseekV41Config(text_config=STAND_IN)).to(torch.bfloat16)
    argv = printed_launch()
    folder = root / argv[argv.index("--model") + 1]
    save_released_checkpoint(model, folder, max_shard_bytes=8 << 20)
    del model
    vocab = {f"{'t' if i % 2 == 0 else 'T'}{i // 2}": i for i in range(STAND_IN["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    words = torch.randint(0, STAND_IN["vocab_size"], (16, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    texts = [" ".join(f"{'t' if w % 2 == 0 else 'T'}{w // 2}" for w in row.tolist()) for row in words]
    lines = [json.dumps({"text": text}) for text in texts]
    (root / argv[argv.index("--data") + 1]).write_text("\n".join(lines) + "\n")
    return root


def run(argv: list[str], cwd: Path, pss_dir: Path | None = None, refused: bool = False) -> str:
    """Run ``argv`` in ``cwd`` with this Python's environment; its stderr. It must succeed (or, ``refused``, fail)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    python_path = [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": path}
    if pss_dir is not None:
        python_path.insert(0, str(REPO_ROOT / "tests" / "pss_probe"))
        env["DSV41_PSS_DIR"] = str(pss_dir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in python_path if p)
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, cwd=cwd)
    errors = [line for line in result.stderr.splitlines() if "Error" in line or "error:" in line]
    if refused:
        assert result.returncode != 0, result.stdout[-2000:] + result.stderr[-4000:]
        return result.stderr
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:] + "\n".join(errors[:20])
    return result.stderr


def fsdp2_shards_integer_parameters() -> bool:
    """Whether this torch's FSDP2 shards the packed FP4 experts (torch 2.12 on); before, ``shard_model`` keeps them
    whole on each process, which it does only where each process holds its experts whole anyway."""
    from modeling_dsv41.training.fsdp import FSDP2_INTEGER_PARAMETERS

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= FSDP2_INTEGER_PARAMETERS


def stored_bytes(folder: Path) -> tuple[int, int]:
    """(bytes of every stored tensor but the Engram tables, bytes of the Engram tables) of a safetensors folder."""
    from safetensors import safe_open

    weights = tables = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                sliced = f.get_slice(key)
                size = (
                    torch.Size(sliced.get_shape()).numel()
                    * torch.empty(
                        (),
                        dtype=getattr(
                            torch,
                            {
                                "F8_E4M3": "float8_e4m3fn",
                                "F8_E8M0": "float8_e8m0fnu",
                                "I8": "int8",
                                "U8": "uint8",
                                "BF16": "bfloat16",
                                "F32": "float32",
                                "I64": "int64",
                            }[sliced.get_dtype()],
                        ),
                    ).element_size()
                )
                if ".engram.embed." in key:
                    tables += size
                else:
                    weights += size
    return weights, tables


def adapters(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def runs(workspace, tmp_path_factory) -> dict[str, Path]:
    """The printed launch on 4 processes (each process's PSS recorded) and the script on one process.

    Before torch 2.12 (GPU images may hold 2.11) FSDP2 cannot shard the packed FP4 experts: the printed launch,
    FSDP2 alone, is refused before loading, saying what runs, and the launch that runs there is the documented one
    with ``--expert_parallel_size`` equal to the number of processes (each holds its experts whole, out of FSDP2)."""
    out = tmp_path_factory.mktemp("lora_runs")
    argv = printed_launch()
    sized = {
        "num_processes": PROCESSES,
        "seq_len": SEQ_LEN,
        "max_steps": STEPS,
        "save_steps": 2,
        "rank": RANK,
        "output_dir": out / "sharded",
    }
    launch = with_flags(argv, **sized)
    # one process, the script itself: the same rows as 4 micro-batches of one
    script = with_flags(launch[launch.index("examples/lora_released.py") :], output_dir=out / "single")
    if not fsdp2_shards_integer_parameters():
        stderr = run(launch, workspace, refused=True)
        assert re.search(
            rf"torch {re.escape(torch.__version__)}'s FSDP2 cannot shard parameters of integer dtypes \(here "
            r"\S*layers\.0\.ffn\.experts\S*, torch\.int8.*16 in all\).*one process, or expert_parallel_size equal to "
            r"the number of processes",
            stderr,
        ), stderr[-4000:]
        launch = [*launch, "--expert_parallel_size", str(PROCESSES)]
    (out / "pss").mkdir()
    run(launch, workspace, out / "pss")
    run([sys.executable, *script, "--gradient_accumulation_steps", str(PROCESSES)], workspace)
    return {
        "sharded": out / "sharded",
        "single": out / "single",
        "pss": out / "pss",
        "launch": launch,
        "model": workspace / argv[argv.index("--model") + 1],
        "workspace": workspace,
    }


@pytest.mark.slow
def test_four_processes_train_the_adapters_one_process_trains(runs):
    ours, theirs = adapters(runs["sharded"]), adapters(runs["single"])
    assert ours.keys() == theirs.keys() and any(".experts." in k for k in ours) and any("wo_b" in k for k in ours)
    assert (runs["sharded"] / "checkpoint-2" / "adapter_model.safetensors").is_file()
    initial = {k: v for k, v in ours.items() if "lora_B" in k}  # PEFT starts lora_B at zero: it must have moved
    assert all(v.abs().max() > 0 for v in initial.values())
    for name, tensor in ours.items():
        # the same products on the same rows; only the mean over the 4 rows' gradients is summed in another order
        torch.testing.assert_close(tensor, theirs[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_the_launch_resumed_from_its_checkpoint_ends_with_the_same_adapters(runs, tmp_path):
    """The run stopped after its checkpoint at step 2 (the later checkpoint and the final adapter gone) and launched
    again with ``--resume_from_checkpoint last``: the adapter and AdamW state load from the checkpoint."""
    resumed = tmp_path / "resumed"
    shutil.copytree(runs["sharded"] / "checkpoint-2", resumed / "checkpoint-2")
    run([*with_flags(runs["launch"], output_dir=resumed), "--resume_from_checkpoint", "last"], runs["workspace"])
    ours, theirs = adapters(resumed), adapters(runs["sharded"])
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_the_saved_adapter_loads_on_the_natively_loaded_base(runs):
    from peft import PeftModel, get_peft_model_state_dict

    from modeling_dsv41 import DeepseekV41ForCausalLM

    ids = torch.randint(3, STAND_IN["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(4))
    base = DeepseekV41ForCausalLM.from_pretrained(runs["model"]).eval()
    with torch.no_grad():
        before = base(input_ids=ids).logits
    adapted = PeftModel.from_pretrained(base, runs["sharded"]).eval()
    loaded, saved = get_peft_model_state_dict(adapted), adapters(runs["sharded"])
    assert loaded.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
    with torch.no_grad():
        after = adapted(input_ids=ids).logits
    assert not torch.equal(before, after)  # the adapter acts


def pss_reports(runs) -> tuple[float, list[dict]]:
    """(each process's share: its shards of the stored weights + its quarter of the Engram tables, the launched
    processes' PSS reports)."""
    weights, tables = stored_bytes(runs["model"])
    reports = [json.loads(p.read_text()) for p in runs["pss"].glob("pss_*.json")]
    reports = [r for r in reports if r["script"] == "lora_released.py"]
    assert len(reports) == PROCESSES, reports
    print(f"stored: {weights / 2**20:.1f} MiB + Engram {tables / 2**20:.1f} MiB")
    return (weights + tables) / PROCESSES, reports


def rises(share: float, reports: list[dict], key: str) -> list[float]:
    found = sorted(r[key] - r["baseline"] for r in reports)
    print(
        f"per process: shards + Engram share {share / 2**20:.1f} MiB; peak PSS rise ({key}) "
        f"{[round(r / 2**20, 1) for r in found]} MiB = {[round(r / share, 2) for r in found]} x"
    )
    return found


@pytest.mark.slow
def test_each_process_reads_only_its_shards_and_maps_its_share_of_the_engram_tables(runs):
    """While loading (from the end of the imports to ``load_sharded_weights``'s return: the Trainer built, the model
    sharded on the meta device, the Engram tables mapped and the shards read), each process's PSS rises by at most
    1.3 x its shards and its quarter of the tables. Reading the whole model in each process would be 4 x."""
    share, reports = pss_reports(runs)
    loading = rises(share, reports, "loaded")
    assert loading[-1] <= PSS_BUDGET * share, f"loading: {loading[-1] / 2**20:.1f} MiB > {PSS_BUDGET} x the share"


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason=(
        "not met on the CPU (measured on this stand-in, a 65.4 MiB share per process): over the first steps each "
        "process's PSS rises about 10 x the share (625-680 MiB). Most of it, about 500 MiB, is glibc's heap keeping "
        "freed memory resident (with MALLOC_MMAP_THRESHOLD_=131072 the rise is 204 MiB, 3.1 x); the rest is the "
        "step's working set, host memory on CPU processes (FSDP2's all-gather of a decoder layer and of the next, 26 "
        "MiB stored each, in three buffers; the activations), device memory on GPUs. With --expert_parallel_size 4 "
        "added the rise is 2.8-3.2 x; counted after the second step, the shards and the adapters with their gradients "
        "and AdamW state are 1.06 x the share and the allocations that are not tensors 23 MiB more, 1.4 x "
        "before any working set or freed heap: a per-process cost the stand-in's share cannot absorb "
        "(docs/released-model.md)"
    ),
)
def test_the_first_steps_stay_within_the_share(runs):
    share, reports = pss_reports(runs)
    run = rises(share, reports, "peak")
    assert run[-1] <= PSS_BUDGET * share, f"run: {run[-1] / 2**20:.1f} MiB > {PSS_BUDGET} x the share"
