"""The full fine-tuning planner (``dsv41 inspect --train full --devices NODESxGPUSxSIZE``,
training/full_planning.py): its sums against the parameters, how its terms scale with the mesh, the smallest node
count it reports, and the figures docs/released-model.md quotes."""

from __future__ import annotations

import re

import pytest
from documentation import DOCS, REPO_ROOT

from configuration import DeepseekV41Config
from modeling_dsv41.cli import main
from modeling_dsv41.cli.inspection import _bytes, build_meta_model
from modeling_dsv41.optim import assign_kinds
from modeling_dsv41.placement import is_engram_table_tensor
from modeling_dsv41.training.full_planning import PRECISIONS, ep_sizes, plan_full_training, smallest_fit

GIB = 2**30


@pytest.fixture(scope="module")
def release():
    return build_meta_model(DeepseekV41Config.from_preset("deepseek-v4.1-flash"))


def test_the_sharded_terms_are_the_parameters_over_the_world(release):
    """fp32 masters: 4 bytes of weight, 4 of gradient and one (Muon, Sinkhorn) or two (AdamW) 4-byte state buffers
    per trained parameter, counted here from the names; frozen weights (indexer, draft head) as loaded; the Engram
    tables in host memory; the mHC and sinks replicated."""
    kinds = assign_kinds(release)
    plan = plan_full_training(release, 16, 8, 80 * GIB, 64, "fp32 master")
    trained = {
        n: p
        for n, p in release.named_parameters()
        if kinds[n] != "frozen" and not n.startswith("mtp.") and not is_engram_table_tensor(n)
    }
    replicated = {
        n for n, _ in release.named_parameters() if re.search(r"\.hc_(attn|ffn)_(fn|base|scale)$|\.attn_sink$", n)
    }
    sharded = {n: p for n, p in trained.items() if n not in replicated}
    frozen = sum(
        p.numel() * p.element_size()
        for n, p in release.named_parameters()
        if n not in trained and n not in replicated and not is_engram_table_tensor(n)
    )
    assert plan.trainable_parameters == sum(p.numel() for p in trained.values())
    assert 550e9 < plan.trainable_parameters < 555e9
    assert plan.terms["weights (1/world)"] == pytest.approx(
        (4 * sum(p.numel() for p in sharded.values()) + frozen) / 128
    )
    assert plan.terms["gradients (1/world)"] == pytest.approx(4 * sum(p.numel() for p in sharded.values()) / 128)
    state = sum(4 * p.numel() * (2 if kinds[n] == "adamw" else 1) for n, p in sharded.items())
    assert plan.terms["optimizer state (1/world)"] == pytest.approx(state / 128)
    assert plan.per_device == pytest.approx(sum(plan.terms.values()))
    tables = sum(p.numel() * 2 for n, p in release.named_parameters() if is_engram_table_tensor(n))
    assert plan.host_bytes == {"Engram tables (bf16, memory-mapped, per node)": tables}


def test_terms_scale_with_the_mesh(release):
    base = plan_full_training(release, 16, 8, 80 * GIB, 64, "bf16")
    twice = plan_full_training(release, 32, 8, 80 * GIB, 64, "bf16")
    for term in ("weights (1/world)", "gradients (1/world)", "optimizer state (1/world)"):
        assert twice.terms[term] == pytest.approx(base.terms[term] / 2)
    eight = plan_full_training(release, 16, 8, 80 * GIB, 8, "bf16")
    experts = "gathered experts ({} per layer, one + prefetch)"
    assert eight.terms[experts.format(48)] == pytest.approx(8 * base.terms[experts.format(6)])
    # one layer's local experts: 48 of 384, 3 matrices of 2304 × 4096, bf16, and the next layer's
    config = release.config.get_text_config()
    assert eight.terms[experts.format(48)] == 2 * 48 * 3 * config.moe_intermediate_size * config.hidden_size * 2
    assert (
        base.terms["weights (1/world)"]
        < plan_full_training(release, 16, 8, 80 * GIB, 64, "fp32 master").terms["weights (1/world)"]
    )
    with pytest.raises(ValueError, match="must divide the 128 devices and the 384 experts"):
        plan_full_training(release, 16, 8, 80 * GIB, 5)


@pytest.mark.parametrize("capacity", [80, 141])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_smallest_node_count_is_the_smallest(release, capacity, precision):
    best = smallest_fit(release, 8, capacity * GIB, precision)
    assert best.fits and best.nodes > 1
    fewer = best.nodes - 1
    assert not any(
        plan_full_training(release, fewer, 8, capacity * GIB, ep, precision).fits
        for ep in ep_sizes(release, fewer * 8)
    )
    assert not any(
        plan_full_training(release, best.nodes, 8, capacity * GIB, ep, precision).fits
        for ep in ep_sizes(release, best.nodes * 8)
        if ep < best.ep_size
    )


def test_the_command_prints_the_plan_and_refuses_uneven_devices(capsys):
    assert main(["inspect", "--train", "full", "--devices", "2x8x141GiB", "--seq", "1024"]) == 0
    out = capsys.readouterr().out
    assert "on 2 × 8 = 16 devices: the routed experts split over EP 8 (48 per layer on each)" in out
    assert "smallest node count that fits" in out and "8 × 141.0 GiB nodes" in out
    assert main(["inspect", "--train", "full", "--devices", "4x80GB,4x141GiB"]) == 2
    assert "nodes of equal devices" in capsys.readouterr().err
    assert main(["inspect", "--train", "full", "--devices", "2x8x80GiB", "--ep", "5"]) == 2
    assert "must divide the 16 devices and the 384 experts" in capsys.readouterr().err


def test_docs_figures_are_the_planners(release):
    """docs/released-model.md's tables, cell by cell, and the totals it and README quote, from the planner (16 × 8 ×
    80 GiB, EP 64 and 8, 4096 tokens)."""
    text = (DOCS / "released-model.md").read_text()
    table = text[text.index("| 16 × 8 devices, EP 64") :].split("\n\n")[0]
    plans = [plan_full_training(release, 16, 8, 80 * GIB, 64, precision) for precision in PRECISIONS]
    documented = {
        name.split(" (")[0]: (first.strip(), second.strip())
        for name, first, second in re.findall(r"^\| ([^|*]+?) \| ([^|]+) \| ([^|]+) \|$", table, re.M)
    }
    for term in plans[0].terms:
        key = term.split(" (")[0]
        expected = tuple(_bytes(p.terms[term]) if term in p.terms else "-" for p in plans)
        assert documented[key] == expected, term
    totals = re.search(r"\*\*per device\*\* \| \*\*([\d.]+ GiB)\*\*[^|]*\| \*\*([\d.]+ GiB)\*\*", table).groups()
    assert totals == tuple(_bytes(p.per_device) for p in plans)
    readme = " ".join((REPO_ROOT / "README.md").read_text().split())
    assert (
        f"128 H100 with EP 64, plans {_bytes(plans[1].per_device)} per GPU in bf16 and {_bytes(plans[0].per_device)} "
        "with fp32 masters, where NeMo reports 58.4 GiB"
    ) in readme
    one_node_ep = " / ".join(
        _bytes(plan_full_training(release, 16, 8, 80 * GIB, 8, precision).per_device) for precision in PRECISIONS
    )
    assert (
        f"With one node's EP (8: 48 experts per device, the all-to-all on NVLink) the same devices need {one_node_ep}"
        in " ".join(text.split())
    )
    for capacity in (80, 141):
        cells = [
            f"{b.nodes} nodes (EP {b.ep_size}, {_bytes(b.per_device)})"
            for b in (smallest_fit(release, 8, capacity * GIB, precision) for precision in PRECISIONS)
        ]
        assert f"| 8 × {capacity} GiB | {cells[0]} | {cells[1]} |" in text
