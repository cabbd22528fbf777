"""Benchmark MixedOptimizer against torch.optim.AdamW and torch.optim.Muon + AdamW.

For two stand-ins with the released parameter names (a tiny one with the golden fixture's shapes and a
1024-wide one scaled from the released config, docs/design.md §2) it reports, from one run (round-robin timing,
best of the repetitions, as ``timeit`` does: on a shared machine the least-disturbed step is the measure):

- optimizer step time of MixedOptimizer (docs/design.md §6 policy) vs AdamW on every trainable parameter and vs
  torch.optim.Muon on the Muon matrices + AdamW on the rest (torch has no Sinkhorn, so the tables get AdamW);
- the Muon part alone: MixedOptimizer's batched Muon vs torch.optim.Muon on the same matrices with the same
  iteration (5 quintic steps, update RMS 0.2 = ``match_rms_adamw``), plus the V4 8+2 schedule for scale;
- optimizer-state bytes measured on the live optimizers;
- the state the released DeepSeek-V4.1-Flash would need under each optimizer, from parameter shapes on the
  meta device. The shapes are computed from the docs/design.md §2 numbers (``released_shapes``), not from the model
  class; the tiny instance of the same function is checked against the fixture's checkpoint.

With ``--procs 2`` (CPU, gloo) it instead measures MixedOptimizer on FSDP2-sharded parameters (``fully_shard``,
``Shard(0)``): step time and bytes each rank receives per step (measured on the collectives the step issues;
its own data excluded, an all-reduce counted as a ring's ``2(W-1)/W`` of the tensor), against the same model in
one process and against the naive baseline that all-gathers every sharded matrix on every rank and
orthogonalizes it there (``owner_compute`` swapped for DTensor's all-gather; Sinkhorn and AdamW unchanged).

Usage: ``python benchmarks/optimizer.py [--reps 5] [--device cpu|cuda] [--sizes tiny,1024] [--threads N]
[--procs 2]``
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import modeling_dsv41.optim.updates as optim_updates
from modeling_dsv41.optim.distributed import _via_replicate

from modeling_dsv41.optim import (
    TORCH_MUON_NS_COEFFICIENTS,
    V4_NS_COEFFICIENTS,
    MixedOptimizer,
    assign_kinds,
    assignment_table,
    build_param_groups,
    state_bytes,
)

FIXTURE_MODEL = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "v41_tiny_vl" / "model.safetensors"


@dataclass
class Dims:
    """The configuration numbers that fix parameter shapes (reference ``config.json`` names in comments)."""

    vocab: int
    dim: int
    layers: int
    heads: int  # n_heads
    head_dim: int
    q_lora: int
    o_groups: int
    o_lora: int
    experts: int  # n_routed_experts
    inter: int  # moe_inter_dim
    compress_ratios: list[int]
    kv_sources: list[int]
    index_sources: list[int]
    index_heads: int
    index_head_dim: int
    engram_layers: list[int]
    engram_rows: list[int]
    engram_heads: int
    engram_head_dim: int
    vision_layers: int
    hc: int = 4
    max_ngram: int = 4
    vision_dim: int = 1024
    vision_heads: int = 16
    vision_inter: int = 2816
    patch: int = 14
    downsample: int = 3


RELEASED = Dims(
    vocab=129280,
    dim=5120,
    layers=40,
    heads=64,
    head_dim=512,
    q_lora=1280,
    o_groups=8,
    o_lora=1024,
    experts=384,
    inter=2304,
    compress_ratios=[0, 0] + [2] * 18 + [1] * 20,
    kv_sources=[2, 8, 14, 20],
    index_sources=[2, 8, 14, 20, 24, 28, 32, 36],
    index_heads=32,
    index_head_dim=128,
    engram_layers=[1, 14],
    engram_rows=[384006168, 384016682],
    engram_heads=8,
    engram_head_dim=256,
    vision_layers=32,
)
TINY = Dims(
    vocab=512,
    dim=64,
    layers=6,
    heads=4,
    head_dim=64,
    q_lora=32,
    o_groups=2,
    o_lora=32,
    experts=4,
    inter=32,
    compress_ratios=[0, 2, 2, 1, 1, 1],
    kv_sources=[1, 3],
    index_sources=[1, 3, 5],
    index_heads=8,
    index_head_dim=64,
    engram_layers=[0, 1],
    engram_rows=[660, 864],
    engram_heads=2,
    engram_head_dim=32,
    vision_layers=2,
    vision_dim=64,
    vision_heads=4,
    vision_inter=128,
)
# Released widths divided by ~5 (the ViT and head_dim kept); few layers, experts and Engram heads so that
# three copies, their optimizer state and a Muon step stay within a small CPU box.
WIDE_1024 = replace(
    RELEASED,
    vocab=32768,
    dim=1024,
    layers=2,
    heads=16,
    q_lora=256,
    o_groups=4,
    o_lora=256,
    experts=4,
    inter=512,
    compress_ratios=[0, 2],
    kv_sources=[1],
    index_sources=[1],
    index_heads=8,
    engram_layers=[1],
    engram_rows=[65536],
    engram_heads=2,
    vision_layers=1,
)


def released_shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    """Parameter name → shape under the reference naming (fixtures README §9) for configuration ``d``."""
    s: dict[str, tuple[int, ...]] = {"embed.weight": (d.vocab, d.dim), "norm.weight": (d.dim,)}
    s["head.weight"] = (d.vocab, d.dim)
    mix = (2 + d.hc) * d.hc
    for i in range(d.layers):
        p = f"layers.{i}."
        if i in d.engram_layers:
            s[p + "engram.embed.weight"] = (d.engram_rows[d.engram_layers.index(i)], d.engram_head_dim)
            s[p + "engram.wkv.weight"] = ((d.hc + 1) * d.dim, (d.max_ngram - 1) * d.engram_heads * d.engram_head_dim)
            s[p + "engram.q_weight"] = s[p + "engram.k_weight"] = (d.hc, d.dim)
        for name in ("attn", "ffn"):
            s[p + f"hc_{name}_fn"] = (mix, d.hc * d.dim)
            s[p + f"hc_{name}_base"], s[p + f"hc_{name}_scale"] = (mix,), (3,)
        s[p + "attn_norm.weight"] = s[p + "ffn_norm.weight"] = (d.dim,)
        a = p + "attn."
        s[a + "attn_sink"] = (d.heads,)
        s[a + "wq_a.weight"], s[a + "q_norm.weight"] = (d.q_lora, d.dim), (d.q_lora,)
        s[a + "wq_b.weight"] = (d.heads * d.head_dim, d.q_lora)
        s[a + "wkv.weight"], s[a + "kv_norm.weight"] = (d.head_dim, d.dim), (d.head_dim,)
        s[a + "wo_a.weight"] = (d.o_groups * d.o_lora, d.heads * d.head_dim // d.o_groups)
        s[a + "wo_b.weight"] = (d.dim, d.o_groups * d.o_lora)
        if i in d.kv_sources:
            s[a + "compressor.wkv.weight"], s[a + "compressor.norm.weight"] = (d.head_dim, d.dim), (d.head_dim,)
            if d.compress_ratios[i] == 2:
                s[a + "compressor.wgate.weight"] = (d.head_dim, d.dim)
        if i in d.index_sources:
            s[a + "indexer.wq_b.weight"] = (d.index_heads * d.index_head_dim, d.q_lora)
            s[a + "indexer.weights_proj.weight"] = (d.index_heads, d.dim)
            if i in d.kv_sources:
                s[a + "indexer.wk.weight"] = (d.index_head_dim, d.head_dim)  # keys from the compressed latent
                s[a + "indexer.k_norm.weight"] = (d.index_head_dim,)
        f = p + "ffn."
        s[f + "gate.weight"], s[f + "gate.bias"], s[f + "gate.bias_vl"] = (
            (d.experts, d.dim),
            (d.experts,),
            (d.experts,),
        )
        for e in [*(f"experts.{e}" for e in range(d.experts)), "shared_experts"]:
            s[f + f"{e}.w1.weight"] = s[f + f"{e}.w3.weight"] = (d.inter, d.dim)
            s[f + f"{e}.w2.weight"] = (d.dim, d.inter)
    if d.vision_layers:
        v, vd = "vision.", d.vision_dim
        s[v + "patch_embed.proj.weight"], s[v + "patch_embed.proj.bias"] = (vd, 3 * d.patch**2), (vd,)
        for j in range(d.vision_layers):
            b = f"{v}blocks.{j}."
            s[b + "norm1.weight"] = s[b + "norm2.weight"] = (vd,)
            s[b + "attn.wqkv.weight"], s[b + "attn.wqkv.bias"] = (3 * vd, vd), (3 * vd,)
            s[b + "attn.wo.weight"], s[b + "attn.wo.bias"] = (vd, vd), (vd,)
            s[b + "mlp.w1.weight"], s[b + "mlp.w2.weight"] = (2 * d.vision_inter, vd), (vd, d.vision_inter)
        s[v + "norm.weight"] = (vd,)
        s["aligner.w1.weight"], s["aligner.w1.bias"] = (d.dim, d.downsample**2 * vd), (d.dim,)
        s["aligner.w2.weight"], s["aligner.w2.bias"] = (d.dim, d.dim), (d.dim,)
        s["image_start"] = s["image_end"] = s["image_newline"] = (d.dim,)
    return s


def model_shapes(released: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The released names and shapes in the model's layout: ``model.`` prefix, ``lm_head``, each layer's routed experts
    fused (``gate_up_proj`` [E, 2·I, D], ``down_proj`` [E, D, I]); the router biases are buffers, left out."""
    shapes: dict[str, tuple[int, ...]] = {}
    experts: dict[str, list[tuple[int, ...]]] = {}
    for name, shape in released.items():
        routed = re.fullmatch(r"(layers\.\d+\.ffn\.experts)\.\d+\.(w[12])\.weight", name)
        if routed:
            experts.setdefault(f"model.{routed[1]}.{routed[2]}", []).append(shape)
        elif not re.search(r"\.experts\.\d+\.w3\.weight$|\.gate\.bias", name):
            shapes["lm_head.weight" if name == "head.weight" else f"model.{name}"] = shape
    for key, per_expert in experts.items():
        path, w = key.rsplit(".", 1)
        rows, cols = per_expert[0]
        if w == "w1":
            shapes[f"{path}.gate_up_proj"] = (len(per_expert), 2 * rows, cols)
        else:
            shapes[f"{path}.down_proj"] = (len(per_expert), rows, cols)
    return shapes


def build_standin(d: Dims, device: str | torch.device = "cpu") -> nn.Module:
    """A parameter-only module with the model's names and shapes for ``d`` and a config the policy reads."""
    root = nn.Module()
    with torch.device(device):
        for name, shape in model_shapes(released_shapes(d)).items():
            module = root
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, nn.Module())
                module = getattr(module, part)
            param = torch.empty(shape)
            if param.device.type != "meta":
                nn.init.normal_(param, std=0.02)
            module.register_parameter(leaf, nn.Parameter(param))
    root.config = argparse.Namespace(
        num_attention_heads=d.heads,
        moe_intermediate_size=d.inter,
        vision_config=argparse.Namespace(hidden_size=d.vision_dim, num_attention_heads=d.vision_heads),
    )
    return root


def check_tiny_shapes() -> str:
    """The shape formulas reproduce the fixture checkpoint (minus the FP8 Engram row scales)."""
    if not FIXTURE_MODEL.exists():
        return "fixture not found: shape formulas not checked"
    from safetensors import safe_open

    with safe_open(FIXTURE_MODEL, framework="pt") as f:
        fixture = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if not k.endswith("embed.scale")}
    ours = released_shapes(TINY)
    if fixture != ours:
        diff = sorted(set(fixture.items()) ^ set(ours.items()))[:10]
        raise SystemExit(f"released_shapes(TINY) disagrees with the fixture checkpoint: {diff}")
    return f"shape formulas match the fixture checkpoint ({len(ours)} tensors)"


# ----------------------------------------------------------------------------- timing


class _Pair:
    """Two optimizers stepped as one (torch's Muon cannot take the non-matrix parameters)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    @property
    def state(self) -> dict:
        return {k: v for opt in self.optimizers for k, v in opt.state.items()}


def _contenders(d: Dims, device: str) -> tuple[dict[str, Callable[[], object]], dict[str, Callable[[], object]], int]:
    """Factories for the whole-model and the Muon-only comparisons; every contender gets its own copy of the
    same weights (the same trainable set: the policy's frozen parameters are left out everywhere) and shares
    the same gradient tensors (no optimizer here writes into gradients)."""
    torch.manual_seed(0)
    model = build_standin(d, device)
    n_params = sum(p.numel() for p in model.parameters())
    weights = {n: p.detach() for n, p in model.named_parameters()}
    grads = {n: torch.randn_like(w) for n, w in weights.items()}
    kinds = assign_kinds(model)
    trainable = [n for n, k in kinds.items() if k != "frozen"]
    muon_names = [n for n in trainable if kinds[n].startswith("muon")]
    other_names = [n for n in trainable if not kinds[n].startswith("muon")]

    def copies(names: list[str]) -> list[nn.Parameter]:
        params = [nn.Parameter(weights[n].clone()) for n in names]
        for n, p in zip(names, params):
            p.grad = grads[n]
        return params

    def mixed():
        clone = build_standin(d, device)
        clone.load_state_dict(weights)
        for n, p in clone.named_parameters():
            p.grad = grads[n]
        return MixedOptimizer(build_param_groups(clone, lr=1e-3))

    def muon_part(coefficients, update_rms):
        group = {"kind": "muon", "params": copies(muon_names), "ns_coefficients": coefficients}
        return MixedOptimizer([{**group, "update_rms": update_rms}], lr=1e-3)

    def matrices(names: list[str]) -> list[nn.Parameter]:
        """As ``copies``, with every stacked [E, rows, cols] tensor (the fused experts) cut into its E matrices:
        torch.optim.Muon takes 2-D parameters only, and orthogonalizes each matrix as ours does."""
        params = []
        for p in copies(names):
            for weight, grad in zip(p.detach().reshape(-1, *p.shape[-2:]), p.grad.reshape(-1, *p.shape[-2:])):
                params.append(nn.Parameter(weight.clone()))
                params[-1].grad = grad
        return params

    def torch_muon():
        return torch.optim.Muon(matrices(muon_names), lr=1e-3, adjust_lr_fn="match_rms_adamw")

    whole = {
        "MixedOptimizer": mixed,
        "torch AdamW (all)": lambda: torch.optim.AdamW(copies(trainable), lr=1e-3, weight_decay=0.1),
        "torch Muon + AdamW": lambda: _Pair(torch_muon(), torch.optim.AdamW(copies(other_names), lr=1e-3)),
    }
    # Head-wise weights are plain Muon here so that both sides orthogonalize exactly the same matrices.
    muon_only = {
        "ours, 5 quintic, RMS 0.2": lambda: muon_part(TORCH_MUON_NS_COEFFICIENTS, 0.2),
        "torch.optim.Muon (match_rms)": torch_muon,
        "ours, V4 8+2, RMS 0.18": lambda: muon_part(V4_NS_COEFFICIENTS, 0.18),
    }
    return whole, muon_only, n_params


def _state_bytes(opt) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


def _time(factories: dict[str, Callable[[], object]], reps: int, device: str) -> dict[str, tuple[float, int]]:
    """Best step seconds and state bytes per contender, timed round-robin so load hits all alike."""
    opts = {name: make() for name, make in factories.items()}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in opts}
    for opt in opts.values():  # warm-up: allocates state
        opt.step()
    sync()
    for _ in range(reps):
        for name, opt in opts.items():
            start = time.perf_counter()
            opt.step()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: (min(times[name]), _state_bytes(opt)) for name, opt in opts.items()}


def benchmark(d: Dims, label: str, reps: int, device: str) -> None:
    whole, muon_only, n_params = _contenders(d, device)
    print(f"\n## {label}: {n_params / 1e6:.1f} M parameters, device {device}, best of {reps} steps")
    results = _time(whole, reps, device)
    base_t, base_b = results["torch AdamW (all)"]
    print(f"{'whole model':<30}{'step ms':>10}{'× AdamW':>9}{'state MiB':>11}{'× AdamW':>9}")
    for name, (t, b) in results.items():
        print(f"{name:<30}{t * 1e3:>10.1f}{t / base_t:>9.2f}{b / 2**20:>11.1f}{b / base_b:>9.2f}")
    ratio = results["MixedOptimizer"][0] / results["torch Muon + AdamW"][0]
    print(f"MixedOptimizer / (torch Muon + AdamW): {ratio:.2f}")
    results = _time(muon_only, reps, device)
    base_t = results["torch.optim.Muon (match_rms)"][0]
    print(f"{'Muon matrices only':<30}{'step ms':>10}{'× torch':>9}")
    for name, (t, _) in results.items():
        print(f"{name:<30}{t * 1e3:>10.1f}{t / base_t:>9.2f}")


def released_state_table() -> None:
    """Optimizer state for the released DeepSeek-V4.1-Flash (fp32 parameters and state), from meta shapes."""
    start = time.perf_counter()
    model = build_standin(RELEASED, device="meta")
    table = assignment_table(model)
    print(f"\n## Released DeepSeek-V4.1-Flash (meta device, released shapes; {time.perf_counter() - start:.0f} s)")
    print(table)
    kinds = table.names
    params = dict(model.named_parameters())
    trainable = {n: p for n, p in params.items() if kinds[n] != "frozen"}

    def total(kind_of: Callable[[str], str]) -> int:
        return sum(state_bytes(kind_of(n), p.numel(), 4) for n, p in trainable.items())

    adamw = total(lambda n: "adamw")
    muon_adamw = total(lambda n: "muon" if kinds[n].startswith("muon") else "adamw")
    ours = total(lambda n: kinds[n])
    tib = 2**40
    print(f"trainable parameters: {sum(p.numel() for p in trainable.values()) / 1e9:.1f} B (fp32 state)")
    print(f"{'optimizer':<30}{'state TiB':>11}{'× AdamW':>9}")
    rows = {"torch AdamW (all)": adamw, "torch Muon + AdamW": muon_adamw, "MixedOptimizer": ours}
    for name, b in rows.items():
        print(f"{name:<30}{b / tib:>11.2f}{b / adamw:>9.2f}")


class ReceivedBytes(TorchDispatchMode):
    """Bytes this rank receives through the collectives run under it (its own share excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        world, rank = dist.get_world_size(), dist.get_rank()
        if name == "alltoall_base_":  # (output, input, group, output_split_sizes, input_split_sizes)
            output, splits = args[0], list(args[3])
            own = splits[rank] if splits else output.numel() // world
            self.total += (output.numel() - own) * output.element_size()
        elif name in ("allreduce_", "all_reduce"):
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.total += sum(2 * (world - 1) * t.numel() * t.element_size() // world for t in tensors)
        elif name in ("all_gather_into_tensor", "_allgather_base_"):
            source = args[0] if name == "all_gather_into_tensor" else args[1]
            self.total += (world - 1) * source.numel() * source.element_size()
        return func(*args, **kwargs)


def _naive_owner_compute(updates, like, fn, max_numel):
    """The baseline: every rank all-gathers every sharded matrix and orthogonalizes all of them."""
    return [_via_replicate(update, tensor, fn) for update, tensor in zip(updates, like)]


def _sharded_worker(rank: int, world: int, port: int, d: Dims, reps: int, single_ms: float, label: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = build_standin(d)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    contenders = {
        "owner ranks (ours)": (MixedOptimizer(build_param_groups(model, lr=1e-3)), optim_updates.owner_compute),
        "all-gather everywhere": (MixedOptimizer(build_param_groups(model, lr=1e-3)), _naive_owner_compute),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    received: dict[str, int] = {}
    for rep in range(reps + 1):  # the first round allocates state and counts bytes
        for name, (opt, exchange) in contenders.items():
            with mock.patch.object(optim_updates, "owner_compute", exchange):
                dist.barrier()
                start = time.perf_counter()
                if rep == 0:
                    with ReceivedBytes() as counter:
                        opt.step()
                    received[name] = counter.total
                else:
                    opt.step()
                dist.barrier()
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        print(f"\n## {label}: {world} processes (gloo, FSDP2 Shard(0)), best of {reps} steps")
        print(f"{'contender':<30}{'step ms':>10}{'× 1 proc':>10}{'recv MiB/rank':>15}")
        print(f"{'one process (unsharded)':<30}{single_ms:>10.1f}{1.0:>10.2f}{0.0:>15.2f}")
        for name in contenders:
            best = min(times[name][1:]) * 1e3
            print(f"{name:<30}{best:>10.1f}{best / single_ms:>10.2f}{received[name] / 2**20:>15.2f}")
        ours, naive = (min(times[name][1:]) for name in contenders)
        print(
            f"ours / all-gather everywhere: step time {ours / naive:.2f}, "
            f"bytes {received['owner ranks (ours)'] / max(1, received['all-gather everywhere']):.2f}"
        )
    dist.destroy_process_group()


def distributed_benchmark(d: Dims, label: str, reps: int, world: int) -> None:
    """One-process step time (here), then ``world`` gloo processes on the FSDP2-sharded model."""
    torch.manual_seed(0)
    model = build_standin(d)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    single = MixedOptimizer(build_param_groups(model, lr=1e-3))
    single.step()
    single_ms = min(_timed(single.step) for _ in range(reps)) * 1e3
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_sharded_worker, args=(world, port, d, reps, single_ms, label), nprocs=world)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", default="tiny,1024", help="comma-separated: tiny, 1024")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (1 is steadier on a shared box)")
    parser.add_argument("--procs", type=int, default=1, help="> 1: FSDP2-sharded mode on that many gloo processes")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(check_tiny_shapes())
    sizes = {"tiny": (TINY, "tiny stand-in (fixture shapes)"), "1024": (WIDE_1024, "1024-wide stand-in")}
    if args.procs > 1:
        for size in args.sizes.split(","):
            distributed_benchmark(*sizes[size], reps=args.reps, world=args.procs)
        return
    for size in args.sizes.split(","):
        benchmark(*sizes[size], reps=args.reps, device=args.device)
    released_state_table()


if __name__ == "__main__":
    main()
