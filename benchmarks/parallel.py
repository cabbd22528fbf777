"""Memory per rank of the released storage loaded natively under tensor or expert parallelism, against one
process's native load of the same folder (the baseline, same run).

Each rank loads only its shard of the FP8 Linears / FP4 experts the plans split (``tp_plan="auto"``, or
``DistributedConfig(tp_size=N, ep_size=N)``); the rest, and the Engram tables (memory-mapped,
``engram_tables="mmap"``), are whole on every rank. Reported per rank: the bytes of its parameters (local shards)
without the Engram tables, as a ratio to one process's and to the ideal ``1 / N``; the resident set after loading
(host memory, ``VmRSS``; ``torch.cuda.memory_allocated`` on CUDA); and, against one process, max |Δ logit| of a
2 x 64-token prompt and whether the greedy tokens agree.

Without a launcher it builds the stand-in of ``benchmarks/loading.py`` (experts most of the weights, as in the
release) and runs N gloo CPU processes itself; under ``torchrun`` it loads ``--model`` on the GPUs (NCCL)::

    python benchmarks/parallel.py [--plan tp|ep] [--nproc 2] [--workdir DIR]
    torchrun --nproc_per_node=8 benchmarks/parallel.py --model deepseek-ai/DeepSeek-V4.1-Flash --plan ep --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPT = (2, 64)
TABLES = re.compile(r"\.engram\.embed\.")


def _parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", choices=("tp", "ep"), default="tp", help="tp_plan='auto', or ep_size = tp_size = N")
    parser.add_argument("--nproc", type=int, default=2, help="processes to spawn without a launcher (default: 2)")
    parser.add_argument("--model", default=None, help="a released folder or repo (default: build the stand-in)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--workdir", type=Path, default=None, help="where to write the stand-in (default: a temp dir)")
    return parser.parse_args(argv)


def _build_stand_in(folder: Path) -> None:
    import torch

    from benchmarks.loading import STAND_IN
    from configuration import DeepseekV41Config
    from modeling_dsv41 import DeepseekV41ForCausalLM
    from modeling_dsv41.released.writing import save_released_checkpoint
    from tests.reference_fixture import stub_tokenizer

    torch.manual_seed(0)
    config = DeepseekV41Config(text_config={**STAND_IN, "vocab_size": 512, "engram_compressed_vocab_size": 256})
    model = DeepseekV41ForCausalLM(config).to(torch.bfloat16)
    save_released_checkpoint(model, folder, max_shard_bytes=100 << 20)
    stub_tokenizer().save(str(folder / "tokenizer.json"))


def _rss_bytes() -> int:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _load(model: str, plan: str | None, world: int, device: str):
    import torch
    from transformers.distributed import DistributedConfig

    from modeling_dsv41 import DeepseekV41ForCausalLM

    kwargs = {"dtype": torch.float32 if device == "cpu" else torch.bfloat16, "engram_tables": "mmap"}
    if plan == "tp":
        kwargs["distributed_config"] = DistributedConfig(tp_size=world)
    elif plan == "ep":
        kwargs["distributed_config"] = DistributedConfig(tp_size=world, ep_size=world)
    elif device == "cuda":
        kwargs["device_map"] = "cuda"
    return DeepseekV41ForCausalLM.from_pretrained(model, **kwargs).eval()


def _measure(model) -> dict:
    import torch
    from transformers.distributed.utils import is_dtensor

    weights = 0
    for name, param in model.named_parameters():
        local = param.to_local() if is_dtensor(param) else param
        weights += 0 if TABLES.search(name) else local.numel() * local.element_size()
    cuda = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
    ids = torch.randint(3, model.config.text_config.vocab_size - 2, PROMPT, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids.to(model.device)).logits.float().cpu()
    return {"weights": weights, "rss": _rss_bytes(), "cuda": cuda, "logits": logits}


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch

    if "RANK" not in os.environ:  # spawned here: gloo on the CPU
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
        )
        torch.set_num_threads(1)
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    result = _measure(_load(args.model, args.plan, world, args.device))
    torch.save(result, Path(out) / f"rank{rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _one_process(_: int, args: argparse.Namespace, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    torch.save(_measure(_load(args.model, None, 1, args.device)), Path(out) / "one_process.pt")


def _report(out: Path, world: int, args: argparse.Namespace) -> None:
    import torch

    baseline = torch.load(out / "one_process.pt")
    print(
        f"{args.plan.upper()} on {world} ranks vs one process (native released storage, {args.device}); "
        f"one process: weights {baseline['weights'] / 2**20:.1f} MiB (Engram tables apart), "
        f"RSS {baseline['rss'] / 2**20:.0f} MiB"
    )
    print(f"{'rank':<6}{'weights MiB':>12}{'x one':>8}{'x 1/N':>8}{'RSS MiB':>9}{'max|Δlogit|':>13}{'argmax':>8}")
    for rank in range(world):
        r = torch.load(out / f"rank{rank}.pt")
        ratio = r["weights"] / baseline["weights"]
        diff = (r["logits"] - baseline["logits"]).abs().max().item()
        same = bool((r["logits"].argmax(-1) == baseline["logits"].argmax(-1)).all())
        memory = (r["cuda"] if r["cuda"] is not None else r["rss"]) / 2**20
        print(
            f"{rank:<6}{r['weights'] / 2**20:>12.1f}{ratio:>8.3f}{ratio * world:>8.3f}{memory:>9.0f}"
            f"{diff:>13.2e}{str(same):>8}"
        )


def main(argv=None) -> None:
    args = _parse(argv)
    import torch
    import torch.multiprocessing as mp

    if "RANK" in os.environ:  # torchrun: this process is one rank; no baseline here (one GPU holds no copy)
        world = int(os.environ["WORLD_SIZE"])
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        result = _measure(_load(args.model, args.plan, world, args.device))
        print(
            json.dumps(
                {
                    "rank": int(os.environ["RANK"]),
                    "weights_GiB": result["weights"] / 2**30,
                    "cuda_allocated_GiB": (result["cuda"] or 0) / 2**30,
                    "rss_GiB": result["rss"] / 2**30,
                }
            )
        )
        return
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        out = Path(tmp)
        if args.model is None:
            args.model = str(out / "stand-in")
            _build_stand_in(Path(args.model))
        # the baseline in a fresh process too: this one's resident set holds the stand-in it built
        mp.start_processes(_one_process, args=(args, str(out)), nprocs=1, start_method="spawn")
        from tests.gloo_processes import free_port

        mp.start_processes(
            _rank, args=(args.nproc, free_port(), args, str(out)), nprocs=args.nproc, start_method="spawn"
        )
        _report(out, args.nproc, args)


if __name__ == "__main__":
    main()
