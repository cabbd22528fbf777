"""The demo model loaded with bitsandbytes (its routed experts quantized too) against the same model in bf16: weights
held, next-token logits on the held-out captions, and caption exact match.

The demo folder (``dsv41 demo``'s ``dsv41-demo/model``) is loaded once in bf16 (the baseline) and once per
bitsandbytes path (int8, FP4, NF4, NF4 with double quantization; ``bnb_4bit_compute_dtype=torch.bfloat16``), with this
package's model class. For each path:

- ``weights``: ``get_memory_footprint()`` (parameters and buffers: the experts' packed bytes and block scales; the
  Linears' block scales live in their quant states, which it does not count) and bytes per parameter of the bf16
  model's count;
- on the demo's 72 held-out images, teacher-forced (prompt + true caption): over the caption tokens, the share of
  positions whose argmax equals bf16's, and the mean KL(bf16 ‖ quantized) of the next-token distributions (nats);
- caption exact match of greedy ``generate`` on those images, as the demo measures it.

    python benchmarks/bnb_quantization.py [--model dsv41-demo/model] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PATHS = {
    "int8": dict(load_in_8bit=True),
    "FP4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "NF4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "NF4, double quant": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
}


def caption_batch(processor, samples, prompt: str):
    """Prompt + true caption per image (right-padded), and the mask of the caption tokens' predicting positions."""
    import torch

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    prefix = processor.apply_chat_template(messages, add_generation_prompt=True)
    texts = [prefix + sample.caption for sample in samples]
    inputs = processor(
        images=[s.image for s in samples],
        text=texts,
        padding=True,
        padding_side="right",
        add_special_tokens=False,
        return_tensors="pt",
    )
    prompt_lengths = [
        len(ids)
        for ids in processor(
            images=[s.image for s in samples], text=[prefix] * len(samples), add_special_tokens=False
        )["input_ids"]
    ]
    positions = torch.arange(inputs["input_ids"].shape[1])
    lengths = inputs["attention_mask"].sum(1)
    # position p predicts token p + 1: the caption tokens are predicted from prompt_length - 1 to length - 2
    mask = (positions >= torch.tensor(prompt_lengths)[:, None] - 1) & (positions < lengths[:, None] - 1)
    return inputs, mask


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("dsv41-demo/model"), help="the demo's exported folder")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"{args.model} holds no model: run `dsv41 demo` first (it writes dsv41-demo/model)")

    import torch
    from transformers import AutoProcessor, BitsAndBytesConfig

    import processing  # noqa: F401  registers the processor
    from modeling_dsv41 import DeepseekV41ForCausalLM
    from modeling_dsv41.cli.demo_measure import caption_exact_match
    from modeling_dsv41.cli.demo_data import PROMPT, ShapesDataset

    torch.set_num_threads(args.threads)
    processor = AutoProcessor.from_pretrained(args.model)
    held_out = ShapesDataset("eval", 72, 0)
    inputs, mask = caption_batch(processor, [held_out[i] for i in range(len(held_out))], PROMPT)

    def measure(model) -> tuple[torch.Tensor, float]:
        model.eval()
        with torch.no_grad():
            logits = model(**inputs).logits.float()[mask]
        return logits, caption_exact_match(model, processor, held_out)[0]

    baseline = DeepseekV41ForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    parameters = sum(p.numel() for p in baseline.parameters())
    reference, reference_match = measure(baseline)
    results = {"bf16": {"footprint_bytes": baseline.get_memory_footprint(), "exact_match": reference_match}}
    log_p = reference.log_softmax(-1)
    for label, options in PATHS.items():
        config = BitsAndBytesConfig(**options, bnb_4bit_compute_dtype=torch.bfloat16)
        start = time.process_time()
        model = DeepseekV41ForCausalLM.from_pretrained(args.model, quantization_config=config, dtype=torch.bfloat16)
        load_s = time.process_time() - start
        logits, match = measure(model)
        kl = (log_p.exp() * (log_p - logits.log_softmax(-1))).sum(-1)
        results[label] = {
            "footprint_bytes": model.get_memory_footprint(),
            "load_cpu_s": load_s,
            "exact_match": match,
            "argmax_agreement": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
            "kl_mean": kl.mean().item(),
            "kl_max": kl.max().item(),
        }
    print(
        f"demo model {args.model}: {parameters:,} parameters, {int(mask.sum())} caption positions of "
        f"{len(held_out)} held-out images, {args.threads} threads"
    )
    print(
        f"{'path':<20}{'footprint':>12}{'B/param':>9}{'argmax = bf16':>15}{'KL mean':>10}{'KL max':>10}"
        f"{'exact match':>13}"
    )
    for label, row in results.items():
        agreement = f"{row['argmax_agreement']:.4f}" if "argmax_agreement" in row else "-"
        kl_mean = f"{row['kl_mean']:.2e}" if "kl_mean" in row else "-"
        kl_max = f"{row['kl_max']:.2e}" if "kl_max" in row else "-"
        print(
            f"{label:<20}{row['footprint_bytes'] / 2**20:>8.2f} MiB{row['footprint_bytes'] / parameters:>9.3f}"
            f"{agreement:>15}{kl_mean:>10}{kl_max:>10}{row['exact_match']:>13.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
