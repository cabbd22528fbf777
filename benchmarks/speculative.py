"""DSpark speculative decoding (``generate(use_mtp=True)``) vs plain cached greedy decoding, in the same run, at one
or more batch sizes.

The model:

- ``--size tiny`` (the tiny preset) or ``medium`` (issue 15's ~510M configuration, see benchmarks/forward.py): random
  backbone weights and a DSpark head (``--block-size`` tokens per draft, ``--stages`` blocks), trained for
  ``--train-steps`` on the frozen backbone's greedy continuations of ``--train-sequences`` random prompts
  (``DeepseekV41Trainer(train_dspark_head=True)``), as after fine-tuning; the prompts are random ids;
- ``--size demo``: the model ``dsv41 demo`` exported (``--demo-dir``, default ``dsv41-demo/model``: run the demo
  first): its fine-tuned backbone and the draft head the demo trained (``--train-steps`` more on the training
  captions, if > 0); the prompts are the caption chat prompts of the first held-out images, decoded until EOS or
  ``--new-tokens``.

Every batch size decodes the same ``--prompts`` prompts (default: as many as the largest batch), in calls of that
many rows, three ways, timed in round robin (median of ``--reps``):

- plain greedy ``generate`` (the baseline);
- DSpark, each row advancing by its own accepted length (what ``use_mtp=True`` does);
- DSpark with the rule it replaced: every row keeps the prefix all rows accepted (the shortest), rows in step.

Reported: tokens/s end to end (prefill included) and decode only (the median prefill time, ``max_new_tokens=1``,
subtracted) and the ratios to plain; the verification forwards and the accepted tokens per verification (the tokens
a row decodes, up to its EOS, per verification forward it takes part in still decoding); whether the tokens
are plain greedy's (they must be); for the per-row decoding, where its time goes (prefill, verification forwards,
draft passes, the draft head's ring writes, the cache's per-row rollbacks, the rest: acceptance, logits processors,
stopping criteria, bookkeeping), from the last repetition; and, with batch 1 among the sizes, per row's accepted
tokens per verification at each batch against batch 1's (the same prompts one at a time). Before the timing, for tiny
and medium: the head's accuracy on the benchmark prompts' greedy continuations (which it was not trained on) and how
sharp the backbone's next-token distribution is there (what bounds the acceptance; docs/benchmarks.md).

Usage: ``python benchmarks/speculative.py [--size tiny|medium|demo] [--demo-dir DIR] [--device cpu|cuda]
[--dtype float32|bfloat16] [--batch 1,8,72] [--prompts N] [--new-tokens 64] [--block-size 5] [--stages 2]
[--train-steps 200] [--train-sequences 32] [--reps 3] [--threads 2] [--clock wall|process]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling forward.py
from forward import SIZES, build_ours  # noqa: E402

from modeling_dsv41.generation import speculative  # noqa: E402
from modeling_dsv41.generation.cache import DeepseekV41Cache  # noqa: E402
from modeling_dsv41.training.trainer import DeepseekV41Trainer, DeepseekV41TrainingArguments  # noqa: E402


def build(size: str, block_size: int, stages: int):
    layers = SIZES[size].get("num_hidden_layers", 6)
    dspark = {
        "num_nextn_predict_layers": stages,
        "dspark_block_size": block_size,
        "dspark_noise_token_id": 7,
        "dspark_target_layer_ids": list(range(layers - 3, layers)),
        "dspark_markov_rank": 32,
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


def load_demo(folder: Path, train_steps: int):
    """The exported demo model and a function giving the inputs of held-out caption prompts ``start … stop - 1`` (the
    head further trained on the training captions for ``train_steps``, as ``dsv41 demo`` trains it)."""
    from modeling_dsv41 import DeepseekV41ForCausalLM
    from modeling_dsv41.cli import demo, demo_reload
    from modeling_dsv41.cli.demo_data import PROMPT, ShapesDataset
    from processing import DeepseekV41Processor

    if not (folder / "config.json").is_file():
        raise SystemExit(
            f"--size demo reads the model `dsv41 demo` exports: no {folder / 'config.json'} (run the demo)"
        )
    model = DeepseekV41ForCausalLM.from_pretrained(folder)
    processor = DeepseekV41Processor.from_pretrained(folder)
    if train_steps > 0:
        with tempfile.TemporaryDirectory() as out:
            settings = demo.DemoSettings(output=Path(out), steps=train_steps)
            demo.fine_tune(
                model, processor, settings, stage="dspark", style="short", steps=train_steps, train_dspark_head=True
            )

    def inputs(start: int, stop: int) -> dict[str, torch.Tensor]:
        images = [sample.image for sample in ShapesDataset("eval", stop, seed=1)][start:stop]
        return dict(demo_reload.caption_inputs(processor, images, PROMPT))

    return model, inputs


def train_head(model, steps: int, device: str, vocab: int, sequences: int = 32) -> None:
    prompts = torch.randint(3, min(vocab, 500), (sequences, 8), generator=torch.Generator().manual_seed(1)).to(device)
    # the random backbone may continue with the image placeholder, which a full (training) forward refuses without an
    # image: the continuations leave it out
    no_image = dict(suppress_tokens=[model.config.image_token_id]) if model.config.has_vision else {}
    with torch.no_grad():
        sequences = torch.cat(
            [
                model.generate(chunk, max_new_tokens=56, do_sample=False, **no_image).cpu()
                for chunk in prompts.split(64)
            ]
        )
    with tempfile.TemporaryDirectory() as out:
        # 3e-2: of 3e-3, 1e-2, 3e-2 and 1e-1 (which diverged) over 400 steps on 512 continuations, the most tokens
        # accepted per verification on the benchmark's 72 prompts (1.44, 1.53, 1.65; docs/benchmarks.md)
        args = DeepseekV41TrainingArguments(
            output_dir=out,
            train_dspark_head=True,
            max_steps=steps,
            per_device_train_batch_size=8,
            learning_rate=3e-2,
            report_to=[],
            save_strategy="no",
            logging_steps=max(steps // 4, 1),
            use_cpu=device == "cpu",
            disable_tqdm=True,
        )
        DeepseekV41Trainer(model=model, args=args, train_dataset=Sequences(sequences)).train()
    with torch.no_grad():
        print(
            "draft head accuracy on its training sequences: "
            f"{float(model.dspark_loss(sequences.to(device)).accuracy):.3f}"
        )


@torch.no_grad()
def report_held_out(model, prompts: torch.Tensor, new_tokens: int) -> None:
    """The draft head's accuracy on the benchmark prompts' greedy continuations (prompts it was not trained on), and
    how sharp the backbone's next-token distribution is there: a draft must reproduce the backbone's argmax, which a
    random backbone decides by small logit margins."""
    sequences = model.generate(prompts, max_new_tokens=new_tokens, do_sample=False)
    if model.config.has_vision:  # a full forward refuses the image placeholder without an image: leave those rows out
        sequences = sequences[~(sequences == model.config.image_token_id).any(dim=1)]
    logits = model(sequences).logits[:, prompts.shape[1] - 1 : -1].float()
    top2 = logits.topk(2, dim=-1).values
    print(
        f"draft head accuracy on {len(sequences)} benchmark prompts' continuations: "
        f"{float(model.dspark_loss(sequences).accuracy):.3f}; "
        f"the backbone there: mean top-1 probability {float(logits.softmax(-1).amax(-1).mean()):.4f} "
        f"(uniform {1 / logits.shape[-1]:.4f}), median top-1 - top-2 logit gap "
        f"{float((top2[..., 0] - top2[..., 1]).median()):.3f} (logits' standard deviation "
        f"{float(logits.std(-1).mean()):.3f})"
    )


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


@contextmanager
def patched(owner, name: str, wrap):
    """``owner.name`` replaced by ``wrap(owner.name)`` for the duration (a class's method, or an instance's)."""
    own = name in vars(owner)
    original = getattr(owner, name)
    setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)  # the instance attribute over the class's method


@contextmanager
def shortest_prefix():
    """Greedy DSpark with the rule per-row acceptance replaced: every row still decoding keeps the draft prefix all of
    them accepted (the shortest; a row that is done, or has no room left, has a limit of 0 and does not count)."""

    def wrap(accept):
        def in_step(draft, target_logits, limit):
            tokens, accepted = accept(draft, target_logits, limit)
            live = limit > 0
            if bool(live.any()):
                tokens, accepted = accept(draft, target_logits, torch.minimum(limit, accepted[live].min()))
            return tokens, accepted

        return in_step

    with patched(speculative, "accept_greedy", wrap):
        yield


def per_row():
    return patched(speculative, "accept_greedy", lambda accept: accept)  # use_mtp=True as it is


METHODS = {"per row": per_row, "shortest prefix": shortest_prefix}


@contextmanager
def kept_tokens(model):
    """Records, for every verification, the tokens each row still decoding kept: the forward's width less what the
    cache's per-row rollback removed (a row that is done drops the whole forward)."""
    kept: list[torch.Tensor] = []
    width = {}
    hook = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: width.update(n=kwargs["input_ids"].shape[1]), with_kwargs=True
    )

    def wrap(crop_rows):
        def record(cache, tokens):
            kept.append(width["n"] - tokens.cpu())
            return crop_rows(cache, tokens)

        return record

    try:
        with patched(DeepseekV41Cache, "crop_rows", wrap):
            yield kept
    finally:
        hook.remove()


def accepted_per_verification(kept: list[torch.Tensor], decoded: int, batch: int) -> float:
    """The tokens a row decodes per verification it takes part in still decoding: the decoded tokens (up to each row's
    EOS) after the prefill's, over those verifications (a verification that ends a row may keep tokens past its EOS,
    which do not count)."""
    return (decoded - batch) / int((torch.cat(kept) > 0).sum())


@contextmanager
def time_split(model, clock):
    """Seconds spent in the prefill, the verification forwards, the draft passes, the ring writes and the cache's
    rollbacks of the generate calls inside (``split["total"]`` is set by the caller)."""
    split: dict[str, float] = defaultdict(float)
    start = {}

    def before(module, args, kwargs):
        cache = kwargs.get("cache")
        start["kind"] = "prefill" if cache is None or cache.is_empty else "verification forwards"
        start["forward"] = clock()

    def after(module, args, kwargs, output):
        split[start["kind"]] += clock() - start["forward"]

    def timing(name):
        def wrap(fn):
            def call(*args, **kwargs):
                begin = clock()
                try:
                    return fn(*args, **kwargs)
                finally:
                    split[name] += clock() - begin

            return call

        return wrap

    hooks = [
        model.model.register_forward_pre_hook(before, with_kwargs=True),
        model.model.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        with (
            patched(model.mtp, "draft", timing("draft passes")),
            patched(model.mtp, "write_ring", timing("ring writes")),
            patched(DeepseekV41Cache, "crop_rows", timing("cache rollbacks")),
        ):
            yield split
    finally:
        for hook in hooks:
            hook.remove()


def bench_batch(model, prompt_inputs, n_prompts: int, batch: int, args, clock) -> dict[str, float]:
    """Decode prompts ``0 … n_prompts - 1`` in calls of ``batch`` rows, plain and with each DSpark rule (timed in round
    robin, median of ``args.reps``), and print the figures; returns per row's accepted tokens per verification and
    decode-only ratio."""
    device = args.device
    calls = [prompt_inputs(start, min(start + batch, n_prompts)) for start in range(0, n_prompts, batch)]
    greedy = dict(max_new_tokens=args.new_tokens, do_sample=False)

    def plain(**overrides):
        return [model.generate(**inputs, **(greedy | overrides)) for inputs in calls]

    def dspark(rule):
        with rule():
            return [model.generate(**inputs, use_mtp=True, **greedy) for inputs in calls]

    prefill_times, seconds, outputs, kept, split = [], defaultdict(list), {}, {}, {}
    for _ in range(args.reps):
        prefill_times.append(timed(device, lambda: plain(max_new_tokens=1), clock)[0])
        elapsed, outputs["plain"] = timed(device, plain, clock)
        seconds["plain"].append(elapsed)
        for name, rule in METHODS.items():  # the last repetition's record of each rule is reported
            with kept_tokens(model) as kept[name], time_split(model, clock) as split[name]:
                elapsed, outputs[name] = timed(device, lambda rule=rule: dspark(rule), clock)
            split[name]["total"] = elapsed
            seconds[name].append(elapsed)
    eos = model.generation_config.eos_token_id
    tokens = sum(
        decoded_tokens(out[:, inputs["input_ids"].shape[1] :], eos) for out, inputs in zip(outputs["plain"], calls)
    )
    prefill = statistics.median(prefill_times)
    median = {name: statistics.median(times) for name, times in seconds.items()}
    print(
        f"\nbatch {batch}: {n_prompts} prompts in {len(calls)} calls, {tokens} decoded tokens (at most "
        f"{args.new_tokens} per row), prefill {prefill * 1e3:.0f} ms"
    )
    decode = tokens - n_prompts  # the prefill's token of each row is not decoding
    result = {}
    for name, elapsed in median.items():
        decode_ratio = (median["plain"] - prefill) / (elapsed - prefill)
        line = (
            f"  {name:15s}  end to end {tokens / elapsed:8.1f} tokens/s ({median['plain'] / elapsed:.2f}x)   "
            f"decode only {decode / (elapsed - prefill):8.1f} tokens/s ({decode_ratio:.2f}x)"
        )
        if name != "plain":
            accepted = accepted_per_verification(kept[name], tokens, n_prompts)
            identical = all(torch.equal(a, b) for a, b in zip(outputs[name], outputs["plain"]))
            line += (
                f"   {len(kept[name])} verifications, {accepted:.2f} accepted tokens per verification   "
                f"identical tokens: {identical}"
            )
            result[name] = (accepted, decode_ratio)
        print(line)
    parts = ("prefill", "verification forwards", "draft passes", "ring writes", "cache rollbacks")
    times = split["per row"]
    rest = times["total"] - sum(times[part] for part in parts)
    parts = ", ".join(f"{part} {times[part] * 1e3:.0f} ms" for part in parts)
    print(f"  per row, where the time goes ({times['total'] * 1e3:.0f} ms): {parts}, the rest {rest * 1e3:.0f} ms")
    return result["per row"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES) + ["demo"], default="tiny")
    parser.add_argument("--demo-dir", type=Path, default=Path("dsv41-demo/model"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", default="1", help="batch sizes, comma-separated (e.g. 1,8,72)")
    parser.add_argument(
        "--prompts",
        type=int,
        default=None,
        help="prompts decoded at every batch size, in calls of that many rows (default: the largest batch)",
    )
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=5)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--train-steps", type=int, default=200)
    parser.add_argument(
        "--train-sequences",
        type=int,
        default=32,
        help="tiny/medium: the backbone's greedy continuations of this many random prompts train the head",
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="process: this process's CPU time (all its threads), steadier on a machine shared with "
        "other jobs; use it with --threads 1 (idle OpenMP threads spin)",
    )
    args = parser.parse_args()
    batches = [int(size) for size in args.batch.split(",")]
    n_prompts = args.prompts or max(batches)
    if max(batches) > n_prompts:
        parser.error(f"--prompts {n_prompts} is fewer than the largest batch, {max(batches)}")
    torch.set_num_threads(args.threads)
    if args.size == "demo":
        model, demo_inputs = load_demo(args.demo_dir, args.train_steps)
    else:
        model = build(args.size, args.block_size, args.stages).to(args.device)
        vocab = model.config.text_config.vocab_size
        train_head(model, args.train_steps, args.device, vocab, args.train_sequences)
        prompts = torch.randint(3, min(vocab, 500), (n_prompts, 8), generator=torch.Generator().manual_seed(2))
    model = model.eval().to(args.device).to(getattr(torch, args.dtype))
    if args.size != "demo":
        report_held_out(model, prompts.to(args.device), args.new_tokens)

    def prompt_inputs(start: int, stop: int) -> dict[str, torch.Tensor]:
        inputs = demo_inputs(start, stop) if args.size == "demo" else {"input_ids": prompts[start:stop]}
        inputs = {k: v.to(args.device) for k, v in inputs.items() if v is not None}
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
        return inputs

    text = model.config.text_config
    print(
        f"size {args.size}, {args.device} {args.dtype}, {args.threads} threads, {args.clock} clock, "
        f"block {text.dspark_block_size}, {text.num_nextn_predict_layers} stages, {n_prompts} prompts, "
        f"batches {batches}"
    )
    per_row = {
        batch: bench_batch(model, prompt_inputs, n_prompts, batch, args, CLOCKS[args.clock]) for batch in batches
    }
    if 1 in per_row:
        print(
            "\nper row against batch 1 (the same prompts one at a time): "
            + ", ".join(
                f"batch {batch} accepted tokens per verification {accepted / per_row[1][0]:.2f}x, decode only "
                f"{ratio:.2f}x"
                for batch, (accepted, ratio) in per_row.items()
                if batch != 1
            )
        )


if __name__ == "__main__":
    main()
