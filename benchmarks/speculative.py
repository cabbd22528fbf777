"""DSpark speculative decoding (``generate(use_mtp=True)``) vs plain cached greedy decoding, in the same run.

The model (``--size tiny``: the tiny preset; ``medium``: issue 15's ~510M configuration, see benchmarks/forward.py)
gets a DSpark head (``--block-size`` tokens per draft, ``--stages`` blocks) with random weights; the head is then
trained briefly on the frozen backbone's own greedy continuations (``DeepseekV41Trainer(train_dspark_head=True)``,
``--train-steps``), as after fine-tuning. Reported, for ``--batch`` prompts and ``--new-tokens`` tokens:

- decode tokens/s of plain greedy ``generate`` and of DSpark (median of ``--reps`` round-robin runs, prefill
  included in both), and their ratio (the baseline: plain cached greedy decoding of the same model);
- DSpark's mean accepted length: new tokens per main-model forward after the prefill (1.0 = no gain possible);
- whether both give the same tokens (they must).

Usage: ``python benchmarks/speculative.py [--size tiny|medium] [--device cpu|cuda] [--dtype float32|bfloat16]
[--batch 1] [--new-tokens 64] [--block-size 5] [--stages 2] [--train-steps 200] [--reps 3] [--threads 2]``
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


def train_head(model, steps: int, device: str, vocab: int) -> None:
    prompts = torch.randint(3, min(vocab, 500), (32, 8), generator=torch.Generator().manual_seed(1)).to(device)
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


def timed(device: str, call) -> tuple[float, torch.Tensor]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = call()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=5)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--train-steps", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args.size, args.block_size, args.stages).to(args.device)
    vocab = model.config.text_config.vocab_size
    train_head(model, args.train_steps, args.device, vocab)
    model = model.eval().to(getattr(torch, args.dtype))
    prompts = torch.randint(3, min(vocab, 500), (args.batch, 8), generator=torch.Generator().manual_seed(2))
    prompts = prompts.to(args.device)
    forwards = []
    model.model.register_forward_hook(lambda *a: forwards.append(1))
    kwargs = dict(max_new_tokens=args.new_tokens, do_sample=False)
    plain_times, spec_times, steps = [], [], []
    for _ in range(args.reps):
        seconds, plain = timed(args.device, lambda: model.generate(prompts, **kwargs))
        plain_times.append(seconds)
        forwards.clear()
        seconds, spec = timed(args.device, lambda: model.generate(prompts, use_mtp=True, **kwargs))
        spec_times.append(seconds)
        steps.append(len(forwards) - 1)
    tokens = args.batch * args.new_tokens
    plain_rate, spec_rate = tokens / statistics.median(plain_times), tokens / statistics.median(spec_times)
    print(f"size {args.size}, {args.device} {args.dtype}, batch {args.batch}, {args.new_tokens} new tokens, "
          f"block {args.block_size}, {args.stages} stages")
    print(f"plain greedy: {plain_rate:.1f} tokens/s   DSpark: {spec_rate:.1f} tokens/s   "
          f"ratio {spec_rate / plain_rate:.2f}x")
    print(f"mean accepted length: {(args.new_tokens - 1) / statistics.median(steps):.2f} tokens per verification")
    print(f"identical tokens: {bool(torch.equal(plain, spec))}")


if __name__ == "__main__":
    main()
