"""Run a test function on gloo processes (2 unless told) spawned from pytest, bounded in time (CPU, no accelerator
needed)."""

from __future__ import annotations

import gc
import os
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
TIMEOUT_S = 120


def _worker(rank: int, fn: Callable[..., None], port: int, tmp: str, args: tuple, world_size: int = WORLD) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, Path(tmp), *args)
        dist.barrier()  # no rank tears gloo down while the other still communicates
    except BaseException:
        (Path(tmp) / f"failure_{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        gc.collect()  # FSDP2 modules, meshes and DTensors hold the group in reference cycles: free them now
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn: Callable[..., None], tmp: Path, *args, timeout_s: float = TIMEOUT_S, world_size: int = WORLD) -> None:
    """Run ``fn(rank, tmp, *args)`` (a module-level function, picklable args) on ``world_size`` gloo processes; fail,
    not hang, after ``timeout_s``."""
    context = mp.start_processes(
        _worker,
        args=(fn, free_port(), str(tmp), args, world_size),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{fn.__name__} did not finish within {timeout_s} s")
    except (mp.ProcessRaisedException, mp.ProcessExitedException):
        failures = sorted(tmp.glob("failure_*.txt"))
        pytest.fail("\n".join(f.read_text() for f in failures) or "a worker failed")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
