"""Engram tables outside the layers (gathered rows only, any placement, memory-mapped), device maps and the planner
of ``dsv41 inspect --devices``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from configuration import DeepseekV41Config
from modeling_dsv41 import DeepseekV41ForCausalLM
from modeling_dsv41.cli import main
from modeling_dsv41.cli.commands import parse_devices
from modeling_dsv41.cli.inspection import build_meta_model
from modeling_dsv41.placement import (
    ENGRAM_TABLE,
    cache_bytes_per_token,
    engram_tables_off_map,
    plan_device_map,
    released_storage_bytes,
)
import tiny_models

GiB = 2**30
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_models.tiny_model(engram_map=None)


def _ids(batch=2, length=12, seed=0):
    return torch.randint(3, 500, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------------------
# rows gathered up front
# ---------------------------------------------------------------------------------------------------------------------


def test_rows_are_gathered_up_front_and_equal_the_layer_lookup(tiny_model, monkeypatch):
    backbone = tiny_model.model
    ids = _ids()
    hash_ids = backbone.engram_hasher(ids)
    rows = backbone.gather_engram_rows(hash_ids)
    engram_layers = [layer for layer in backbone.layers if layer.engram is not None]
    assert sorted(rows) == [layer.layer_id for layer in engram_layers]
    for layer in engram_layers:
        expected = layer.engram.embed(hash_ids[:, :, layer.engram.hash_index]).flatten(-2)
        assert torch.equal(rows[layer.layer_id], expected)
    with torch.no_grad():
        gathered = tiny_model(input_ids=ids).logits
        monkeypatch.setattr(type(backbone), "gather_engram_rows", lambda self, hash_ids: {})
        in_layer = tiny_model(input_ids=ids).logits  # each layer looks its rows up itself (accelerate offload path)
    assert torch.equal(gathered, in_layer)


def test_lookup_returns_the_addressed_rows_and_leaves_the_table_in_place(tiny_model):
    """Only the addressed rows come back; the table object itself is not moved or copied."""
    engram = next(layer.engram for layer in tiny_model.model.layers if layer.engram is not None)
    hash_ids = tiny_model.model.engram_hasher(_ids())[:, :, engram.hash_index]
    table = engram.embed.weight
    rows = engram.lookup(hash_ids, "cpu")
    assert engram.embed.weight is table and rows.shape == (*hash_ids.shape[:2], hash_ids.shape[-1] * table.shape[1])
    assert torch.equal(rows, table[hash_ids].flatten(-2))


# ---------------------------------------------------------------------------------------------------------------------
# memory-mapped tables
# ---------------------------------------------------------------------------------------------------------------------

# A stand-in whose tables are big (2 x ~128 MiB) next to the rest (~1 MiB) and whose hash buckets spread over them.
_STAND_IN = dict(engram_vocab_size=500_000, engram_n_heads=2, engram_max_ngram_size=3)

_RSS_PROBE = textwrap.dedent(
    """
    import gc, json, os, sys, torch, psutil
    from modeling_dsv41 import DeepseekV41ForCausalLM
    folder, placement = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    # start from disk, not from a warm page cache: a cached page is mapped by the kernel's fault-around along with
    # its faulting neighbours (clean, reclaimable, but counted in RSS). DONTNEED drops only clean pages, so the
    # just-written file is flushed first (under a busy disk its pages were still dirty: 140 MiB instead of ~30)
    with open(folder + "/model.safetensors", "rb") as handle:
        os.fsync(handle.fileno())
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    process = psutil.Process()
    ids = torch.load(folder + "/ids.pt")
    before = process.memory_info().rss
    model = DeepseekV41ForCausalLM.from_pretrained(folder, engram_tables="mmap").eval()
    tables = [layer.engram.embed.weight for layer in model.model.layers if layer.engram is not None]
    if placement == "memory":  # the same tables copied into the process's memory
        for table in tables:
            table.data = table.data.clone()
    gc.collect()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    after = process.memory_info().rss
    torch.save(logits, folder + f"/logits-{placement}.pt")
    print(json.dumps({"rss_growth": after - before}))
    """
)


def _probe(folder: Path, placement: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE, str(folder), placement],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_memory_mapped_tables_stay_on_disk_and_give_the_same_logits(tmp_path):
    pytest.importorskip("psutil")
    config = DeepseekV41Config.from_preset("tiny")
    text = config.text_config
    for key, value in _STAND_IN.items():
        setattr(text, key, value)
    from modeling_dsv41.engram import DeepseekV41NgramHasher

    # as many rows as the hash buckets span: the ids of a sequence point all over the tables
    probe = DeepseekV41NgramHasher.__new__(DeepseekV41NgramHasher)
    probe.layer_ids, probe.max_ngram_size, probe.n_heads = tuple(text.engram_layer_ids), 3, 2
    probe.engram_vocab_size, probe.compressed_vocab_size = 500_000, text.engram_compressed_vocab_size
    primes, _, offsets = probe._hash_constants()
    text.engram_num_embeddings = (offsets[:, -1] + primes[:, -1, -1]).tolist()
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(config).eval()
    ids = _ids(batch=2, length=64)
    with torch.no_grad():
        expected = model(input_ids=ids).logits  # tables in memory
    table_bytes = sum(layer.engram.embed.weight.nbytes for layer in model.model.layers if layer.engram is not None)
    assert table_bytes > 400 * 2**20
    model.save_pretrained(tmp_path)
    del model
    torch.save(ids, tmp_path / "ids.pt")

    mapped, in_memory = _probe(tmp_path, "mmap"), _probe(tmp_path, "memory")
    # same process setup, tables mapped vs in memory: the same logits, bit for bit
    assert torch.equal(torch.load(tmp_path / "logits-mmap.pt"), torch.load(tmp_path / "logits-memory.pt"))
    # and those of the model before saving (one thread there, the default here: fp32 sums in another order)
    torch.testing.assert_close(torch.load(tmp_path / "logits-mmap.pt"), expected, rtol=1e-5, atol=1e-6)
    assert in_memory["rss_growth"] > 0.9 * table_bytes  # what holding the tables costs: the check can fail
    # memory-mapped: pages are read only where the hash ids point, 2 sequences x 64 tokens x 4 columns x 2 layers =
    # 1024 rows of 128 bytes, at most one 4 KiB page each (4 MiB); the rest is loading and running a tiny model
    gathered_pages = 1024 * 4096
    assert mapped["rss_growth"] < gathered_pages + 64 * 2**20, mapped
    assert mapped["rss_growth"] < 0.2 * table_bytes, mapped


def test_memory_map_refuses_a_table_stored_otherwise(tiny_model, tmp_path):
    from safetensors.torch import save_file

    from modeling_dsv41.placement import memory_map_engram_tables

    engram = next(layer for layer in tiny_model.model.layers if layer.engram is not None)
    save_file(
        {f"model.layers.{engram.layer_id}.engram.embed.weight": engram.engram.embed.weight.detach().half()},
        tmp_path / "model.safetensors",
    )
    with pytest.raises(ValueError, match="stored as torch.float16"):
        memory_map_engram_tables(tiny_model, tmp_path)


def test_engram_tables_argument_is_checked(tmp_path):
    with pytest.raises(ValueError, match="engram_tables must be"):
        DeepseekV41ForCausalLM.from_pretrained(tmp_path, engram_tables="gpu-ish")


# ---------------------------------------------------------------------------------------------------------------------
# device maps
# ---------------------------------------------------------------------------------------------------------------------


def test_tables_come_off_a_device_map_and_everything_else_stays_covered(tiny_model):
    device_map = engram_tables_off_map({"": "cpu"}, tiny_model)
    tables = [name for name, _ in tiny_model.named_modules() if ENGRAM_TABLE.search(name)]
    assert tables == ["model.layers.0.engram.embed", "model.layers.1.engram.embed"]
    for name, _ in [*tiny_model.named_parameters(), *tiny_model.named_buffers()]:
        covered = any(name == key or name.startswith(key + ".") for key in device_map)
        assert covered != any(name.startswith(table + ".") for table in tables), name
    assert "model.layers.2" in device_map  # layers without a table stay whole


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(device_map="auto"),
        dict(device_map="auto", engram_tables="cpu"),
        dict(device_map={"": "cpu"}, engram_tables="cpu"),
        dict(engram_tables="mmap"),
    ],
    ids=["auto", "auto-host", "dict-host", "mmap"],
)
def test_loading_with_a_table_placement_gives_the_same_logits(tiny_model, tmp_path, kwargs):
    tiny_model.save_pretrained(tmp_path)
    reloaded = DeepseekV41ForCausalLM.from_pretrained(tmp_path, **kwargs).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids=_ids()).logits, tiny_model(input_ids=_ids()).logits, rtol=0, atol=0
        )


def test_engram_layers_split_off_a_multi_device_map_get_their_own_hook(tmp_path):
    """Only the execution path on one CPU: the hook's device moves are the accelerate behaviour it relies on."""
    from modeling_dsv41.placement import hook_split_layers

    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(DeepseekV41Config.from_preset("tiny")).eval()
    with torch.no_grad():
        expected = model(input_ids=_ids()).logits
    model.hf_device_map = {"model.layers.0.attn": "cpu", "model.layers.2": 0}  # as after a dispatch over two devices
    hook_split_layers(model)
    hooked = {layer.layer_id for layer in model.model.layers if hasattr(layer, "_hf_hook")}
    assert hooked == {0, 1}  # the Engram layers
    assert all(model.model.layers[i]._hf_hook.execution_device == torch.device("cpu") for i in hooked)
    with torch.no_grad():
        assert torch.equal(model(input_ids=_ids()).logits, expected)


# ---------------------------------------------------------------------------------------------------------------------
# the planner, on the released size (meta device)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def released():
    config = DeepseekV41Config.from_preset("deepseek-v4.1-flash")
    return config, build_meta_model(config)


def _released_bytes(model) -> int:
    return sum(int(released_storage_bytes(name, p)) for name, p in [*model.named_parameters(), *model.named_buffers()])


def test_released_storage_sizes_follow_the_release_formats():
    fp8 = torch.empty(4096, 1024, device="meta")
    assert released_storage_bytes("model.layers.3.attn.wq_a.weight", fp8) == 4096 * 1024 + 128 * 32
    experts = torch.empty(8, 64, 32, device="meta")
    assert released_storage_bytes("model.layers.3.ffn.experts.down_proj", experts) == 8 * 64 * 32 * (0.5 + 1 / 32)
    table = torch.empty(1000, 256, device="meta", dtype=torch.bfloat16)
    assert released_storage_bytes("model.layers.1.engram.embed.weight", table) == 1000 * 256 * (1 + 1 / 32)
    norm = torch.empty(64, device="meta", dtype=torch.float32)
    assert released_storage_bytes("model.layers.3.attn_norm.weight", norm) == 256


def test_released_model_fits_8x141GiB_natively(released):
    config, model = released
    devices = dict.fromkeys(range(8), 141 * GiB)
    plan = plan_device_map(model, devices, native=True)
    assert plan.fits and set(plan.device_map.values()) <= set(range(8))
    assert all(plan.weights[d] <= devices[d] for d in plan.weights)
    assert sum(plan.weights.values()) + plan.engram_host_bytes == _released_bytes(model)
    assert 400 * GiB < _released_bytes(model) < 520 * GiB  # "about 0.5 TB" stored
    assert set(plan.engram_tables.values()) <= set(range(8))  # everything fits, tables included


def test_on_8x80GiB_the_tables_go_to_host_memory_and_the_layers_stay_on_accelerators(released):
    config, model = released
    text = config.text_config
    devices = dict.fromkeys(range(8), 80 * GiB)
    plan = plan_device_map(model, devices, native=True)
    assert plan.fits and set(plan.engram_tables.values()) == {"host"}
    expected = sum(rows * text.engram_head_dim * (1 + 1 / 32) for rows in text.engram_num_embeddings)
    assert plan.engram_host_bytes == pytest.approx(expected, rel=1e-6)
    assert not any(ENGRAM_TABLE.search(key) for key in plan.device_map)
    assert all(
        f"model.layers.{i}" in plan.device_map or any(k.startswith(f"model.layers.{i}.") for k in plan.device_map)
        for i in range(text.num_hidden_layers)
    )


def test_bf16_weights_do_not_fit_8x141GiB(released):
    _, model = released
    plan = plan_device_map(model, dict.fromkeys(range(8), 141 * GiB), native=False)
    assert not plan.fits  # ~1.2 TiB in bf16: the case native loading exists for


def test_cache_bytes_per_token_match_a_real_cache(tiny_model):
    from modeling_dsv41.generation.cache import DeepseekV41Cache

    config = tiny_model.config

    def grown(length: int) -> int:
        cache = DeepseekV41Cache(config)
        with torch.no_grad():
            tiny_model(input_ids=_ids(batch=1, length=length), cache=cache, use_cache=True)
        return sum(
            v for layer in cache.layers for k, v in layer.nbytes().items() if k in ("compressed_kv", "index_keys")
        )

    assert (grown(48) - grown(16)) / 32 == cache_bytes_per_token(config, torch.float32)
    released = DeepseekV41Config.from_preset("deepseek-v4.1-flash")
    assert cache_bytes_per_token(released) == sum(
        (512 + (128 if i in released.text_config.index_source_layer_ids else 0))
        * 2
        / released.text_config.compress_ratios[i]
        for i in released.text_config.kv_source_layer_ids
    )


# ---------------------------------------------------------------------------------------------------------------------
# dsv41 inspect --devices
# ---------------------------------------------------------------------------------------------------------------------


def test_inspect_plans_the_released_model_on_8x141GiB(capsys):
    assert main(["inspect", "deepseek-v4.1-flash", "--devices", "8x141GiB"]) == 0
    out = capsys.readouterr().out
    assert "all weights on accelerators" in out and "host memory for Engram" in out
    assert re.search(r"decode cache: [\d.]+ KiB per token", out)
    assert len(re.findall(r"^[0-7]\s+[\d.]+ \w?i?B\s+141\.0 GiB", out, flags=re.M)) == 8


@pytest.mark.parametrize("flag", ["--tp", "--ep"])
def test_inspect_prints_the_per_rank_weights_of_the_released_model(flag, capsys):
    """``--tp 8`` (``tp_plan="auto"``) and ``--ep 8`` (``DistributedConfig(tp_size=8, ep_size=8)``) both split the
    routed experts 8 ways, the backbone's and the draft head's: their FP4 bytes and E8M0 scales per rank, from the
    released sizes, independent of the model code (40 layers × 384 experts × 3 matrices of 5120 × 2304, half a byte a
    value plus a byte per 32)."""
    assert main(["inspect", "deepseek-v4.1-flash", "--devices", "8x141GiB", flag, "8"]) == 0
    out = capsys.readouterr().out
    experts = 40 * 384 * 3 * 5120 * 2304 * (0.5 + 1 / 32) / 8
    assert re.search(rf"MoE: routed experts\s+{experts / GiB:.1f} GiB\s+its part", out), out
    # the DSpark draft head's 3 blocks of 128 experts are split by the same plans (and its shared experts: ~1.5%)
    head = 3 * 128 * 3 * 5120 * 2304 * (0.5 + 1 / 32) / 8
    split_head = float(re.search(r"DSpark draft head\s+([\d.]+) MiB\s+its part", out).group(1))
    assert head / 2**20 < split_head < 1.02 * head / 2**20, (split_head, head / 2**20)
    assert re.search(r"attention\s+[\d.]+ GiB\s+whole", out)
    per_rank = float(re.search(r"weights per rank\s+([\d.]+) GiB of 141\.0 GiB", out).group(1))
    assert experts / GiB < per_rank < 141
    assert re.search(r"Engram tables: [\d.]+ GiB, whole on every rank, in host memory", out)


def test_inspect_refuses_a_tensor_parallel_size_that_cuts_scale_blocks(capsys):
    # I = 2304 = 72 blocks of 32: tp 16 leaves 144 (whole blocks), tp 5 does not divide it
    assert main(["inspect", "deepseek-v4.1-flash", "--tp", "5"]) == 2
    assert "cuts its 32-wide E8M0 scale blocks: use tp_size in [2, 3, 4]" in capsys.readouterr().err


def test_parse_devices():
    assert parse_devices("8x141GiB") == dict.fromkeys(range(8), 141 * GiB)
    assert parse_devices("1x80GB, 40GiB") == {0: 80 * 10**9, 1: 40 * GiB}


@pytest.mark.parametrize("spec", ["8xfoo", "0x80GiB", "80", "x80GiB"])
def test_bad_devices_are_one_line_usage_errors(spec, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", "--devices", spec])
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dsv41 inspect: error: argument --devices")
