"""The ``dsv41`` command.

- ``dsv41 demo``: build, measure, fine-tune, publish, reload and caption a tiny DeepSeek-V4.1 (see :mod:`.demo`).
- ``dsv41 inspect [PRESET|PATH] [--devices 8x141GiB]``: parameters, optimizer state and image token budgets, on the
  meta device; with ``--devices``, where ``device_map="auto"`` puts the weights (see :mod:`modeling_dsv41.placement`);
  with ``--train lora`` what LoRA fine-tuning on those devices takes (see :mod:`modeling_dsv41.training.planning`).
- ``dsv41 convert SRC DST``: a released-format checkpoint → our format, dequantized (see
  :mod:`modeling_dsv41.released.convert`).
- ``dsv41 export --format vllm-lora ADAPTER DST [--base PRESET|PATH]``: a PEFT LoRA adapter → the layout vLLM's
  DeepSeek-V4 LoRA serves (see :mod:`modeling_dsv41.serving.adapter_export`).
- ``dsv41 export --format released SRC DST``: a full fine-tune (a folder our ``save_pretrained`` / Trainer wrote) →
  DeepSeek's released checkpoint format, FP8/FP4 (see :mod:`modeling_dsv41.serving.released_export`).

Errors are one line on stderr (``dsv41 <command>: error: …``) with exit status 2; Ctrl-C exits with 130.

This module imports only the standard library at the top: torch, transformers and the model load inside the
command that needs them, so ``dsv41 --help`` and usage errors answer in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

PRESETS = ("deepseek-v4.1-flash", "tiny")


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int_at_least(minimum: int):
    """An argparse ``type`` accepting integers ≥ ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer ≥ {minimum}, got {text!r}")
        return value

    return parse


_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


class Devices(dict):
    """``{device index: bytes}``; ``per_node`` is the devices per node when given as ``NODESxGPUSxSIZE``."""

    per_node: int | None = None


def parse_devices(text: str) -> dict[int, int]:
    """``"8x141GiB"`` (or ``"4x80GB,4x141GiB"``) → ``{0: bytes, 1: bytes, ...}`` (an argparse ``type``);
    ``"16x8x80GiB"`` → 128 devices, 8 per node."""
    nodes = re.fullmatch(r"(\d+)[x×*](\d+)[x×*](.+)", text.replace(" ", "").lower())
    if nodes is not None and int(nodes.group(1)) >= 1 and int(nodes.group(2)) >= 1:
        node = parse_devices(f"{nodes.group(2)}x{nodes.group(3)}")
        devices = Devices(dict.fromkeys(range(int(nodes.group(1)) * len(node)), node[0]))
        devices.per_node = len(node)
        return devices
    devices: dict[int, int] = Devices()
    for part in text.replace(" ", "").split(","):
        match = re.fullmatch(r"(?:(\d+)[x×*])?(\d+(?:\.\d+)?)([kmgt]i?b|b)", part.lower())
        if match is None or int(match.group(1) or 1) < 1 or float(match.group(2)) <= 0:
            raise argparse.ArgumentTypeError(
                f"expected COUNTxSIZE such as 8x141GiB (comma-separated) or NODESxGPUSxSIZE such as 16x8x80GiB, got "
                f"{text!r}"
            )
        for _ in range(int(match.group(1) or 1)):
            devices[len(devices)] = int(float(match.group(2)) * _UNITS[match.group(3)])
    return devices


def _add_demo_command(commands: argparse._SubParsersAction) -> None:
    """``dsv41 demo`` (:func:`_run_demo`)."""
    demo = commands.add_parser(
        "demo",
        help="fine-tune, publish and reload a tiny DeepSeek-V4.1 on generated captions (CPU, minutes)",
        description="Build a tiny DeepSeek-V4.1 with vision and Engram, measure caption exact match, fine-tune it "
        "with DeepseekV41Trainer, measure again, export a Hub-ready folder, reload it in a fresh process and caption "
        "images. Ctrl-C saves a checkpoint; rerun with the same --output to resume.",
    )
    demo.add_argument(
        "--output", type=Path, default=Path("dsv41-demo"), metavar="DIR", help="output folder (default: %(default)s)"
    )
    demo.add_argument(
        "--steps",
        type=_int_at_least(1),
        default=None,
        metavar="N",
        help="training steps, for each stage with --lora (default: 120)",
    )
    demo.add_argument(
        "--lora",
        action="store_true",
        help="then teach the fine-tuned model a new caption wording through a LoRA adapter (PEFT)",
    )
    demo.add_argument(
        "--seed", type=_int_at_least(0), default=0, metavar="S", help="seed for data, model and training"
    )
    demo.set_defaults(handler=_run_demo)


def _add_inspect_command(commands: argparse._SubParsersAction) -> None:
    """``dsv41 inspect`` (:func:`_run_inspect`)."""
    inspect = commands.add_parser(
        "inspect",
        help="parameter counts, optimizer state and image token budgets (meta device, any size)",
        description="Count parameters per component and per optimizer kind, optimizer-state bytes (ours vs AdamW) "
        "and image token budgets, without allocating the weights.",
    )
    inspect.add_argument(
        "target",
        nargs="?",
        default="deepseek-v4.1-flash",
        metavar="PRESET|PATH",
        help=f"a preset ({', '.join(PRESETS)}) or a folder / config.json (default: %(default)s)",
    )
    inspect.add_argument(
        "--devices",
        type=parse_devices,
        default=None,
        metavar="NxSIZE",
        help='also plan device_map="auto" on these accelerators (e.g. 8x141GiB): weights per '
        "device, host memory for the Engram tables, decode cache bytes per token",
    )
    inspect.add_argument(
        "--storage",
        choices=("released", "loaded", "nf4", "int8"),
        default="released",
        help="weight sizes for --devices: the released storage (FP8 Linears, FP4 experts, FP8 Engram "
        "tables, as native loading keeps them) or the dtypes of a model loaded in bfloat16 "
        "(default: %(default)s); nf4 / int8: the weights and bytes per parameter of the model "
        "loaded with bitsandbytes (NF4 with and without double quantization, int8), next to bf16 "
        "and the native FP8 / FP4 load",
    )
    inspect.add_argument(
        "--tp",
        type=_int_at_least(2),
        default=None,
        metavar="N",
        help='per-rank weights under tensor parallelism on N ranks (tp_plan="auto"; with --devices, N of them)',
    )
    inspect.add_argument(
        "--ep",
        type=_int_at_least(2),
        default=None,
        metavar="N",
        help="per-rank weights under expert parallelism on N ranks: DistributedConfig(tp_size=N, "
        "ep_size=N), the experts split by the EP plan and the rest by the TP plan; with --train: "
        "the routed experts split over N devices (training.fsdp.shard_model's expert_parallel_size)",
    )
    inspect.add_argument(
        "--train",
        choices=("lora", "full"),
        default=None,
        help="with --devices: plan LoRA fine-tuning of the natively loaded weights, sharded with "
        "FSDP2 over the devices (frozen shards, gathered units, adapters and AdamW, activations "
        "with gradient checkpointing, logits), resident and offloaded to host memory, and the "
        "longest sequence per device that fits (--ep N: the launch's --expert_parallel_size N); or full "
        "fine-tuning with the mixed optimizer on the expert-parallel mesh (--devices "
        "NODESxGPUSxSIZE, --ep N: experts split over N devices, default one node's)",
    )
    inspect.add_argument(
        "--seq",
        type=_int_at_least(1),
        default=4096,
        metavar="S",
        help="with --train: tokens per sequence (default: %(default)s)",
    )
    inspect.add_argument(
        "--batch",
        type=_int_at_least(1),
        default=1,
        metavar="B",
        help="with --train: sequences per device and step (default: %(default)s)",
    )
    inspect.add_argument(
        "--rank", type=_int_at_least(1), default=16, metavar="R", help="with --train: LoRA rank (default: %(default)s)"
    )
    inspect.set_defaults(handler=_run_inspect)


def _add_convert_command(commands: argparse._SubParsersAction) -> None:
    """``dsv41 convert`` (:func:`_run_convert`)."""
    convert = commands.add_parser(
        "convert",
        help="convert a released-format checkpoint (FP8/FP4) into our format (dequantized)",
        description="Read a checkpoint in DeepSeek's released storage (FP8 / packed FP4 weights with E8M0 scales) "
        "and write plain safetensors that DeepseekV41ForCausalLM.from_pretrained loads, one tensor at a time.",
    )
    convert.add_argument(
        "source", type=Path, metavar="SRC", help="folder with config.json and *.safetensors in the released format"
    )
    convert.add_argument("destination", type=Path, metavar="DST", help="new (or empty) folder to write")
    convert.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="dtype of the dequantized weights (default: %(default)s)",
    )
    convert.set_defaults(handler=_run_convert)


def _add_export_command(commands: argparse._SubParsersAction) -> None:
    """``dsv41 export`` (:func:`_run_export`)."""
    export = commands.add_parser(
        "export",
        help="write a fine-tune for serving: a LoRA adapter for vLLM, or a full fine-tune in the release's format",
        description="--format vllm-lora: write a PEFT LoRA adapter of DeepSeek-V4.1 (the folder save_pretrained "
        "wrote) as an adapter vLLM's DeepSeek-V4 LoRA serves: the release's module names, each routed expert's own "
        "w1/w2/w3 factors, one scale (format vllm-deepseek-v4-lora, version 1). The DSpark draft head (mtp.*) is left "
        "out, as vLLM skips it. --format released: write a full fine-tune (a model folder our save_pretrained or "
        "Trainer wrote) in DeepSeek's released checkpoint format (format deepseek-v4.1-released, version 1): the "
        "published config.json keys, inference/config.json, FP8 Linears, FP4 routed experts and FP8 Engram tables "
        "with E8M0 scales; the weights are rounded to that storage.",
    )
    export.add_argument(
        "source",
        type=Path,
        metavar="SRC",
        help="vllm-lora: the adapter folder (adapter_config.json, adapter_model.safetensors); released: the model "
        "folder (config.json, *.safetensors)",
    )
    export.add_argument("destination", type=Path, metavar="DST", help="new (or empty) folder to write")
    export.add_argument(
        "--format",
        required=True,
        choices=("vllm-lora", "released"),
        help="what to write: vllm-lora, the adapter layout of vLLM's DeepSeek-V4 LoRA; released, DeepSeek's "
        "checkpoint format (FP8/FP4)",
    )
    export.add_argument(
        "--base",
        metavar="PRESET|PATH",
        help="vllm-lora only: the config the adapter was trained on: a preset, a "
        "folder with config.json or a config.json (default: the adapter's base_model_name_or_path)",
    )
    export.set_defaults(handler=_run_export)


def build_parser() -> argparse.ArgumentParser:
    """The ``dsv41`` parser: one subcommand each, its handler in ``handler``."""
    parser = _Parser(prog="dsv41", description="DeepSeek-V4.1 for Hugging Face transformers.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for add_command in (_add_demo_command, _add_inspect_command, _add_convert_command, _add_export_command):
        add_command(commands)
    return parser


# ---------------------------------------------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------------------------------------------


def _run_demo(args: argparse.Namespace) -> int:
    import torch

    from .. import register
    from .demo import DemoInterrupted, DemoSettings, run_demo
    from .demo_report import choose_threads, format_demo_summary

    register()  # the export writes the Auto classes registered for the model into config.json

    settings = DemoSettings(output=args.output, lora=args.lora, seed=args.seed)
    if args.steps is not None:
        settings.steps = args.steps
    start = time.perf_counter()
    threads = torch.get_num_threads()
    choose_threads()
    try:
        report = run_demo(settings)
    except DemoInterrupted as interrupted:
        print(
            f"\nInterrupted. Checkpoint: {interrupted.checkpoint}\n"
            f"Resume with: dsv41 demo --output {args.output}"
            + (" --lora" if args.lora else "")
            + (f" --steps {args.steps}" if args.steps else "")
            + (f" --seed {args.seed}" if args.seed else ""),
            file=sys.stderr,
        )
        return 130
    finally:
        torch.set_num_threads(threads)  # as it was for the caller (the tests run the command in-process)
    print(format_demo_summary(report, time.perf_counter() - start))
    return 0


# ---------------------------------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------------------------------


def load_config(target: str):
    """A preset name, a folder holding ``config.json`` or a ``config.json`` (ours or the reference's flat one)."""
    from configuration import DeepseekV41Config

    path = Path(target)
    if path.is_dir() or path.is_file():
        config_file = path / "config.json" if path.is_dir() else path
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        try:
            config_dict = json.loads(config_file.read_bytes())
        except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{config_file} is not valid JSON: {error}") from None
        try:
            return DeepseekV41Config.from_dict(config_dict)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{config_file} is not a DeepSeek-V4.1 config: {error}") from None
    if target in PRESETS:
        return DeepseekV41Config.from_preset(target)
    raise FileNotFoundError(f"{target!r} is neither a preset ({', '.join(PRESETS)}) nor an existing path")


def _run_inspect(args: argparse.Namespace) -> int:
    from .inspection import format_inspection, inspect_config

    config = load_config(args.target)
    print(f"DeepSeek-V4.1 configuration: {args.target}")
    print(format_inspection(inspect_config(config)))
    native = args.storage == "released"
    if args.storage in ("nf4", "int8"):
        return _print_storage_costs(config, args)
    if args.train:
        return _print_training_plan(config, args)
    if args.tp or args.ep:
        return _print_parallel_plan(config, args, native)
    if args.devices:
        from ..placement import format_plan, plan_device_map
        from .inspection import build_meta_model

        print()
        plan = plan_device_map(build_meta_model(config), args.devices, native=native)
        print(format_plan(plan, args.devices, native))
    return 0


def _print_storage_costs(config, args: argparse.Namespace) -> int:
    from .inspection import format_storage_costs, storage_costs

    if args.devices or args.tp or args.ep or args.train:
        raise ValueError(
            f"--storage {args.storage} prints the weights of each load path: drop --devices, --tp, --ep "
            "and --train (they plan the released or bf16 weights)"
        )
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(
            f'--storage {args.storage} builds the modules bitsandbytes loads: install it (pip install -e ".[quant]")'
        )
    print()
    print(format_storage_costs(config, storage_costs(config)))
    return 0


def _print_training_plan(config, args: argparse.Namespace) -> int:
    from ..training.planning import longest_sequence, plan_lora_training
    from .inspection import TRAINING_CASES, build_meta_model, format_training_plan

    if args.train == "full":
        return _print_full_training_plan(config, args)
    if not args.devices:
        raise ValueError("--train lora plans a run on devices: give them with --devices (e.g. --devices 8x80GiB)")
    if args.tp or args.storage != "released":
        raise ValueError(
            "--train lora plans FSDP2 over the natively loaded (released) weights: drop --tp and "
            "--storage (--ep N splits the routed experts over N devices)"
        )
    model = build_meta_model(config)
    cases = {
        name: dict(offload=weights, offload_activations=activations)
        for name, (weights, activations) in TRAINING_CASES.items()
    }
    ep = args.ep or 1
    plans = {
        name: plan_lora_training(
            model, args.devices, seq_len=args.seq, batch_size=args.batch, rank=args.rank, ep_size=ep, **case
        )
        for name, case in cases.items()
    }
    longest = {
        name: longest_sequence(model, args.devices, batch_size=args.batch, rank=args.rank, ep_size=ep, **case)
        for name, case in cases.items()
    }
    print()
    print(format_training_plan(plans, longest))
    return 0


def _print_full_training_plan(config, args: argparse.Namespace) -> int:
    from ..training.full_planning import default_ep_size
    from .inspection import build_meta_model, format_full_training_plan

    if not args.devices or len(set(args.devices.values())) != 1:
        raise ValueError(
            "--train full plans a run on nodes of equal devices: give them with --devices "
            "NODESxGPUSxSIZE (e.g. --devices 16x8x80GiB)"
        )
    if args.tp or args.storage != "released":
        raise ValueError(
            "--train full plans the expert-parallel mesh of training.fsdp.shard_model: drop --tp and "
            "--storage (--ep N sets the expert-parallel size)"
        )
    per_node = getattr(args.devices, "per_node", None) or len(args.devices)
    nodes, capacity = len(args.devices) // per_node, args.devices[0]
    model = build_meta_model(config)
    ep = args.ep or default_ep_size(model, nodes, per_node)
    print()
    print(format_full_training_plan(model, nodes, per_node, capacity, ep, args.seq, args.batch))
    return 0


def _print_parallel_plan(config, args: argparse.Namespace, native: bool) -> int:
    from ..placement import plan_parallel
    from .inspection import build_meta_model, format_parallel_plan

    if args.tp and args.ep and args.tp != args.ep:
        raise ValueError(
            f"--tp {args.tp} --ep {args.ep}: expert parallelism runs on the tensor-parallel ranks, "
            f"use --ep {args.ep} alone (DistributedConfig(tp_size={args.ep}, ep_size={args.ep}))"
        )
    ranks = args.ep or args.tp
    if args.devices and len(args.devices) != ranks:
        raise ValueError(f"--devices lists {len(args.devices)} devices for {ranks} ranks: give one per rank")
    plan = plan_parallel(build_meta_model(config), tp_size=ranks, ep_size=args.ep or 1, native=native)
    print()
    print(format_parallel_plan(plan, args.devices, native))
    return 0


# ---------------------------------------------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------------------------------------------


def _check_writable(folder: Path) -> None:
    """Create ``folder`` if needed and write a probe file, so a read-only destination fails before any work."""
    probe = folder / ".dsv41-write-test"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise OSError(f"cannot write to {folder}: {error.strerror or error}") from None


def _run_convert(args: argparse.Namespace) -> int:
    import torch

    from ..released.convert import convert_released_checkpoint
    from ..validation import check_safetensors_folder

    destination = args.destination
    if args.source.is_dir():  # fail on a truncated shard or a read-only destination before converting anything
        check_safetensors_folder(args.source)
        if not destination.exists() or (destination.is_dir() and not any(destination.iterdir())):
            _check_writable(destination)
    written = convert_released_checkpoint(args.source, args.destination, dtype=getattr(torch, args.dtype))
    print(
        f"Wrote {written['tensors']:,} tensors ({written['bytes'] / 2**30:.2f} GiB) to {args.destination}; "
        f"load with DeepseekV41ForCausalLM.from_pretrained({str(args.destination)!r})"
    )
    return 0


# ---------------------------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------------------------


def _run_export(args: argparse.Namespace) -> int:
    if args.format == "released":
        return _run_released_export(args)
    from ..serving.adapter_export import FORMAT, FORMAT_VERSION, export_serving_adapter

    written = export_serving_adapter(args.source, args.destination, base=load_config(args.base) if args.base else None)
    left_out = f", left out {len(written['skipped'])} modules of the draft head" if written["skipped"] else ""
    print(
        f"Wrote {written['tensors']:,} tensors of {written['modules']:,} adapted modules ({FORMAT} version "
        f"{FORMAT_VERSION}{left_out}) to {args.destination}; serve with vLLM's --enable-lora --lora-modules "
        f"NAME={args.destination}"
    )
    return 0


def _run_released_export(args: argparse.Namespace) -> int:
    from ..serving.released_export import FORMAT, FORMAT_VERSION, export_released_checkpoint

    if args.base:
        raise ValueError("--base is for --format vllm-lora: a full model folder holds its own config")
    written = export_released_checkpoint(args.source, args.destination)
    print(
        f"Wrote {written['tensors']:,} tensors ({written['bytes'] / 2**30:.2f} GiB, {FORMAT} version "
        f"{FORMAT_VERSION}) to {args.destination}; {written['quantized']:,} weights rounded to FP8/FP4 storage "
        f"(largest relative change {written['max_relative_rounding']:.3g}). Load with "
        f"DeepseekV41ForCausalLM.from_pretrained({str(args.destination)!r}); DeepSeek's inference code reads "
        f"{args.destination / 'inference' / 'config.json'}"
    )
    return 0


# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    prefix = f"dsv41 {args.command}"
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print(f"\n{prefix}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as error:  # FileNotFoundError, PermissionError and disk-space errors are OSErrors
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"{prefix}: error: {message}", file=sys.stderr)
        return 2
