"""DSpark speculative decoding (``generate(use_mtp=True)``) vs plain cached greedy decoding, in the same run.

The model:

- ``--size tiny`` (the tiny preset) or ``medium`` (issue 15's ~510M configuration, see benchmarks/forward.py): random
  backbone weights and a DSpark head (``--block-size`` tokens per draft, ``--stages`` blocks), trained for
  ``--train-steps`` on the frozen backbone's own greedy continuations of random prompts
  (``DeepseekV41Trainer(train_dspark_head=True)``), as after fine-tuning; the prompts are random ids;
- ``--size demo``: the model ``dsv41 demo`` exported (``--demo-dir``, default ``dsv41-demo/model``: run the demo
  first): its fine-tuned backbone and the draft head the demo trained (``--train-steps`` more on the training
  captions, if > 0); the prompts are the caption chat prompts of ``--batch`` held-out images, decoded until EOS or
  ``--new-tokens``.

Reported, for ``--batch`` prompts:

- tokens/s of plain greedy ``generate`` and of DSpark (median of ``--reps`` round-robin runs), end to end (prefill
  included) and decode only (the median prefill time, ``max_new_tokens=1``, subtracted), and their ratios (the
  baseline: plain cached greedy decoding of the same model on the same prompts);
- DSpark's mean accepted length: tokens decoded per verification forward after the prefill (1.0 = no gain possible);
- whether both give the same tokens (they must).

Usage: ``python benchmarks/speculative.py [--size tiny|medium|demo] [--demo-dir DIR] [--device cpu|cuda]
[--dtype float32|bfloat16] [--batch 1] [--new-tokens 64] [--block-size 5] [--stages 2] [--train-steps 200] [--train-sequences 32]
[--reps 3] [--threads 2] [--clock wall|process]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling forward.py
from forward import SIZES, build_ours  # noqa: E402

from modeling_dsv41.training.trainer import DeepseekV41Trainer, DeepseekV41TrainingArguments  # noqa: E402


def build(size: str, block_size: int, stages: int):
    layers = SIZES[size].get("num_hidden_layers", 6)
    dspark = {
        "num_nextn_predict_layers": stages, "dspark_block_size": block_size, "dspark_noise_token_id": 7,
        "dspark_target_layer_ids": list(range(layers - 3, layers)), "dspark_markov_rank": 32,
    }
    torch.manual_seed(0)
    model = build_ours(engram=size == "tiny", size=size, **dspark)
    model.generation_config.eos_token_id = None
    return model


class Sequences(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


def load_demo(folder: Path, batch: int, train_steps: int):
    """The exported demo model and the inputs of ``batch`` held-out caption prompts (the head further trained on the
    training captions for ``train_steps``, as ``dsv41 demo`` trains it)."""
    from modeling_dsv41 import DeepseekV41ForCausalLM
    from modeling_dsv41.cli import demo, demo_reload
    from modeling_dsv41.cli.demo_data import PROMPT, ShapesDataset
    from processing import DeepseekV41Processor

    if not (folder / "config.json").is_file():
        raise SystemExit(f"--size demo reads the model `dsv41 demo` exports: no {folder / 'config.json'} (run the demo)")
    model = DeepseekV41ForCausalLM.from_pretrained(folder)
    processor = DeepseekV41Processor.from_pretrained(folder)
    if train_steps > 0:
        with tempfile.TemporaryDirectory() as out:
            settings = demo.DemoSettings(output=Path(out), steps=train_steps)
            demo.fine_tune(model, processor, settings, stage="dspark", style="short", steps=train_steps,
                           train_dspark_head=True)
    images = [sample.image for sample in ShapesDataset("eval", batch, seed=1)]
    return model, dict(demo_reload.caption_inputs(processor, images, PROMPT))


def train_head(model, steps: int, device: str, vocab: int, sequences: int = 32) -> None:
    prompts = torch.randint(3, min(vocab, 500), (sequences, 8), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        sequences = model.generate(prompts, max_new_tokens=56, do_sample=False).cpu()
    with tempfile.TemporaryDirectory() as out:
        args = DeepseekV41TrainingArguments(
            output_dir=out, train_dspark_head=True, max_steps=steps, per_device_train_batch_size=8,
            learning_rate=3e-3, report_to=[], save_strategy="no", logging_steps=max(steps // 4, 1),
            use_cpu=device == "cpu", disable_tqdm=True,
        )
        DeepseekV41Trainer(model=model, args=args, train_dataset=Sequences(sequences)).train()
    with torch.no_grad():
        print(f"draft head accuracy on its training sequences: {float(model.dspark_loss(sequences.to(device)).accuracy):.3f}")


CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


def timed(device: str, call, clock=time.perf_counter) -> tuple[float, torch.Tensor]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = clock()
    out = call()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return clock() - start, out


def decoded_tokens(new: torch.Tensor, eos_token_id: int | None) -> int:
    """Tokens generated in new [B, N]: each row's up to its first EOS (included), or all N."""
    if eos_token_id is None:
        return new.numel()
    is_eos = new == eos_token_id
    return int(torch.where(is_eos.any(dim=1), is_eos.long().argmax(dim=1) + 1, new.shape[1]).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES) + ["demo"], default="tiny")
    parser.add_argument("--demo-dir", type=Path, default=Path("dsv41-demo/model"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=5)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--train-steps", type=int, default=200)
    parser.add_argument("--train-sequences", type=int, default=32,
                        help="tiny/medium: the backbone's greedy continuations of this many random prompts train the head")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="process: this process's CPU time (all its threads), steadier on a machine shared with "
                             "other jobs; use it with --threads 1 (idle OpenMP threads spin)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.size == "demo":
        model, inputs = load_demo(args.demo_dir, args.batch, args.train_steps)
    else:
        model = build(args.size, args.block_size, args.stages).to(args.device)
        vocab = model.config.text_config.vocab_size
        train_head(model, args.train_steps, args.device, vocab, args.train_sequences)
        inputs = {"input_ids": torch.randint(3, min(vocab, 500), (args.batch, 8), generator=torch.Generator().manual_seed(2))}
    model = model.eval().to(args.device).to(getattr(torch, args.dtype))
    inputs = {k: v.to(args.device) for k, v in inputs.items()}
    inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype) if "pixel_values" in inputs else None
    inputs = {k: v for k, v in inputs.items() if v is not None}
    forwards = []
    model.model.register_forward_hook(lambda *a: forwards.append(1))
    kwargs = dict(max_new_tokens=args.new_tokens, do_sample=False)
    prefill_times, plain_times, spec_times, steps = [], [], [], []
    for _ in range(args.reps):
        clock = CLOCKS[args.clock]
        prefill_times.append(
            timed(args.device, lambda: model.generate(**inputs, max_new_tokens=1, do_sample=False), clock)[0]
        )
        seconds, plain = timed(args.device, lambda: model.generate(**inputs, **kwargs), clock)
        plain_times.append(seconds)
        forwards.clear()
        seconds, spec = timed(args.device, lambda: model.generate(**inputs, use_mtp=True, **kwargs), clock)
        spec_times.append(seconds)
        steps.append(len(forwards) - 1)
    prompt_len = inputs["input_ids"].shape[1]
    tokens = decoded_tokens(plain[:, prompt_len:], model.generation_config.eos_token_id)
    prefill, plain_s, spec_s = (statistics.median(t) for t in (prefill_times, plain_times, spec_times))
    text = model.config.text_config
    print(f"size {args.size}, {args.device} {args.dtype}, {args.threads} threads, {args.clock} clock, batch {args.batch}, {tokens} decoded tokens (at most "
          f"{args.new_tokens} per row), block {text.dspark_block_size}, {text.num_nextn_predict_layers} stages")
    print(f"end to end:  plain greedy {tokens / plain_s:.1f} tokens/s   DSpark {tokens / spec_s:.1f} tokens/s   "
          f"ratio {plain_s / spec_s:.2f}x")
    decode = tokens - args.batch  # the prefill's token of each row is not decoding
    print(f"decode only: plain greedy {decode / (plain_s - prefill):.1f} tokens/s   DSpark "
          f"{decode / (spec_s - prefill):.1f} tokens/s   ratio {(plain_s - prefill) / (spec_s - prefill):.2f}x   "
          f"(prefill {prefill * 1e3:.0f} ms)")
    accepted = (spec.shape[1] - prompt_len - 1) / statistics.median(steps)
    print(f"mean accepted length: {accepted:.2f} tokens per verification")
    print(f"identical tokens: {bool(torch.equal(plain, spec))}")


if __name__ == "__main__":
    main()
