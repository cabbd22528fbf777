"""MixedOptimizer (Muon, head-wise Muon, Sinkhorn-balanced, AdamW) and the docs/design.md §6 parameter policy."""

from __future__ import annotations

import copy
import io
import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
from reference_fixture import to_our_layout
from safetensors import safe_open
from torch import nn

import modeling_dsv41.optim.updates as updates
from modeling_dsv41.optim import (
    TORCH_MUON_NS_COEFFICIENTS,
    V4_NS_COEFFICIENTS,
    MixedOptimizer,
    assign_kinds,
    assignment_table,
    build_param_groups,
    freeze_default_parameters,
    sinkhorn_balance,
    zeropower_via_newton_schulz,
)

LR = 0.02
BF16_ULP = 2.0**-7  # spacing of bf16 numbers in [1, 2): Newton–Schulz runs in bf16


# ----------------------------------------------------------------------------- helpers


def _params(*shapes: tuple[int, ...], seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=g)) for shape in shapes]


def _clone(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return [nn.Parameter(p.detach().clone()) for p in params]


def _grads(shapes: list[torch.Size], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=g) for shape in shapes]


def _standin_from_fixture(fixtures_dir) -> nn.Module:
    """A parameter-only module with the tiny reference model's names (in our layout) and shapes (no forward).

    2-D ``*.weight`` leaves are ``nn.Linear`` so that PEFT can wrap them. The Engram ``embed.scale`` is the
    checkpoint's FP8 row scale, not a trainable parameter, and is left out.
    """
    model_dir = fixtures_dir / "v41_tiny_vl"
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        released = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if not k.endswith("embed.scale")}
    # our names (the router biases are buffers, not parameters)
    meta = {k: torch.empty(shape, device="meta") for k, shape in released.items() if not re.search(r"gate\.bias", k)}
    shapes = {k: tuple(t.shape) for k, t in to_our_layout(meta).items()}
    torch.manual_seed(0)
    root = nn.Module()

    def parent(path: str) -> nn.Module:
        module = root
        for part in path.split(".")[:-1]:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        return module

    linears = {k[: -len(".weight")] for k, s in shapes.items() if k.endswith(".weight") and len(s) == 2}
    for path in sorted(linears):
        out_features, in_features = shapes[f"{path}.weight"]
        linear = nn.Linear(in_features, out_features, bias=f"{path}.bias" in shapes)
        parent(path).add_module(path.rsplit(".", 1)[-1], linear)
    covered = {f"{path}.{leaf}" for path in linears for leaf in ("weight", "bias")}
    for name, shape in shapes.items():
        if name not in covered:
            parent(name).register_parameter(name.rsplit(".", 1)[-1], nn.Parameter(0.1 * torch.randn(shape)))
    reference = json.loads((model_dir / "sparse" / "config.json").read_text())
    root.config = SimpleNamespace(
        text_config=SimpleNamespace(
            num_attention_heads=reference["n_heads"], moe_intermediate_size=reference["moe_inter_dim"]
        ),
        vision_config=SimpleNamespace(
            hidden_size=reference["vision_dim"], num_attention_heads=reference["vision_n_heads"]
        ),
    )
    return root


@pytest.fixture
def tiny_model(fixtures_dir) -> nn.Module:
    return _standin_from_fixture(fixtures_dir)


def _spec_kind(name: str) -> str:
    """docs/design.md §6 written out independently of the policy's regexes, for our names."""
    last = name.rsplit(".", 1)[-1]
    if ".attn.indexer." in name:
        return "frozen"
    if name in ("model.embed.weight", "lm_head.weight") or name.endswith("engram.embed.weight"):
        return "sinkhorn"
    if name.endswith(("attn.wq_b.weight", "attn.wqkv.weight", "ffn.experts.gate_up_proj")):
        return "muon_headwise"
    if (
        last == "bias"
        or name.endswith(
            (
                "norm.weight",
                "norm1.weight",
                "norm2.weight",
                "attn_sink",
                "hc_attn_base",
                "hc_attn_scale",
                "hc_ffn_base",
                "hc_ffn_scale",
                "engram.q_weight",
                "engram.k_weight",
            )
        )
        or name in ("model.image_start", "model.image_end", "model.image_newline")
    ):
        return "adamw"
    if name.endswith(
        (
            "attn.wq_a.weight",
            "attn.wkv.weight",
            "attn.wo_a.weight",
            "attn.wo_b.weight",
            "compressor.wkv.weight",
            "compressor.wgate.weight",
            "ffn.gate.weight",
            "w1.weight",
            "w2.weight",
            "w3.weight",
            "ffn.experts.down_proj",
            "hc_attn_fn",
            "hc_ffn_fn",
            "engram.wkv.weight",
            "patch_embed.proj.weight",
            "attn.wo.weight",
        )
    ):
        return "muon"
    raise AssertionError(f"the test's table of docs/design.md §6 does not cover {name}")


def _fake_grads(model: nn.Module, step: int) -> None:
    """Deterministic gradients that depend on the weights; tables get gradient on a few rows only."""
    g = torch.Generator().manual_seed(step)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        grad = torch.randn(p.shape, generator=g) + 0.3 * p.detach()
        if name.endswith(("embed.weight", "lm_head.weight")):
            grad *= (torch.rand(p.shape[0], 1, generator=g) < 0.25).float()
        p.grad = grad


# ----------------------------------------------------------------------------- Muon


def test_plain_muon_matches_torch_muon():
    shapes = [(32, 64), (64, 32), (32, 64), (48, 48), (16, 80)]
    ours, theirs = _params(*shapes), None
    theirs = _clone(ours)
    opt = MixedOptimizer(
        [{"kind": "muon", "params": ours, "ns_coefficients": TORCH_MUON_NS_COEFFICIENTS, "update_rms": 0.2}],
        lr=LR,
    )
    ref = torch.optim.Muon(theirs, lr=LR, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    steps = 5
    for step in range(steps):
        for p, q, grad in zip(ours, theirs, _grads([p.shape for p in ours], step)):
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        # Each step adds lr·0.2·√max·O with |O| ≲ 1 computed in bf16: allow a bf16 rounding of it per step.
        # A wrong convention (transpose, scale, momentum form) moves weights by ~lr·0.2·√max·|O| per step.
        atol = steps * LR * 0.2 * math.sqrt(max(p.shape)) * BF16_ULP
        torch.testing.assert_close(p, q, rtol=0, atol=atol)


def test_ns_coefficients_one_per_step_and_v4_schedule_reaches_unit_singular_values():
    x = torch.randn(3, 40, 96, generator=torch.Generator().manual_seed(0))
    v4 = torch.linalg.svdvals(zeropower_via_newton_schulz(x, V4_NS_COEFFICIENTS).float())
    quintic = torch.linalg.svdvals(zeropower_via_newton_schulz(x, TORCH_MUON_NS_COEFFICIENTS).float())
    # The 2 polishing steps pull singular values onto 1 (bf16 noise aside); 5 quintic steps leave them spread.
    assert v4.min() > 0.9 and v4.max() < 1.05
    assert quintic.max() - quintic.min() > 0.3
    assert len(V4_NS_COEFFICIENTS) == 10 and V4_NS_COEFFICIENTS[-1] == (2.0, -1.5, 0.5)


def test_default_muon_update_has_rms_018():
    (p,) = _params((64, 160))
    before = p.detach().clone()
    opt = MixedOptimizer([{"kind": "muon", "params": [p], "weight_decay": 0.0}], lr=LR)
    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(3))
    opt.step()
    rms = ((p.detach() - before) / LR).pow(2).mean().sqrt()
    assert abs(rms.item() / 0.18 - 1) < 0.03  # singular values of the V4 schedule are within ~3% of 1


def _run(opt: MixedOptimizer, params: list[nn.Parameter], grads_per_step: list[list[torch.Tensor]]) -> None:
    for grads in grads_per_step:
        for p, grad in zip(params, grads):
            p.grad = grad.clone()
        opt.step()


def test_headwise_equals_per_head_loop():
    heads, head_rows, cols = 4, 24, 40
    (w,) = _params((heads * head_rows, cols))
    per_head = [nn.Parameter(block.clone()) for block in w.detach().split(head_rows)]
    grads = [_grads([w.shape], step) for step in range(3)]
    opt = MixedOptimizer([{"kind": "muon_headwise", "params": [w], "num_heads": heads}], lr=LR)
    loop = MixedOptimizer([{"kind": "muon", "params": per_head}], lr=LR)
    _run(opt, [w], grads)
    _run(loop, per_head, [list(g.split(head_rows)) for (g,) in grads])
    # Batched vs single bf16 matmuls may round differently; a whole-matrix Muon differs by ~lr per entry.
    atol = 3 * LR * 0.18 * math.sqrt(cols) * BF16_ULP
    torch.testing.assert_close(w.detach(), torch.cat([p.detach() for p in per_head]), rtol=0, atol=atol)
    whole = _params((heads * head_rows, cols))[0]
    _run(MixedOptimizer([{"kind": "muon", "params": [whole]}], lr=LR), [whole], grads)
    assert (whole.detach() - w.detach()).abs().max() > 10 * atol  # head-wise really is not whole-matrix Muon


def test_headwise_scaling_one_head_gradient_leaves_other_heads_unchanged():
    heads, head_rows, cols = 4, 16, 32
    (w,) = _params((heads * head_rows, cols))
    w2 = _clone([w])[0]
    grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(5))
    scaled = grad.clone()
    scaled[:head_rows] *= 100.0
    for param, g in ((w, grad), (w2, scaled)):
        before = param.detach().clone()
        param.grad = g
        MixedOptimizer([{"kind": "muon_headwise", "params": [param], "num_heads": heads}], lr=LR).step()
        param.delta = param.detach() - before
    # Each head's matrix goes through its own batch entry: untouched heads give bit-identical updates,
    # and the scaled head's update keeps its size (orthogonalization is scale-free).
    assert torch.equal(w.delta[head_rows:], w2.delta[head_rows:])
    torch.testing.assert_close(w.delta[:head_rows].norm(), w2.delta[:head_rows].norm(), rtol=0.02, atol=0)


def test_headwise_fused_qkv_split_sizes():
    heads, dim = 4, 32
    (w,) = _params((3 * dim, dim))
    q, k, v = w.detach().split(dim)
    loop_params = [nn.Parameter(b.clone()) for b in (*q.split(dim // heads), *k.split(dim // heads), v)]
    grads = [_grads([w.shape], step) for step in range(3)]
    group = {"kind": "muon_headwise", "params": [w], "num_heads": (heads, heads, 1), "split_sizes": (dim,) * 3}
    _run(MixedOptimizer([group], lr=LR), [w], grads)
    loop_grads = []
    for (g,) in grads:
        gq, gk, gv = g.split(dim)
        loop_grads.append([*gq.split(dim // heads), *gk.split(dim // heads), gv])
    _run(MixedOptimizer([{"kind": "muon", "params": loop_params}], lr=LR), loop_params, loop_grads)
    atol = 3 * LR * 0.18 * math.sqrt(dim) * BF16_ULP  # batched vs single bf16 matmuls, as above
    torch.testing.assert_close(w.detach(), torch.cat([p.detach() for p in loop_params]), rtol=0, atol=atol)


def test_3d_expert_tensor_equals_per_expert_loop(monkeypatch):
    experts, out_features, in_features = 5, 24, 40
    (stacked,) = _params((experts, out_features, in_features))
    loop_params = [nn.Parameter(e.clone()) for e in stacked.detach().unbind(0)]
    grads = [_grads([stacked.shape], step) for step in range(3)]
    _run(MixedOptimizer([{"kind": "muon", "params": [stacked]}], lr=LR), [stacked], grads)
    # The loop reference also exercises chunking: one matrix per batched call.
    monkeypatch.setattr(updates, "MAX_BATCH_NUMEL", out_features * in_features)
    loop = MixedOptimizer([{"kind": "muon", "params": loop_params}], lr=LR)
    _run(loop, loop_params, [list(g.unbind(0)) for (g,) in grads])
    atol = 3 * LR * 0.18 * math.sqrt(in_features) * BF16_ULP  # batched vs single bf16 matmuls
    torch.testing.assert_close(stacked.detach(), torch.stack([p.detach() for p in loop_params]), rtol=0, atol=atol)
    for p in loop_params:
        assert list(loop.state[p]) == ["momentum_buffer"]


def test_fused_gate_up_expert_stack_equals_separate_w1_w3():
    """A fused ``gate_up_proj [E, 2I, D]`` routed as head-wise with ``split_sizes=(I, I)``, one head each,
    gets the update of the separate per-expert ``w1``/``w3`` the released checkpoint has."""
    experts, inter, dim = 3, 16, 24
    (gate_up,) = _params((experts, 2 * inter, dim))
    separate = [nn.Parameter(m.clone()) for e in gate_up.detach().unbind(0) for m in e.split(inter)]
    grads = [_grads([gate_up.shape], step) for step in range(3)]
    group = {"kind": "muon_headwise", "params": [gate_up], "num_heads": (1, 1), "split_sizes": (inter, inter)}
    _run(MixedOptimizer([group], lr=LR), [gate_up], grads)
    loop = MixedOptimizer([{"kind": "muon", "params": separate}], lr=LR)
    _run(loop, separate, [[m for e in g.unbind(0) for m in e.split(inter)] for (g,) in grads])
    atol = 3 * LR * 0.18 * math.sqrt(dim) * BF16_ULP  # batched vs single bf16 matmuls
    expected = torch.stack([torch.cat([p.detach() for p in separate[2 * e : 2 * e + 2]]) for e in range(experts)])
    torch.testing.assert_close(gate_up.detach(), expected, rtol=0, atol=atol)


# ----------------------------------------------------------------------------- Sinkhorn


def _reference_sinkhorn(update: torch.Tensor, iters: int, tau: float) -> torch.Tensor:
    """Dense float64 transcription of docs/design.md §6: masked rows are zero in the result."""
    x = update.double()
    live = x.norm(dim=1) > tau * x.norm(dim=1).mean()
    x = x * live[:, None]
    for step in range(1, iters + 1):
        dim = 1 if step % 2 == 1 else 0  # odd steps rows, even steps columns
        x = x / x.norm(dim=dim, keepdim=True).clamp_min(1e-300)
    return x * math.sqrt(x.shape[1])


def test_sinkhorn_step_masks_rows_and_hits_target_rms():
    rows, cols = 64, 32
    (table,) = _params((rows, cols))
    before = table.detach().clone()
    grad = torch.randn(rows, cols, generator=torch.Generator().manual_seed(7))
    grad[:20] = 0.0  # rows no token touched
    grad[20:24] *= 1e-5  # ~0 rows: below τ·mean
    table.grad = grad
    opt = MixedOptimizer([{"kind": "sinkhorn", "params": [table]}], lr=LR)
    opt.step()
    delta = table.detach() - before
    assert torch.equal(delta[:24], torch.zeros(24, cols))  # exactly unchanged, not merely small
    row_rms = delta[24:].pow(2).mean(dim=1).sqrt()
    torch.testing.assert_close(row_rms, torch.full_like(row_rms, LR * 0.18), rtol=1e-5, atol=0)
    # the direction is design.md §6.3's algorithm (Nesterov on the first step is a scalar multiple of the gradient)
    expected = -LR * 0.18 * _reference_sinkhorn(grad, 11, 1e-3)
    torch.testing.assert_close(delta, expected.float(), rtol=1e-4, atol=1e-7)
    assert list(opt.state[table]) == ["momentum_buffer"]


def test_sinkhorn_columns_balanced_after_11_iterations():
    g = torch.Generator().manual_seed(0)
    update = torch.randn(64, 32, generator=g) * torch.rand(64, 1, generator=g) * torch.rand(1, 32, generator=g)

    def column_spread(iters: int) -> float:
        _, direction = sinkhorn_balance(update, iters)
        norms = direction.norm(dim=0)
        return (norms.std() / norms.mean()).item()

    assert column_spread(11) < 1e-4
    assert column_spread(1) > 1e-2 and column_spread(3) > column_spread(11)  # balancing is what did it
    _, direction = sinkhorn_balance(update, 11)
    torch.testing.assert_close(direction.pow(2).mean(dim=1), torch.ones(64), rtol=1e-5, atol=0)


def test_sinkhorn_is_scale_free_down_to_tiny_gradients():
    update = torch.randn(32, 16, generator=torch.Generator().manual_seed(2))
    update[:4] = 0.0
    live, direction = sinkhorn_balance(update)
    for scale in (1e-25, 1e20):  # squares of 1e-25 underflow float32
        live_scaled, scaled = sinkhorn_balance(update * scale)
        assert torch.equal(live_scaled, live)
        torch.testing.assert_close(scaled, direction, rtol=1e-5, atol=1e-6)


def test_sinkhorn_all_zero_gradient_is_a_no_op():
    (table,) = _params((16, 8))
    before = table.detach().clone()
    table.grad = torch.zeros_like(table)
    opt = MixedOptimizer([{"kind": "sinkhorn", "params": [table]}], lr=LR)
    opt.step()
    assert torch.equal(table.detach(), before)
    assert torch.isfinite(opt.state[table]["momentum_buffer"]).all()


# ----------------------------------------------------------------------------- AdamW


def test_adamw_groups_equal_torch_adamw():
    ours = _params((8,), (4, 6), (3, 2, 5))
    theirs = _clone(ours)
    hparams = {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-7, "weight_decay": 0.05}
    opt = MixedOptimizer([{"kind": "adamw", "params": ours, **hparams}])
    ref = torch.optim.AdamW(theirs, **hparams)
    for step in range(4):
        for p, q, grad in zip(ours, theirs, _grads([p.shape for p in ours], step)):
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        assert sorted(opt.state[p]) == sorted(ref.state[q]) == ["exp_avg", "exp_avg_sq", "step"]


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "group, message",
    [
        ({"params": _params((4, 4))}, "kind"),
        ({"kind": "lion", "params": _params((4, 4))}, "kind"),
        ({"kind": "muon", "params": _params((4, 4)), "betas": (0.9, 0.9)}, "unknown keys"),
        ({"kind": "muon", "params": _params((4,))}, "matrices"),
        ({"kind": "muon", "params": _params((4, 4)), "ns_coefficients": [(1.0, 2.0)]}, "ns_coefficients"),
        ({"kind": "muon_headwise", "params": _params((6, 4))}, "num_heads"),
        ({"kind": "muon_headwise", "params": _params((6, 4)), "num_heads": 4}, "heads"),
        ({"kind": "muon_headwise", "params": _params((6, 4)), "num_heads": 1, "split_sizes": (2, 2)}, "sum"),
        ({"kind": "sinkhorn", "params": _params((4, 4)), "weight_decay": 0.1}, "weight decay"),
        ({"kind": "sinkhorn", "params": _params((4, 4)), "sinkhorn_iters": 10}, "odd"),
        ({"kind": "sinkhorn", "params": _params((2, 4, 4))}, "2-D"),
        ({"kind": "adamw", "params": _params((4,)), "betas": (0.9, 1.0)}, "betas"),
    ],
)
def test_bad_groups_raise(group, message):
    with pytest.raises(ValueError, match=message):
        MixedOptimizer([group])


def test_deepspeed_zero3_placeholders_are_refused_at_construction():
    """deepspeed.zero.Init leaves every parameter an empty placeholder with its real shape in ``ds_shape``."""
    placeholder = nn.Parameter(torch.empty(0))
    placeholder.ds_id, placeholder.ds_shape = 0, torch.Size((4, 4))
    for kind in ("muon", "sinkhorn"):
        with pytest.raises(ValueError, match="fully_shard"):
            MixedOptimizer([{"kind": kind, "params": [placeholder]}])
    MixedOptimizer([{"kind": "adamw", "params": [placeholder]}])  # element-wise: any partition is fine


@pytest.mark.parametrize("kind", ["muon", "muon_headwise", "sinkhorn"])
def test_deepspeed_zero12_flat_partitions_are_refused_before_any_update(kind):
    """ZeRO-1/2 swap each group's params for one flat fp32 slice after construction: step raises, changes nothing."""
    matrices, others = _params((6, 4), (6, 4)), _params((5, 3), seed=1)
    extra = {"num_heads": 2} if kind == "muon_headwise" else {}
    opt = MixedOptimizer([{"kind": "muon", "params": others}, {"kind": kind, "params": matrices, **extra}])
    flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in matrices])[:24])  # rank 0's half
    opt.param_groups[1]["params"] = [flat]
    for p in (flat, *others):
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in (flat, *others)]
    with pytest.raises(ValueError, match="DeepSpeed ZeRO"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip((flat, *others), before))
    assert not opt.state


# ----------------------------------------------------------------------------- policy


def test_policy_assignment_is_spec_section_6(tiny_model):
    kinds = assign_kinds(tiny_model)
    expected = {name: _spec_kind(name) for name, _ in tiny_model.named_parameters()}
    assert kinds == expected
    table = assignment_table(tiny_model)
    params = dict(tiny_model.named_parameters())
    for kind, row in table.kinds.items():
        members = [params[n] for n, k in expected.items() if k == kind]
        assert row.tensors == len(members)
        assert row.parameters == sum(p.numel() for p in members)
        per_tensor = {"adamw": lambda p: 8 * p.numel() + 4, "frozen": lambda p: 0}.get(kind, lambda p: 4 * p.numel())
        assert row.state_bytes == sum(per_tensor(p) for p in members)
    assert "muon_headwise" in str(table) and "total" in str(table)


def test_policy_groups_head_layouts_and_frozen(tiny_model):
    groups = build_param_groups(tiny_model, lr=1e-3)
    by_name = {name: g for g in groups for name in g["param_names"]}
    assert by_name["model.layers.0.attn.wq_b.weight"]["num_heads"] == 4
    vit = by_name["model.vision.blocks.0.attn.wqkv.weight"]
    assert vit["num_heads"] == (4, 4, 1) and vit["split_sizes"] == (64, 64, 64)
    # each expert's w1 and w3 rows are orthogonalized apart, as when they were separate matrices
    experts = by_name["model.layers.0.ffn.experts.gate_up_proj"]
    assert experts["num_heads"] == (1, 1) and experts["split_sizes"] == (32, 32)
    assert not any(".indexer." in n for n in by_name)
    assert by_name["model.layers.0.attn.wq_a.weight"]["weight_decay"] == 0.1
    assert by_name["model.norm.weight"]["weight_decay"] == 0.0
    # freezing for real gives the same groups; the policy itself never touches requires_grad
    assert all(p.requires_grad for p in tiny_model.parameters())
    frozen = freeze_default_parameters(tiny_model)
    assert frozen and all(_spec_kind(n) == "frozen" for n in frozen)
    assert [g["param_names"] for g in build_param_groups(tiny_model, lr=1e-3)] == [g["param_names"] for g in groups]
    # a config that *is* the text config
    tiny_model.config = SimpleNamespace(
        num_attention_heads=4, moe_intermediate_size=32, vision_config=tiny_model.config.vision_config
    )
    assert build_param_groups(tiny_model, lr=1e-3)[0]["param_names"] == groups[0]["param_names"]


def test_policy_overrides_and_hparams(tiny_model):
    overrides = {
        r"engram\.embed": "adamw",
        r"^model\.aligner\.": "frozen",
        r"(^|\.)lm_head\.weight$": {"kind": "sinkhorn", "lr": 5.0},
    }
    groups = build_param_groups(tiny_model, lr=1e-3, overrides=overrides, adamw={"betas": (0.9, 0.99)})
    by_name = {name: g for g in groups for name in g["param_names"]}
    assert by_name["model.layers.0.engram.embed.weight"]["kind"] == "adamw"
    assert by_name["model.layers.0.engram.embed.weight"]["betas"] == (0.9, 0.99)
    assert not any(n.startswith("model.aligner.") for n in by_name)
    assert by_name["lm_head.weight"]["lr"] == 5.0 and by_name["model.embed.weight"]["lr"] == 1e-3
    with pytest.raises(ValueError, match="override kind"):
        build_param_groups(tiny_model, lr=1e-3, overrides={"x": "sgd"})
    with pytest.raises(ValueError, match="unknown keys"):
        build_param_groups(tiny_model, lr=1e-3, overrides={"x": {"kind": "adamw", "momentum": 0.9}})


def test_policy_rejects_unknown_matrices(tiny_model):
    layer = tiny_model.model.layers.get_submodule("0")
    layer.register_parameter("mystery", nn.Parameter(torch.zeros(3, 3)))
    with pytest.raises(ValueError, match="layers.0.mystery"):
        build_param_groups(tiny_model, lr=1e-3)


def test_policy_fused_experts_update_like_separate_expert_matrices(tiny_model):
    """gate_up_proj [E, 2·I, D] takes head-wise Muon with splits (I, I): each expert's w1 and w3 are orthogonalized
    apart, exactly as the separate per-expert matrices were; down_proj [E, D, I] takes Muon per expert."""
    experts = tiny_model.model.layers.get_submodule("0.ffn.experts")
    kinds = assign_kinds(tiny_model)
    assert kinds["model.layers.0.ffn.experts.down_proj"] == "muon"
    groups = build_param_groups(tiny_model, lr=LR)
    group = next(g for g in groups if "model.layers.0.ffn.experts.gate_up_proj" in g["param_names"])
    hparams = {k: v for k, v in group.items() if k not in ("params", "param_names")}
    fused = nn.Parameter(experts.gate_up_proj.detach().clone())
    inter = fused.shape[1] // 2
    separate = [nn.Parameter(m.clone()) for e in fused.detach() for m in e.split(inter)]  # w1, w3 of each expert
    grads = [_grads([fused.shape], step) for step in range(3)]
    _run(MixedOptimizer([{**hparams, "params": [fused]}], lr=LR), [fused], grads)
    plain = {**hparams, "kind": "muon", "params": separate}
    del plain["num_heads"], plain["split_sizes"]
    _run(MixedOptimizer([plain], lr=LR), separate, [[m for e in g for m in e.split(inter)] for (g,) in grads])
    atol = 3 * LR * 0.18 * math.sqrt(fused.shape[-1]) * BF16_ULP  # batched vs single bf16 matmuls, as above
    rebuilt = torch.stack([torch.cat([w1.detach(), w3.detach()]) for w1, w3 in zip(separate[::2], separate[1::2])])
    torch.testing.assert_close(fused.detach(), rebuilt, rtol=0, atol=atol)


def test_policy_on_peft_model(tiny_model):
    import peft

    model = peft.get_peft_model(tiny_model, peft.LoraConfig(r=2, target_modules=["wq_a", "wo_b"]))
    groups = build_param_groups(model, lr=1e-3)
    names = [n for g in groups for n in g["param_names"]]
    assert names and all(".lora_" in n for n in names)
    assert {g["kind"] for g in groups} == {"adamw"}
    kinds = assign_kinds(model)
    assert kinds["base_model.model.model.layers.0.attn.wq_a.base_layer.weight"] == "frozen"
    # unfrozen base weights keep their policy kind through PEFT's decorations
    model.base_model.model.model.embed.weight.requires_grad_(True)
    model.get_parameter("base_model.model.model.layers.0.attn.wq_a.base_layer.weight").requires_grad_(True)
    kinds = assign_kinds(model)
    assert kinds["base_model.model.model.embed.weight"] == "sinkhorn"
    assert kinds["base_model.model.model.layers.0.attn.wq_a.base_layer.weight"] == "muon"


# ----------------------------------------------------------------------------- ecosystem


def test_state_dict_roundtrip_resumes_bit_identically(tiny_model, tmp_path):
    opt = MixedOptimizer(build_param_groups(tiny_model, lr=1e-3))
    for step in range(3):
        _fake_grads(tiny_model, step)
        opt.step()
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    resumed_model = copy.deepcopy(tiny_model)
    for step in range(3, 6):
        _fake_grads(tiny_model, step)
        opt.step()

    saved = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    resumed = MixedOptimizer(build_param_groups(resumed_model, lr=1e-3))
    resumed.load_state_dict(saved)
    for step in range(3, 6):
        _fake_grads(resumed_model, step)
        resumed.step()
    for (name, p), q in zip(tiny_model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(p, q), name
    # every kind's state is there: one buffer for Muon/Sinkhorn, two moments (+ step) for AdamW
    for group in resumed.param_groups:
        keys = {"adamw": ["exp_avg", "exp_avg_sq", "step"]}.get(group["kind"], ["momentum_buffer"])
        assert all(sorted(resumed.state[p]) == keys for p in group["params"])


def test_load_state_dict_rejects_other_kinds():
    p = _params((4, 4))
    a = MixedOptimizer([{"kind": "muon", "params": p}])
    b = MixedOptimizer([{"kind": "adamw", "params": _clone(p)}])
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    with pytest.raises(ValueError, match="kinds"):
        b.load_state_dict(torch.load(buffer, weights_only=True))


def test_transformers_scheduler_clipping_and_accelerate(tiny_model):
    from accelerate import Accelerator
    from transformers import get_linear_schedule_with_warmup

    g = torch.Generator().manual_seed(1)
    targets = {n: torch.randn(p.shape, generator=g) for n, p in tiny_model.named_parameters()}
    groups = build_param_groups(tiny_model, lr=1e-2, sinkhorn={"lr": 3e-2})
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(tiny_model, MixedOptimizer(groups))
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=10)
    base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
    assert sorted(set(base_lrs)) == [1e-2, 3e-2]
    trainable = [(n, p) for n, p in model.named_parameters() if n in {m for g in groups for m in g["param_names"]}]

    def loss_fn() -> torch.Tensor:
        return sum(((p - targets[n]) ** 2).sum() for n, p in trainable)

    losses = []
    for step in range(6):
        loss = loss_fn()
        losses.append(loss.item())
        accelerator.backward(loss)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        assert norm > 1.0  # clipping is active
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        factor = min((step + 1) / 2, (10 - step - 1) / 8)
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([lr * factor for lr in base_lrs])
    assert losses[-1] < losses[0]
    assert "initial_lr" in optimizer.state_dict()["param_groups"][0]


def test_policy_and_a_training_step_on_the_real_tiny_model(fixtures_dir):
    """The policy on our model class, then one text+image training step in the reference dtypes."""
    from reference_fixture import reference_inputs, reference_model

    model = reference_model(fixtures_dir, "dense", emulate_quantization=False)
    kinds = assign_kinds(model)
    assert kinds == {name: _spec_kind(name) for name in kinds}
    assert set(kinds) == {n for n, _ in _standin_from_fixture(fixtures_dir).named_parameters()}
    opt = MixedOptimizer(build_param_groups(model, lr=1e-2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    inputs = reference_inputs(fixtures_dir)
    model(**inputs, labels=inputs["input_ids"]).loss.backward()
    opt.step()
    moved = 0
    for group in opt.param_groups:
        for name, p in zip(group["param_names"], group["params"]):
            if p.grad is not None and p.grad.abs().sum() > 0:
                assert not torch.equal(p.detach(), before[name]), name
                moved += 1
    assert moved > 0.9 * sum(len(g["params"]) for g in opt.param_groups)  # gradients reach nearly everything
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_mixed_optimizer_builds_the_policy_groups_from_the_model(tmp_path):
    """``MixedOptimizer(model, ...)`` is ``MixedOptimizer(build_param_groups(model, ...))``; a Trainer given
    ``optimizer_cls_and_kwargs=(MixedOptimizer, {"model": model, ...})`` gets those groups, and plain param groups
    (what a Trainer hands over otherwise) are refused with the way to build them."""
    from transformers import Trainer, TrainingArguments

    from modeling_dsv41 import DeepseekV41Config, DeepseekV41ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(DeepseekV41Config.from_preset("tiny"))
    expected = [
        (g["kind"], g["param_names"], g.get("weight_decay", 0.0))
        for g in build_param_groups(model, lr=2e-3, weight_decay=0.05)
    ]
    assert ("muon", 0.05) in {(kind, decay) for kind, _, decay in expected}
    direct = MixedOptimizer(model, lr=2e-3, weight_decay=0.05)
    assert [(g["kind"], g["param_names"], g["weight_decay"]) for g in direct.param_groups] == expected

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", learning_rate=2e-3)
    trainer = Trainer(
        model=model,
        args=args,
        optimizer_cls_and_kwargs=(MixedOptimizer, {"model": model, "lr": 2e-3, "weight_decay": 0.05}),
    )
    built = trainer.create_optimizer()
    assert isinstance(built, MixedOptimizer)
    assert [(g["kind"], g["param_names"], g["weight_decay"]) for g in built.param_groups] == expected

    plain = Trainer(model=model, args=args, optimizer_cls_and_kwargs=(MixedOptimizer, {"lr": 2e-3}))
    with pytest.raises(ValueError, match=r"optimizer_cls_and_kwargs=\(MixedOptimizer, \{'model': model"):
        plain.create_optimizer()
    with pytest.raises(ValueError, match="only with the model"):
        MixedOptimizer(build_param_groups(model, lr=1e-3), weight_decay=0.1)
