"""transformers' own common tests (``ModelTesterMixin``, ``ConfigTester``, ``ImageProcessingTestMixin``,
``ProcessorTesterMixin``) run against DeepSeek-V4.1: a text-only, an image+text and an Engram model tester.

The mixins come from the transformers sdist of the installed version, downloaded from the package index on first
use and cached outside the repository (see ``dsv41_testers.py``). Generation is checked by our own
``GenerationTesterMixin`` (the sdist does not ship transformers'), inherited by every model tester.

Every skip states its reason: what in the architecture rules the test out, or a Hub file the test would download
(no network while tests run). Every ``xfail`` is strict and names the missing fix, so that it flips to a failure
(and the marker goes) when the fix lands.
"""

from __future__ import annotations

import contextlib
import unittest
from unittest.mock import patch

import numpy as np
import pytest
from transformers.models.auto import modeling_auto

import modeling_dsv41  # noqa: F401  (registers the Auto classes)
import processing  # noqa: F401  (registers the processors)
from configuration import DeepseekV41Config
from dsv41_testers import IMAGE_TOKEN_ID, DeepseekV41ModelTester, GenerationTesterMixin, load_common_tests
from modeling_dsv41 import DeepseekV41ForCausalLM, DeepseekV41Model

hf = load_common_tests()
ModelTesterMixin = hf.test_modeling_common.ModelTesterMixin
ConfigTester = hf.test_configuration_common.ConfigTester


def _not_applicable(reason: str):
    """A skip whose reason is the architectural fact that rules the test out."""
    return unittest.skip(reason)


def _expected_failure(mixin: type, name: str, reason: str):
    """Run ``mixin.name`` expecting it to fail (strict: an unexpected pass fails, so the marker gets removed)."""
    test = getattr(mixin, name)

    @pytest.mark.xfail(strict=True, reason=reason)
    def run(self, *args, **kwargs):
        # a failing subTest is reported on its own, past xfail: run subtests as plain blocks so the failure raises
        with patch.object(self, "subTest", lambda *_, **__: contextlib.nullcontext()):
            return test(self, *args, **kwargs)

    run.__name__ = name
    return run


def _apply(cls: type, mixin: type, skips: dict[str, str], xfails: dict[str, str]) -> type:
    for name, reason in skips.items():
        setattr(cls, name, _not_applicable(reason)(getattr(mixin, name)))
    for name, reason in xfails.items():
        setattr(cls, name, _expected_failure(mixin, name, reason))
    return cls


# ---------------------------------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------------------------------
MODEL_SKIPS: dict[str, str] = {}
MODEL_XFAILS: dict[str, str] = {}
# One class serves text-only and image+text configs (as the released checkpoint has both), so
# `get_image_features` exists on the text-only testers' models too, but their configs have no vision part and
# their inputs no images to encode; the image+text tester runs these tests.
NO_VISION_CONFIG = "a text-only config has no vision part: no images to encode (the image+text tester runs this)"
TEXT_ONLY_MODEL_SKIPS = MODEL_SKIPS | {
    name: NO_VISION_CONFIG
    for name in (
        "test_get_image_features_attentions",
        "test_get_image_features_hidden_states",
        "test_get_image_features_output_0",
        "test_get_image_features_output_1",
        "test_get_image_features_output_2",
        "test_get_image_features_pooler_output",
    )
}
ENGRAM_MODEL_SKIPS = TEXT_ONLY_MODEL_SKIPS | {
    # Engram hashes the token ids of every position (DeepSeek-V4.1's n-gram memory): embeddings alone cannot drive
    # it, so input_ids are required alongside inputs_embeds (a clear ValueError says so)
    "test_inputs_embeds": "Engram hashes token ids: inputs_embeds cannot replace input_ids",
    "test_inputs_embeds_matches_input_ids": "Engram hashes token ids: inputs_embeds cannot replace input_ids",
    # a checkpoint without engram_hasher.token_map is what released weights look like; their tables are indexed
    # by the tokenizer's compressed map, so from_pretrained refuses to guess one (released.loading)
    "test_model_weights_reload_no_missing_tied_weights": (
        "an Engram checkpoint with no token map needs the tokenizer's map: from_pretrained refuses to guess"
    ),
}


class _DeepseekV41ModelTest(ModelTesterMixin, GenerationTesterMixin):
    all_model_classes = (DeepseekV41Model, DeepseekV41ForCausalLM)
    all_generative_model_classes = (DeepseekV41ForCausalLM,)
    pipeline_model_mapping = {}
    tester_kwargs: dict = {}
    # The indexer only picks (top-k) which compressed rows attention reads: its projections get no gradient from
    # the LM loss (DeepSeek trains them with a separate loss). test_all_but_the_indexer_get_gradients checks the rest.
    test_all_params_have_gradient = False

    def setUp(self):
        self.model_tester = DeepseekV41ModelTester(self, **self.tester_kwargs)
        # sub-configs are checked by the model tests; ConfigTester compares each kwarg with its JSON value as is
        self.config_tester = ConfigTester(
            self, config_class=DeepseekV41Config, has_text_modality=False, image_token_id=IMAGE_TOKEN_ID
        )
        # The mixins find a model's task by class name in transformers' own auto mappings (labels for causal LMs,
        # no loss expected from base models); in-tree models are listed there, ours is registered at runtime.
        for mapping, name in (
            (modeling_auto.MODEL_MAPPING_NAMES, "DeepseekV41Model"),
            (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "DeepseekV41ForCausalLM"),
            (modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, "DeepseekV41ForCausalLM"),
        ):
            patcher = patch.dict(mapping, {DeepseekV41Config.model_type: name})
            patcher.start()
            self.addCleanup(patcher.stop)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_all_but_the_indexer_get_gradients(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        model = DeepseekV41ForCausalLM(config).train()
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
        no_grad = {name for name, param in model.named_parameters() if param.requires_grad and param.grad is None}
        indexer = {name for name, _ in model.named_parameters() if ".attn.indexer." in name}
        self.assertTrue(indexer, "the tester's config must have indexers")
        self.assertEqual(no_grad, indexer)

    def test_reverse_loading_mapping(self):
        # The released names hold the backbone at the root beside `head` (`^head\.` -> `lm_head.`, the backbone's
        # roots -> `model.`): a mapping of the model with its head, which a base model's save never meets, the case
        # the mixin's `skip_base_model` is for (as llava's).
        super().test_reverse_loading_mapping(skip_base_model=True)

    def test_eager_only_model_is_not_reported_switchable(self):
        # transformers guesses from the modeling file's source, where no `class *Attention*(nn.Module)` lives (it is
        # in attention.py): the model says so itself. The mixin's flex/sdpa switching tests need an accelerator.
        for model_class in self.all_model_classes:
            self.assertFalse(model_class._can_set_attn_implementation())


class DeepseekV41TextModelTest(_DeepseekV41ModelTest, unittest.TestCase):
    tester_kwargs = {}


class DeepseekV41VisionModelTest(_DeepseekV41ModelTest, unittest.TestCase):
    tester_kwargs = {"vision": True}


class DeepseekV41EngramModelTest(_DeepseekV41ModelTest, unittest.TestCase):
    tester_kwargs = {"engram": True}


_apply(DeepseekV41TextModelTest, ModelTesterMixin, TEXT_ONLY_MODEL_SKIPS, MODEL_XFAILS)
_apply(DeepseekV41VisionModelTest, ModelTesterMixin, MODEL_SKIPS, MODEL_XFAILS)
_apply(DeepseekV41EngramModelTest, ModelTesterMixin, ENGRAM_MODEL_SKIPS, MODEL_XFAILS)


# ---------------------------------------------------------------------------------------------------------------------
# image processors
# ---------------------------------------------------------------------------------------------------------------------
ImageProcessingTester = hf.test_image_processing_common.ImageProcessingTester
ImageProcessingTestMixin = hf.test_image_processing_common.ImageProcessingTestMixin


class DeepseekV41ImageProcessingTester(ImageProcessingTester):
    """Small images and the tiny vision settings; both backends."""

    def __init__(self, parent):
        super().__init__(
            parent,
            batch_size=3,
            min_resolution=20,
            max_resolution=80,
            patch_size=14,
            downsample_ratio=3,
            max_image_tokens=64,
            min_pixels=2000,
        )

    def _get_image_processing_classes(self) -> dict:
        # transformers finds in-tree processors by the test file's folder name; ours are registered at runtime
        return {"torchvision": processing.DeepseekV41ImageProcessor, "pil": processing.DeepseekV41ImageProcessorPil}


def _height_width(image) -> tuple[int, int]:
    """Of the mixin's inputs: PIL images, HWC numpy arrays, CHW tensors."""
    if hasattr(image, "height"):
        return image.height, image.width
    return tuple(image.shape[:2]) if isinstance(image, np.ndarray) else tuple(image.shape[-2:])


class DeepseekV41ImageProcessingTest(ImageProcessingTestMixin, unittest.TestCase):
    image_processor_tester_class = DeepseekV41ImageProcessingTester

    # pixel_values concatenate the patches of all images ([total_patches, 3, p, p], what the ViT takes: images of
    # one batch have different patch grids), so the mixin's [batch, C, H, W] check cannot hold; the same calls
    # are checked against this layout instead.
    def _check_call(self, **prepare_kwargs) -> None:
        for image_processing_class in self.image_processing_classes.values():
            processor = image_processing_class(**self.image_processor_dict)
            images = self.image_processor_tester.prepare_image_inputs(equal_resolution=False, **prepare_kwargs)
            for batch in ([images[0]], images):
                out = processor(batch, return_tensors="pt")
                grids = out.image_grid_hw
                self.assertEqual(tuple(grids.shape), (len(batch), 2))
                patch = processor.patch_size
                self.assertEqual(tuple(out.pixel_values.shape), (int(grids.prod(-1).sum()), 3, patch, patch))
                for image, grid in zip(batch, grids.tolist()):
                    self.assertEqual(tuple(grid), processor.plan(*_height_width(image)).patch_grid)

    def test_call_pil(self):
        self._check_call()

    def test_call_numpy(self):
        self._check_call(numpify=True)

    def test_call_pytorch(self):
        self._check_call(torchify=True)


HUB_IMAGE = "loads an image from the Hub (no network while tests run)"
IMAGE_PROCESSING_SKIPS: dict[str, str] = {
    # test_backends_equivalence_batched checks the same equivalence on local random images
    "test_backends_equivalence": HUB_IMAGE,
    # 4-channel arrays kept as 4 channels (do_convert_rgb=False, 4-value mean/std): DeepSeek-ViT embeds RGB patches
    # and the reference processor, which ours reproduces bit for bit, converts every input to RGB
    "test_call_numpy_4_channels": "DeepSeek-ViT takes RGB: every image is converted to RGB, as the reference does",
}
IMAGE_PROCESSING_XFAILS: dict[str, str] = {}
_apply(DeepseekV41ImageProcessingTest, ImageProcessingTestMixin, IMAGE_PROCESSING_SKIPS, IMAGE_PROCESSING_XFAILS)


# ---------------------------------------------------------------------------------------------------------------------
# processor
# ---------------------------------------------------------------------------------------------------------------------
ProcessorTesterMixin = hf.test_processing_common.ProcessorTesterMixin


class DeepseekV41ProcessorTest(ProcessorTesterMixin, unittest.TestCase):
    processor_class = processing.DeepseekV41Processor

    @classmethod
    def _setup_tokenizer(cls):
        return processing.build_tiny_tokenizer()

    @classmethod
    def _setup_image_processor(cls):
        return processing.DeepseekV41ImageProcessor(max_image_tokens=64, min_pixels=2000)


PROCESSOR_SKIPS: dict[str, str] = {
    "test_apply_chat_template_image_0": HUB_IMAGE,
    "test_apply_chat_template_image_1": HUB_IMAGE,
    "test_processor_text_has_no_visual": HUB_IMAGE,
}
PROCESSOR_XFAILS: dict[str, str] = {}
_apply(DeepseekV41ProcessorTest, ProcessorTesterMixin, PROCESSOR_SKIPS, PROCESSOR_XFAILS)
