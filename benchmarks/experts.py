"""Routed experts: transformers' ``batched_mm`` and ``grouped_mm`` against ``eager`` (the reference's loop, the
default).

One MoE layer's fused experts (``DeepseekV41Experts``) at a configurable width, forward + backward over N tokens
with random top-k routing, in one run; prints each implementation's median time and its ratio to ``eager``, and the
largest difference of its output from eager's (they differ by rounding only: see the class docstring).

Usage: ``python benchmarks/experts.py [--tokens 2048] [--experts 16] [--top-k 4] [--hidden 512] [--inter 256]
[--dtype bfloat16] [--reps 5] [--threads 2] [--device cpu]``
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from configuration import DeepseekV41Config
from modeling_dsv41.moe import DeepseekV41Experts

IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def build(args: argparse.Namespace, implementation: str) -> DeepseekV41Experts:
    text = copy.deepcopy(DeepseekV41Config.from_preset("tiny").text_config)
    text.n_routed_experts, text.num_experts_per_tok = args.experts, args.top_k
    text.hidden_size, text.moe_intermediate_size = args.hidden, args.inter
    text._experts_implementation = implementation
    torch.manual_seed(0)
    experts = DeepseekV41Experts(text)
    torch.nn.init.normal_(experts.gate_up_proj, std=args.hidden**-0.5)
    torch.nn.init.normal_(experts.down_proj, std=args.inter**-0.5)
    return experts.to(args.device, getattr(torch, args.dtype))


def run(experts: DeepseekV41Experts, inputs: tuple[torch.Tensor, ...], device: str) -> torch.Tensor:
    experts.zero_grad(set_to_none=True)
    out = experts(*inputs)
    out.float().square().mean().backward()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out.detach().float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--inter", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(args.device, getattr(torch, args.dtype))
    top_k = torch.rand(args.tokens, args.experts, generator=g).topk(args.top_k).indices.to(args.device)
    weights = torch.rand(args.tokens, args.top_k, generator=g).to(args.device)

    results, outputs = {}, {}
    for implementation in IMPLEMENTATIONS:
        experts = build(args, implementation)
        outputs[implementation] = run(experts, (x, top_k, weights), args.device)  # warm-up
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            run(experts, (x, top_k, weights), args.device)
            times.append(time.perf_counter() - start)
        results[implementation] = statistics.median(times)

    print(
        f"{args.tokens} tokens, {args.experts} experts top-{args.top_k}, hidden {args.hidden}, "
        f"intermediate {args.inter}, {args.dtype}, {args.device}, {args.threads} threads; forward + backward"
    )
    print(f"{'implementation':<14}{'ms':>10}{'vs eager':>10}{'max |out - eager|':>20}")
    base = results["eager"]
    for implementation, seconds in results.items():
        diff = (outputs[implementation] - outputs["eager"]).abs().max().item()
        print(f"{implementation:<14}{seconds * 1e3:>10.1f}{seconds / base:>10.2f}{diff:>20.3g}")


if __name__ == "__main__":
    main()
