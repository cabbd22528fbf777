"""What ``test_transformers_common.py`` runs transformers' own test mixins with: the mixins themselves, taken from
the transformers sdist of the installed version, and DeepSeek-V4.1 model testers (text-only, image+text, Engram).

The sdist's ``tests/`` folder ships ``test_modeling_common.py``, ``test_configuration_common.py``,
``test_image_processing_common.py`` and ``test_processing_common.py``, but not four modules of the transformers
repository they import (``tests/generation/test_utils.py``, ``tests/exporters/test_export.py``,
``tests/utils/test_configuration_utils.py``, ``utils/fetch_hub_objects_for_ci.py``). Those are stood in for here:
our own :class:`GenerationTesterMixin` (generation checks written for this model), no export tests, our own
common config kwargs, and a Hub fetcher that refuses (no network while tests run).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

import torch
import transformers

from configuration import DeepseekV41Config
from modeling_dsv41.generation.cache import DeepseekV41StaticCache

IMAGE_TOKEN_ID = 250  # inside the testers' vocabulary (256), above the ids the text inputs draw from
TEXT_TYPE = -1  # image_token_types of a text position
COMMON_TEST_FILES = (
    "test_modeling_common.py",
    "test_configuration_common.py",
    "test_image_processing_common.py",
    "test_processing_common.py",
)
PACKAGE = "transformers_sdist_tests"


# ---------------------------------------------------------------------------------------------------------------------
# transformers' common tests, from the sdist of the installed version
# ---------------------------------------------------------------------------------------------------------------------
def sdist_tests_root() -> Path:
    """Folder (outside the repository) that holds ``transformers_sdist_tests/`` for the installed version."""
    cache = Path(os.environ.get("DSV41_TRANSFORMERS_TESTS_CACHE", Path.home() / ".cache" / "dsv41"))
    return cache / f"transformers-{transformers.__version__}-tests"


def _download_sdist(into: Path) -> Path:
    """The transformers sdist of the installed version: ``$DSV41_TRANSFORMERS_SDIST`` or ``pip download``."""
    given = os.environ.get("DSV41_TRANSFORMERS_SDIST")
    if given:
        return Path(given)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        f"transformers=={transformers.__version__}",
        "--no-binary",
        ":all:",
        "--no-deps",
        "--no-build-isolation",
        "--quiet",
        "-d",
        str(into),
        "--timeout",
        "30",
        "--retries",
        "2",  # without a network: a clear error in about a minute, not ten
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    archives = sorted(into.glob("transformers-*.tar.gz"))
    if result.returncode or not archives:
        raise RuntimeError(
            f"could not download the transformers {transformers.__version__} sdist (needed for transformers' common "
            f"tests): {result.stderr.strip()[-2000:]}\nSet DSV41_TRANSFORMERS_SDIST to a local copy of it instead."
        )
    return archives[0]


def ensure_sdist_tests() -> Path:
    """Extract the four common test files of the sdist into the cache once; returns the folder to put on sys.path."""
    root = sdist_tests_root()
    package = root / PACKAGE
    if all((package / name).is_file() for name in COMMON_TEST_FILES):
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as work:
        work = Path(work)
        archive = _download_sdist(work)
        staged = work / PACKAGE
        staged.mkdir()
        with tarfile.open(archive) as tar:
            for name in COMMON_TEST_FILES:
                member = next((m for m in tar.getmembers() if m.name.endswith(f"/tests/{name}")), None)
                if member is None:
                    raise RuntimeError(f"{archive.name} has no tests/{name}")
                (staged / name).write_bytes(tar.extractfile(member).read())
        (staged / "__init__.py").write_text("")
        root.mkdir(exist_ok=True)
        if not package.exists():  # another process may have finished first
            staged.rename(package)
    return root


def _stand_in(name: str, **attributes) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    module.__path__ = []  # importable as a package, so submodules resolve through sys.modules
    sys.modules[name] = module


def _uncached_url(url: str) -> str:
    """transformers CI maps a Hub URL to its pre-fetched copy, or leaves it as is when it has none: we have none.
    Tests that would load one are skipped in the harness (no network while tests run)."""
    return url


class ExportTesterMixin:
    """Stands in for ``tests/exporters/test_export.py``, which the sdist does not ship: no export tests are run."""


# Common PreTrainedConfig arguments set to non-default values (what ``tests/utils/test_configuration_utils.py``
# provides in the transformers repository; ConfigTester checks each one reaches the config).
CONFIG_COMMON_KWARGS = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["BertModel"],
    "finetuning_task": "translation",
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "tokenizer_class": "BertTokenizerFast",
    "prefix": "prefix",
    "bos_token_id": 6,
    "pad_token_id": 7,
    "eos_token_id": 8,
    "sep_token_id": 9,
    "decoder_start_token_id": 10,
    "task_specific_params": {"translation": "some_params"},
    "problem_type": "regression",
}


def load_common_tests() -> types.SimpleNamespace:
    """Import transformers' common test modules (downloading them on first use)."""
    root = str(ensure_sdist_tests())
    if root not in sys.path:
        sys.path.insert(0, root)
    _stand_in(f"{PACKAGE}.exporters")
    _stand_in(f"{PACKAGE}.exporters.test_export", ExportTesterMixin=ExportTesterMixin)
    _stand_in(f"{PACKAGE}.generation")
    _stand_in(f"{PACKAGE}.generation.test_utils", GenerationTesterMixin=GenerationTesterMixin)
    _stand_in(f"{PACKAGE}.utils")
    _stand_in(f"{PACKAGE}.utils.test_configuration_utils", config_common_kwargs=CONFIG_COMMON_KWARGS)
    _stand_in("fetch_hub_objects_for_ci", url_to_local_path=_uncached_url)
    return types.SimpleNamespace(
        **{
            name.removesuffix(".py"): importlib.import_module(f"{PACKAGE}.{name.removesuffix('.py')}")
            for name in COMMON_TEST_FILES
        }
    )


# ---------------------------------------------------------------------------------------------------------------------
# model testers
# ---------------------------------------------------------------------------------------------------------------------
def tiny_text_config(engram: bool) -> dict:
    """2 layers (transformers' limit for testers): a ratio-2 KV source with its indexer, then a ratio-1 KV source
    that also picks the candidate blocks."""
    config = {
        "vocab_size": 256,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "q_lora_rank": 32,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "o_groups": 2,
        "o_lora_rank": 32,
        "sliding_window": 8,
        "compress_ratios": [2, 1],
        "kv_source_layer_ids": [0, 1],
        "index_source_layer_ids": [0, 1],
        "index_n_heads": 4,
        "index_head_dim": 32,
        "index_topk": 4,
        "candidate_source_layer_id": 1,
        "candidate_topk_blocks": 2,
        "candidate_block_size": 2,
        "hc_mult": 2,
        "hc_sinkhorn_iters": 4,
        "num_nextn_predict_layers": 0,
        "emulate_quantization": False,
        "compress_rope_scaling": {
            "rope_type": "yarn",
            "factor": 4,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 16,
        },
        "engram_layer_ids": [],
        "engram_num_embeddings": [],
    }
    if engram:
        config |= {
            "engram_layer_ids": [0, 1],
            "engram_num_embeddings": [660, 864],
            "engram_max_ngram_size": 4,
            "engram_vocab_size": 100,
            "engram_n_heads": 2,
            "engram_head_dim": 32,
            "engram_pad_token_id": 2,
            "engram_compressed_vocab_size": 128,
        }
    return config


TINY_VISION_CONFIG = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "patch_size": 14,
    "downsample_ratio": 3,
    "max_image_tokens": 64,
    "min_pixels": 20000,
}
# one image: ViT grid 6×6 → LM grid 2×2 → start, 2 rows of (2 tokens + newline), end
IMAGE_GRID = (6, 6)
IMAGE_SPAN_TYPES = [0, 1, 1, 2, 1, 1, 2, 3]


def prompt_inputs(config: DeepseekV41Config, length: int, rows: int = 2) -> dict[str, torch.Tensor]:
    """``rows`` rows of random text of ``length`` tokens; with a vision config, one image per row at position 2
    (the :data:`IMAGE_GRID` image, :data:`IMAGE_SPAN_TYPES` positions). Draws from torch's global generator."""
    input_ids = torch.randint(3, config.text_config.vocab_size - 2, (rows, length))
    if not config.has_vision:
        return {"input_ids": input_ids}
    types = torch.full_like(input_ids, TEXT_TYPE)
    types[:, 2 : 2 + len(IMAGE_SPAN_TYPES)] = torch.tensor(IMAGE_SPAN_TYPES)
    return {
        "input_ids": input_ids.masked_fill(types != TEXT_TYPE, config.image_token_id),
        "image_token_types": types,
        "pixel_values": torch.rand(rows * IMAGE_GRID[0] * IMAGE_GRID[1], 3, 14, 14) * 2 - 1,
        "image_grid_hw": torch.tensor([IMAGE_GRID] * rows),
    }


class DeepseekV41ModelTester:
    """Tiny configs and inputs for the mixins. ``vision``: one image per row; ``engram``: two Engram layers."""

    def __init__(self, parent, vision: bool = False, engram: bool = False, batch_size: int = 2, seq_length: int = 14):
        self.parent, self.vision, self.engram = parent, vision, engram
        self.batch_size, self.seq_length = batch_size, seq_length
        self.is_training = True
        text = tiny_text_config(engram)
        self.text_config = text
        if vision:  # the mixins read `vision_config` when the tester has one
            self.vision_config = TINY_VISION_CONFIG
        self.vocab_size, self.hidden_size = text["vocab_size"], text["hidden_size"]
        self.num_hidden_layers, self.num_attention_heads = text["num_hidden_layers"], text["num_attention_heads"]
        self.pad_token_id = 2
        # an attention map's keys are each query's slots (see DeepseekV41ModelOutputWithPast): the window's, then,
        # on the compressed layer 0, its top-k compressed rows
        self.key_length = min(seq_length, text["sliding_window"]) + text["index_topk"]

    def get_config(self) -> DeepseekV41Config:
        return DeepseekV41Config(
            text_config=dict(self.text_config),
            vision_config=getattr(self, "vision_config", None),
            image_token_id=IMAGE_TOKEN_ID,
        )

    def prepare_config_and_inputs_for_common(self) -> tuple[DeepseekV41Config, dict]:
        config = self.get_config()
        # ids 3.. avoid bos/eos/pad (0, 1, 2); below IMAGE_TOKEN_ID
        input_ids = torch.randint(3, IMAGE_TOKEN_ID, (self.batch_size, self.seq_length))
        attention_mask = torch.ones_like(input_ids)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.vision:
            types = torch.full_like(input_ids, TEXT_TYPE)
            types[:, 3 : 3 + len(IMAGE_SPAN_TYPES)] = torch.tensor(IMAGE_SPAN_TYPES)
            inputs["input_ids"] = input_ids.masked_fill(types != TEXT_TYPE, IMAGE_TOKEN_ID)
            patches = IMAGE_GRID[0] * IMAGE_GRID[1]
            inputs["image_token_types"] = types
            inputs["pixel_values"] = torch.rand(self.batch_size * patches, 3, 14, 14) * 2 - 1
            inputs["image_grid_hw"] = torch.tensor([IMAGE_GRID] * self.batch_size)
        return config, inputs

    def prepare_config_and_inputs(self) -> tuple[DeepseekV41Config, dict]:
        return self.prepare_config_and_inputs_for_common()


# ---------------------------------------------------------------------------------------------------------------------
# generation: our own checks (the sdist does not ship transformers' GenerationTesterMixin)
# ---------------------------------------------------------------------------------------------------------------------
class GenerationTesterMixin:
    """Generation checks of our own, run by every model tester that inherits them (and recognised by
    ``ModelTesterMixin.test_generation_tester_mixin_inheritance`` under transformers' name).

    Each compares ``generate`` with what must equal it: a full forward over the whole sequence (no cache, none of
    generate's code), or another ``generate`` call (sampling with top_k=1 is greedy; a padded row decodes as alone).
    """

    max_new_tokens = 4

    def _generation_model(self):
        """The tester's model with every compressed row and candidate block selected.

        Cached decoding and a full pass are compared exactly here, and the indexer's scores (sums of ReLUs) of a
        tiny random model tie at exactly 0 on many rows; top-k breaks such ties by position in a row dimension that
        differs between a decode step and a full pass, as DeepSeek's reference does (with the tester's index_topk 4,
        3 of 20 random prompts decoded 0.07-0.12 away from the full pass; with full selection 0 of 20).
        tests/test_generation.py checks cached decoding with sparse selection on seeded prompts."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        config.text_config.index_topk = config.text_config.candidate_topk_blocks = 32  # ≥ rows / blocks of any test
        torch.manual_seed(0)
        model = self.all_generative_model_classes[0](config).eval()
        model.generation_config.eos_token_id = None  # every run generates all tokens
        model.generation_config.pad_token_id = self.model_tester.pad_token_id
        return model, inputs

    @staticmethod
    def _first_row(inputs: dict) -> dict:
        """Row 0 of the batch, with its image's patches (one image per row)."""
        row = {k: v[:1] for k, v in inputs.items() if k != "pixel_values"}
        if "pixel_values" in inputs:
            row["pixel_values"] = inputs["pixel_values"].unflatten(0, (len(inputs["input_ids"]), -1))[0]
        return row

    @staticmethod
    def _extend(inputs: dict, sequences: torch.Tensor) -> dict:
        """Inputs of a full forward over ``sequences`` (the prompt plus generated text)."""
        out = dict(inputs, input_ids=sequences)
        grow = sequences.shape[1] - inputs["input_ids"].shape[1]
        out["attention_mask"] = torch.cat(
            [inputs["attention_mask"], inputs["attention_mask"].new_ones(len(sequences), grow)], 1
        )
        if "image_token_types" in inputs:
            types = inputs["image_token_types"]
            out["image_token_types"] = torch.cat([types, types.new_full((len(sequences), grow), TEXT_TYPE)], 1)
        return out

    def _full_pass_logits(self, model, inputs: dict, sequences: torch.Tensor) -> torch.Tensor:
        """Last-position logits of a full forward (no cache) over each prefix ``sequences[:, :prompt + i]``, i = 0 …
        the new tokens [B, new, V]. Over each prefix, not once over the whole sequence: the indexer's top-k picks
        among rows it scores exactly alike (its ReLU scores many 0) by torch.topk's internal order, which depends on
        how many compressed rows exist, as in DeepSeek's reference; a prefix has as many rows as the decode step."""
        prompt = inputs["input_ids"].shape[1]
        with torch.no_grad():
            return torch.stack(
                [
                    model(**self._extend(inputs, sequences[:, : prompt + i]), use_cache=False).logits[:, -1]
                    for i in range(sequences.shape[1] - prompt)
                ],
                dim=1,
            )

    def test_greedy_generate_matches_full_recomputation(self):
        model, inputs = self._generation_model()
        out = model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=self.max_new_tokens,
            return_dict_in_generate=True,
            output_logits=True,
        )
        assert len(out.logits) == self.max_new_tokens
        full = self._full_pass_logits(model, inputs, out.sequences)
        prompt = inputs["input_ids"].shape[1]
        for i, step in enumerate(out.logits):
            # cached decode and the full pass add the same products in another order: fp32 rounding only
            torch.testing.assert_close(step, full[:, i], rtol=1e-4, atol=1e-4)
        # each generated token is the argmax of the full pass over the sequence before it
        torch.testing.assert_close(out.sequences[:, prompt:], full.argmax(-1), rtol=0, atol=0)

    def test_sample_is_reproducible_and_top_k_1_is_greedy(self):
        model, inputs = self._generation_model()
        greedy = model.generate(**inputs, do_sample=False, max_new_tokens=self.max_new_tokens)
        runs = []
        for _ in range(2):
            torch.manual_seed(3)
            runs.append(model.generate(**inputs, do_sample=True, max_new_tokens=self.max_new_tokens, top_k=50))
        torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)
        top1 = model.generate(**inputs, do_sample=True, top_k=1, max_new_tokens=self.max_new_tokens)
        torch.testing.assert_close(top1, greedy, rtol=0, atol=0)

    def test_beam_search_best_beam_scores_its_own_tokens(self):
        model, inputs = self._generation_model()
        out = model.generate(
            **inputs,
            do_sample=False,
            num_beams=2,
            num_return_sequences=2,
            max_new_tokens=self.max_new_tokens,
            return_dict_in_generate=True,
            output_scores=True,
            length_penalty=0.0,
        )
        assert out.sequences.shape == (
            2 * len(inputs["input_ids"]),
            inputs["input_ids"].shape[1] + self.max_new_tokens,
        )
        # with length_penalty 0, a beam's score is the sum of its tokens' log-probabilities: recompute them
        expanded = {
            k: v.repeat_interleave(2, 0) for k, v in inputs.items() if k not in ("pixel_values", "image_grid_hw")
        }
        if "pixel_values" in inputs:
            expanded["pixel_values"] = (
                inputs["pixel_values"]
                .unflatten(0, (len(inputs["input_ids"]), -1))
                .repeat_interleave(2, 0)
                .flatten(0, 1)
            )
            expanded["image_grid_hw"] = inputs["image_grid_hw"].repeat_interleave(2, 0)
        logits = self._full_pass_logits(model, expanded, out.sequences)
        prompt = inputs["input_ids"].shape[1]
        logprobs = logits.log_softmax(-1).gather(-1, out.sequences[:, prompt:, None]).sum((1, 2))
        torch.testing.assert_close(out.sequences_scores, logprobs, rtol=1e-4, atol=1e-4)

    def test_static_cache_generate_matches_the_default_cache(self):
        model, inputs = self._generation_model()
        default = model.generate(**inputs, do_sample=False, max_new_tokens=self.max_new_tokens)
        static = model.generate(
            **inputs, do_sample=False, max_new_tokens=self.max_new_tokens, cache_implementation="static"
        )
        torch.testing.assert_close(static, default, rtol=0, atol=0)

    def test_assisted_decoding_with_itself_as_assistant_is_greedy(self):
        model, inputs = self._generation_model()
        inputs = self._first_row(inputs)  # transformers' assisted decoding takes one row
        greedy = model.generate(**inputs, do_sample=False, max_new_tokens=self.max_new_tokens)
        assisted = model.generate(**inputs, do_sample=False, max_new_tokens=self.max_new_tokens, assistant_model=model)
        torch.testing.assert_close(assisted, greedy, rtol=0, atol=0)

    def test_decode_step_compiles_without_graph_break(self):
        model, inputs = self._generation_model()
        max_cache_len = inputs["input_ids"].shape[1] + 8
        eager_cache, compiled_cache = (DeepseekV41StaticCache(model.config, max_cache_len) for _ in range(2))
        with torch.no_grad():
            token = model(**inputs, cache=eager_cache).logits[:, -1:].argmax(-1)
            model(**inputs, cache=compiled_cache)
            eager = model(input_ids=token, cache=eager_cache).logits
            # fullgraph: any graph break raises; the eager backend traces without generating kernels (fast on CPU)
            step = torch.compile(model.forward, fullgraph=True, backend="eager")
            compiled = step(input_ids=token, cache=compiled_cache).logits
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)

    def test_left_padded_generate_matches_each_row_alone(self):
        model, inputs = self._generation_model()
        pad = 3
        padded = dict(inputs)
        padded["input_ids"] = inputs["input_ids"].clone()
        padded["input_ids"][1, -pad:] = self.model_tester.pad_token_id  # row 1 is `pad` tokens shorter ...
        padded["input_ids"][1] = padded["input_ids"][1].roll(pad)  # ... and padded on the left
        padded["attention_mask"] = torch.ones_like(inputs["attention_mask"])
        padded["attention_mask"][1, :pad] = 0
        if "image_token_types" in inputs:
            padded["image_token_types"] = inputs["image_token_types"].clone()
            padded["image_token_types"][1] = padded["image_token_types"][1].roll(pad)
            padded["image_token_types"][1, :pad] = TEXT_TYPE
        out = model.generate(**padded, do_sample=False, max_new_tokens=self.max_new_tokens)
        for row in range(2):
            alone = {
                k: v[row : row + 1, pad * row :]
                for k, v in padded.items()
                if k not in ("pixel_values", "image_grid_hw")
            }
            if "pixel_values" in inputs:
                alone["pixel_values"] = inputs["pixel_values"].unflatten(0, (2, -1))[row]
                alone["image_grid_hw"] = inputs["image_grid_hw"][row : row + 1]
            expected = model.generate(**alone, do_sample=False, max_new_tokens=self.max_new_tokens)
            torch.testing.assert_close(out[row, pad * row :], expected[0], rtol=0, atol=0)


__all__ = ["DeepseekV41ModelTester", "GenerationTesterMixin", "load_common_tests"]
