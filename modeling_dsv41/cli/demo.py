"""``dsv41 demo``: every promised use of the package, end to end, on a model small enough for a laptop CPU.

1. Build a tiny DeepSeek-V4.1 (CSA2 attention, mHC, MoE, Engram, DeepSeek-ViT) and a tokenizer trained here.
2. Measure caption exact match on held-out images of :mod:`.demo_data` (greedy ``generate``).
3. Fine-tune with :class:`~.trainer.DeepseekV41Trainer` — the mixed Muon / head-wise Muon / Sinkhorn / AdamW
   optimizer — and measure again.
   With ``lora``, then teach the fine-tuned model a new caption wording (``"a red circle in the top left"``)
   through a PEFT LoRA adapter on the language model, measure that, and merge the adapter.
   Then train the DSpark draft head (``mtp.*``) on the fine-tuned backbone's own predictions (backbone frozen,
   ``DeepseekV41Trainer(train_dspark_head=True)``), and caption the held-out images with and without DSpark
   speculative decoding (``generate(use_mtp=True)``): tokens/s of both, the mean accepted length, identical captions.
4. Export a Hub-ready folder (:func:`~.export.export_for_hub`: weights, config, processor,
   tokenizer, remote code and a model card holding the measured results).
5. Reload that folder in a fresh interpreter with ``AutoModelForCausalLM`` / ``AutoProcessor``
   (``trust_remote_code=True``), caption sample images there and check they match the in-process captions.
6. Write ``loss.png`` (training and eval loss) and ``report.json``.

Ctrl-C during training saves a checkpoint; running again with the same output folder resumes from it. What is
measured is :mod:`.demo_measure`'s, what is reported :mod:`.demo_report`'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import GenerationConfig, TrainerCallback
from transformers.trainer_callback import ProgressCallback

from configuration import DeepseekV41Config
from processing import IMAGE_TOKEN, DeepseekV41ImageProcessor, DeepseekV41Processor

from . import demo_reload
from .demo_data import CAPTIONS, IMAGE_SIZE, PROMPT, ShapesDataset, build_demo_tokenizer
from .demo_measure import caption_exact_match, dspark_speed
from .demo_report import card_results, loss_curves, write_report
from ..engram import build_compressed_token_map
from ..hub.export import export_for_hub
from ..modeling_dsv41 import DeepseekV41ForCausalLM
from ..training.trainer import DeepseekV41Trainer, DeepseekV41TrainingArguments, last_complete_checkpoint

# LoRA on the language model's attention and shared-expert matrices, by released name (the block-diagonal `wo_a`
# cannot take one), and per expert on the fused routed experts; the LM head trains in full, as new words need their
# output rows
LORA_TARGET_MODULES = r"model\.layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_b)|ffn\.shared_experts\.w[123])"
LORA_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
LORA_FULLY_TRAINED = ["lm_head"]
NUM_SAMPLE_IMAGES = 8
# the demo model's draft head: one DSpark block reading the last three backbone layers, drafting 4 tokens (a short
# caption and its EOS) per verification; the pad token fills the block after its first token (it never occurs in text)
DEMO_DSPARK = {
    "num_nextn_predict_layers": 1,
    "dspark_block_size": 4,
    "dspark_target_layer_ids": [3, 4, 5],
    "dspark_markov_rank": 32,
}
MIN_FREE_BYTES = 200 * 2**20  # checkpoints, the export and the samples take ≈ 30 MB; keep a margin


class DemoInterrupted(Exception):
    """Training stopped on Ctrl-C after saving a checkpoint; ``checkpoint`` is where to resume from."""

    def __init__(self, checkpoint: str | None):
        super().__init__(f"interrupted; checkpoint saved at {checkpoint}" if checkpoint else "interrupted")
        self.checkpoint = checkpoint


@dataclass
class DemoSettings:
    """What a demo run does. Everything but ``output`` must match when resuming."""

    output: Path = Path("dsv41-demo")
    steps: int = 120  # per training stage (full fine-tuning, then LoRA, then the DSpark draft head)
    lora: bool = False
    seed: int = 0
    batch_size: int = 32
    learning_rate: float = 1e-2
    num_train: int = 4096
    num_eval: int = 72

    def validate(self) -> None:
        for name in ("steps", "batch_size", "num_train", "num_eval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning-rate must be positive, got {self.learning_rate!r}")

    def run_key(self) -> dict[str, Any]:
        """The settings that define the run (a resumed run must have the same)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "output"}


# ---------------------------------------------------------------------------------------------------------------
# Model, processor, data collation
# ---------------------------------------------------------------------------------------------------------------


def demo_config(tokenizer: Any) -> DeepseekV41Config:
    """The ``tiny`` preset sized for 84×84 images (an 8-position image span) and this tokenizer's Engram map, with a
    DSpark draft head (:data:`DEMO_DSPARK`)."""
    base = DeepseekV41Config.from_preset("tiny")
    _, compressed_vocab_size = build_compressed_token_map(tokenizer)
    config = DeepseekV41Config.from_preset(
        "tiny",
        text_config={
            **base.text_config.to_dict(),
            "engram_compressed_vocab_size": compressed_vocab_size,
            **DEMO_DSPARK,
            "dspark_noise_token_id": tokenizer.pad_token_id,
        },
        vision_config={**base.vision_config.to_dict(), "min_pixels": IMAGE_SIZE * IMAGE_SIZE},
    )
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    if len(tokenizer) != config.text_config.vocab_size or image_token_id != config.image_token_id:
        raise ValueError("the demo tokenizer does not match the tiny preset's vocabulary and image token")
    return config


def build_demo_model(config: DeepseekV41Config, tokenizer: Any, seed: int) -> DeepseekV41ForCausalLM:
    """A freshly initialized model (deterministic in ``seed``) whose Engram hashes this tokenizer's ids."""
    torch.manual_seed(seed)
    model = DeepseekV41ForCausalLM(config)
    model.model.engram_hasher.load_tokenizer(tokenizer)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    return model


def build_demo_processor(config: DeepseekV41Config, tokenizer: Any) -> DeepseekV41Processor:
    return DeepseekV41Processor(DeepseekV41ImageProcessor.from_vision_config(config.vision_config), tokenizer)


class CaptionCollator:
    """Samples → a training batch: the chat prompt with the image, then the caption and EOS. Only the caption and
    EOS are learned (``labels`` is -100 on the prompt and padding)."""

    def __init__(self, processor: DeepseekV41Processor):
        self.processor = processor
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
        self.prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
        self.answer_start_id = processor.tokenizer.convert_tokens_to_ids("</think>")

    def __call__(self, samples: list) -> dict[str, torch.Tensor]:
        eos = self.processor.tokenizer.eos_token
        batch = self.processor(
            images=[s.image for s in samples],
            text=[self.prompt + s.caption + eos for s in samples],
            padding=True,
            add_special_tokens=False,
            return_tensors="pt",
        )
        ids = batch["input_ids"]
        # the answer starts after the last `</think>` of each row
        is_marker = (ids == self.answer_start_id).long()
        after_prompt = (is_marker.flip(1).cumsum(1).flip(1) == 0) & (is_marker.cumsum(1) > 0)
        labels = ids.masked_fill(~after_prompt | (batch["attention_mask"] == 0), -100)
        return {**batch, "labels": labels}


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------


class _LossOnProgressBar(ProgressCallback):
    """transformers' progress bar, with the latest losses on the bar instead of one printed line per log and
    without a second bar for each (one-batch) evaluation."""

    def on_prediction_step(self, args, state, control, **kwargs):
        pass

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None:
            shown = {k: f"{logs[k]:.3f}" for k in ("loss", "eval_loss") if k in logs}
            if shown:
                self.training_bar.set_postfix(shown, refresh=False)


class _CheckpointOnInterrupt(TrainerCallback):
    """First Ctrl-C: finish the current step, save a checkpoint, stop. A second Ctrl-C aborts at once. Also
    saves at the last step, so a finished run is never trained again."""

    def __init__(self) -> None:
        self.interrupted = False
        self._previous_handler = None

    def _on_sigint(self, signum, frame) -> None:
        self.interrupted = True
        signal.signal(signal.SIGINT, self._previous_handler)
        print("\nCtrl-C: saving a checkpoint after this step (press again to abort now)", file=sys.stderr)

    def on_train_begin(self, args, state, control, **kwargs):
        self._previous_handler = signal.signal(signal.SIGINT, self._on_sigint)

    def on_step_end(self, args, state, control, **kwargs):
        if self.interrupted or state.global_step >= state.max_steps:
            control.should_save = True
        if self.interrupted:
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if self._previous_handler is not None:
            signal.signal(signal.SIGINT, self._previous_handler)


def lora_target_parameters(model: DeepseekV41ForCausalLM) -> list[str]:
    """The backbone layers' fused routed experts by full name (PEFT matches name suffixes: ``experts.down_proj``
    alone would also take the draft head's experts, which the caption loss never reaches)."""
    layers = model.config.text_config.num_hidden_layers
    return [f"model.layers.{i}.ffn.experts.{name}" for i in range(layers) for name in LORA_EXPERT_PARAMETERS]


def attach_lora(model: DeepseekV41ForCausalLM) -> Any:
    """A PEFT LoRA adapter (rank 8) on the language model's matrices, plus a trainable copy of the LM head."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        model,
        LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=LORA_TARGET_MODULES,
            target_parameters=lora_target_parameters(model),
            modules_to_save=LORA_FULLY_TRAINED,
        ),
    )


def training_arguments(
    settings: DemoSettings, output_dir: Path, steps: int, train_dspark_head: bool = False
) -> DeepseekV41TrainingArguments:
    """The stage's arguments; the draft head's stage is not evaluated (its loss is not the caption loss)."""
    return DeepseekV41TrainingArguments(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=settings.batch_size,
        per_device_eval_batch_size=settings.num_eval,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=min(10, steps // 10),
        weight_decay=0.1,  # Muon kinds only (the AdamW group takes none)
        max_grad_norm=1.0,
        logging_steps=max(1, min(5, steps // 10)),
        eval_strategy="no" if train_dspark_head else "steps",
        eval_steps=max(10, steps // 6),
        eval_on_start=not train_dspark_head,
        train_dspark_head=train_dspark_head,
        save_strategy="steps",
        save_steps=max(1, steps // 4),
        save_total_limit=1,
        seed=settings.seed,
        data_seed=settings.seed,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        use_cpu=True,
        report_to="none",
        log_level="warning",
    )


def fine_tune(
    model: Any,
    processor: DeepseekV41Processor,
    settings: DemoSettings,
    *,
    stage: str,
    style: str,
    steps: int,
    print_fn=print,
    train_dspark_head: bool = False,
) -> DeepseekV41Trainer:
    """Train on ``style`` captions with DeepseekV41Trainer, in ``<output>/checkpoints/<stage>`` (resuming from the
    latest complete checkpoint there, if any: a run killed while saving resumes from the one before). With
    ``train_dspark_head``, only the draft head trains, on the frozen backbone's own predictions on those captions."""
    output_dir = settings.output / "checkpoints" / stage
    trainer = DeepseekV41Trainer(
        model=model,
        args=training_arguments(settings, output_dir, steps, train_dspark_head),
        train_dataset=ShapesDataset("train", settings.num_train, settings.seed, style),
        eval_dataset=None if train_dspark_head else ShapesDataset("eval", settings.num_eval, settings.seed, style),
        data_collator=CaptionCollator(processor),
    )
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(_LossOnProgressBar())
    interrupt = _CheckpointOnInterrupt()
    trainer.add_callback(interrupt)
    trainer.create_optimizer()
    print_fn(f"Optimizer assignment ({stage} stage; MixedOptimizer, one group per kind):")
    print_fn(str(trainer.assignment_table))
    checkpoint = last_complete_checkpoint(output_dir)
    if checkpoint:
        print_fn(f"Resuming from {checkpoint}")
    trainer.train(resume_from_checkpoint=checkpoint)
    if interrupt.interrupted:
        raise DemoInterrupted(last_complete_checkpoint(output_dir))
    return trainer


def train_draft_head(
    model: DeepseekV41ForCausalLM, processor: DeepseekV41Processor, settings: DemoSettings, style: str, print_fn=print
) -> dict[str, Any]:
    """The DSpark stage: fine-tuning made the draft head stale (here: it starts random), so it learns the final
    backbone's own predictions on the training captions, backbone frozen; then :func:`dspark_speed` on held-out
    images."""
    steps = settings.steps  # fewer leave the head too weak to help (30 steps: 1.0 token per verification)
    trainer = fine_tune(
        model, processor, settings, stage="dspark", style=style, steps=steps, print_fn=print_fn, train_dspark_head=True
    )
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    images = [s.image for s in ShapesDataset("eval", settings.num_eval, settings.seed, style)]
    measured = dspark_speed(model, processor, images)
    print_fn(
        f"DSpark: {measured['dspark_tokens_per_s']:.0f} tokens/s vs {measured['plain_tokens_per_s']:.0f} plain "
        f"({measured['speedup']:.2f}x), {measured['mean_accepted_length']:.2f} tokens per verification, "
        f"captions {'identical' if measured['captions_identical'] else 'DIFFER'}"
    )
    return {"train_steps": steps, "final_train_loss": losses[-1] if losses else None, **measured}


# ---------------------------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------------------------


def reload_and_caption(folder: Path, image_paths: list[Path]) -> dict[str, Any]:
    """Run :mod:`.demo_reload` in a fresh, isolated interpreter (no project code importable but what the folder
    ships); returns its JSON output."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
    }
    paths = [str(Path(p).resolve()) for p in (folder, *image_paths)]  # it runs in a temporary directory
    command = [sys.executable, "-I", demo_reload.__file__, paths[0], PROMPT, *paths[1:]]
    with tempfile.TemporaryDirectory() as cwd:
        result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"reloading {folder} in a fresh process failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _check_output_folder(output: Path) -> None:
    try:
        output.mkdir(parents=True, exist_ok=True)
        probe = output / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise OSError(f"cannot write to output folder {output}: {error.strerror or error}") from None
    free = shutil.disk_usage(output).free
    if free < MIN_FREE_BYTES:
        raise OSError(f"only {free / 2**20:.0f} MiB free at {output}; the demo needs {MIN_FREE_BYTES / 2**20:.0f} MiB")


def _load_or_start_run(settings: DemoSettings) -> dict[str, Any]:
    """``run.json`` of a run in ``settings.output`` (checked against ``settings``), or a new one."""
    path = settings.output / "run.json"
    if path.is_file():
        run = json.loads(path.read_text())
        if run.get("settings") != settings.run_key():
            differing = sorted(k for k, v in settings.run_key().items() if run.get("settings", {}).get(k) != v)
            raise ValueError(
                f"{settings.output} holds a run with other settings ({', '.join(differing)}): rerun with the same "
                "options to resume it, or choose another --output"
            )
        return run
    return {"settings": settings.run_key()}


def _measure_once(
    run: dict[str, Any], key: str, measure: Callable[[], dict[str, Any]], output: Path
) -> dict[str, Any]:
    """``run[key]``, measuring (and recording in ``run.json``) the first time only: a resumed run keeps the numbers
    of the weights it started from."""
    if key not in run:
        run[key] = measure()
        (output / "run.json").write_text(json.dumps(run, indent=2))
    return run[key]


@contextmanager
def _timed(timings: dict[str, float], key: str) -> Iterator[None]:
    """Record the wall time of the ``with`` block in ``timings[key]``."""
    start = time.perf_counter()
    yield
    timings[key] = time.perf_counter() - start


def _scores(model: Any, processor: DeepseekV41Processor, dataset: ShapesDataset) -> dict[str, Any]:
    """Caption exact match on ``dataset`` and the first captions, as the report holds them."""
    accuracy, predictions = caption_exact_match(model, processor, dataset)
    return {"exact_match": accuracy, "examples": predictions[:4]}


def _build(settings: DemoSettings, print_fn=print) -> tuple[DeepseekV41ForCausalLM, DeepseekV41Processor]:
    """The demo model (its draft head frozen: the caption loss never reaches it, it trains in its own stage) and
    processor."""
    tokenizer = build_demo_tokenizer()
    config = demo_config(tokenizer)
    model = build_demo_model(config, tokenizer, settings.seed)
    print_fn(
        f"Built DeepSeek-V4.1 (tiny, vision + Engram + DSpark head): {model.num_parameters():,} parameters, "
        f"{config.text_config.num_hidden_layers} layers, {config.text_config.n_routed_experts} experts"
    )
    model.mtp.requires_grad_(False)
    return model, build_demo_processor(config, tokenizer)


def _lora_stage(
    model: DeepseekV41ForCausalLM,
    processor: DeepseekV41Processor,
    settings: DemoSettings,
    run: dict[str, Any],
    curves: dict[str, list],
    print_fn=print,
) -> tuple[DeepseekV41ForCausalLM, dict[str, Any]]:
    """Teach the fine-tuned model the sentence wording through a LoRA adapter (saved, then merged); its loss curves
    join ``curves``. Returns the merged model and the stage's report."""
    eval_sentence = ShapesDataset("eval", settings.num_eval, settings.seed, "sentence")
    before = _measure_once(run, "lora_before", lambda: _scores(model, processor, eval_sentence), settings.output)
    adapted = attach_lora(model)
    trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    print_fn(f"LoRA: {trainable:,} trainable parameters teach the wording {eval_sentence[0].caption!r}")
    trainer = fine_tune(
        adapted, processor, settings, stage="lora", style="sentence", steps=settings.steps, print_fn=print_fn
    )
    curves.update(loss_curves(trainer.state.log_history, prefix="LoRA ", offset=settings.steps))
    adapter_dir = settings.output / "lora-adapter"
    adapted.save_pretrained(adapter_dir)
    merged = adapted.merge_and_unload()
    after = _scores(merged, processor, eval_sentence)
    print_fn(f"After LoRA, sentence caption exact match: {after['exact_match']:.3f}")
    return merged, {
        "before": before,
        "after": after,
        "trainable_parameters": trainable,
        "adapter_dir": str(adapter_dir),
    }


def _reload_check(
    model: DeepseekV41ForCausalLM,
    processor: DeepseekV41Processor,
    export_dir: Path,
    settings: DemoSettings,
    style: str,
) -> dict[str, Any]:
    """Sample images saved to ``<output>/samples``, captioned in process and by the exported folder reloaded in a
    fresh interpreter (:func:`reload_and_caption`)."""
    final_eval = ShapesDataset("eval", settings.num_eval, settings.seed, style)
    sample_dir = settings.output / "samples"
    sample_dir.mkdir(exist_ok=True)
    sample_paths = []
    for i in range(min(NUM_SAMPLE_IMAGES, len(final_eval))):
        path = sample_dir / f"eval-{i}.png"
        final_eval[i].image.save(path)
        sample_paths.append(path)
    in_process = demo_reload.caption_images(model, processor, [Image.open(p) for p in sample_paths], PROMPT)
    reloaded = reload_and_caption(export_dir, sample_paths)
    return {
        "samples": [
            {"image": str(p), "truth": final_eval[i].caption, "in_process": a, "reloaded": b}
            for i, (p, a, b) in enumerate(zip(sample_paths, in_process, reloaded["captions"]))
        ],
        "reloaded_model_class": reloaded["model_class"],
        "reloaded_generations_equal": in_process == reloaded["captions"],
    }


def run_demo(settings: DemoSettings, print_fn=print) -> dict[str, Any]:
    """The whole demo; returns (and writes to ``report.json``) what it measured. See the module docstring."""
    settings.validate()
    output = settings.output
    _check_output_folder(output)
    run = _load_or_start_run(settings)
    style = "sentence" if settings.lora else "short"  # the wording the final model captions in
    timings: dict[str, float] = {}

    with _timed(timings, "build_and_baseline_s"):
        model, processor = _build(settings, print_fn)
        eval_short = ShapesDataset("eval", settings.num_eval, settings.seed)
        before = _measure_once(run, "before", lambda: _scores(model, processor, eval_short), output)
        print_fn(
            f"Untrained caption exact match: {before['exact_match']:.3f} "
            f"(a caption guesser scores {1 / len(CAPTIONS):.3f})"
        )
    with _timed(timings, "train_s"):
        trainer = fine_tune(
            model, processor, settings, stage="full", style="short", steps=settings.steps, print_fn=print_fn
        )
        curves = loss_curves(trainer.state.log_history)
        after = _scores(model, processor, eval_short)
        print_fn(f"Fine-tuned caption exact match: {after['exact_match']:.3f}")
    lora = None
    if settings.lora:
        with _timed(timings, "lora_s"):
            model, lora = _lora_stage(model, processor, settings, run, curves, print_fn)
    with _timed(timings, "dspark_s"):
        dspark = train_draft_head(model, processor, settings, style, print_fn)
    report = {"before": before, "after": after, "lora": lora, "dspark": dspark}
    with _timed(timings, "export_s"):
        card = {"model_name": "dsv41-demo", "tags": ["demo"]}
        results = card_results(report, settings.num_eval)
        export_dir = export_for_hub(
            model, output / "model", processor, repo_id="dsv41-demo", card_data=card, results=results
        )
    with _timed(timings, "reload_s"):
        reload_check = _reload_check(model, processor, export_dir, settings, style)

    report |= {
        "settings": {**settings.run_key(), "output": str(output)},
        "num_parameters": model.num_parameters(),
        "chance_exact_match": 1 / len(CAPTIONS),
        "loss_curves": curves,
        **reload_check,
        "export_dir": str(export_dir),
        "timings_s": timings,
    }
    return write_report(report, output)


__all__ = [
    "CaptionCollator",
    "DemoInterrupted",
    "DEMO_DSPARK",
    "DemoSettings",
    "LORA_FULLY_TRAINED",
    "LORA_TARGET_MODULES",
    "attach_lora",
    "build_demo_model",
    "build_demo_processor",
    "demo_config",
    "fine_tune",
    "reload_and_caption",
    "run_demo",
    "train_draft_head",
]
