"""``generate`` for DeepSeek-V4.1, mixed into :class:`~modeling_dsv41.modeling_dsv41.DeepseekV41ForCausalLM`: the
modes it supports, its own decode caches (:mod:`.cache`), DSpark speculative decoding for ``use_mtp=True``
(:mod:`.speculative`), the length limit of the rotary tables, and each step's inputs (image token types, the images of
repeated rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GenerationMixin
from transformers.generation import GenerationMode

from processing.image_tokens import ImageTokenType

from ..validation import check_generation_length
from .cache import DeepseekV41Cache, DeepseekV41StaticCache
from .speculative import dspark_decoding


class DeepseekV41GenerationMixin(GenerationMixin):
    """transformers' ``GenerationMixin`` with DeepSeek-V4.1's caches and DSpark drafting. Greedy, sampling and beam
    search (:class:`DeepseekV41Cache` reorders its rows), and assisted generation (the cache records its past and
    rolls back over rejected tokens: :meth:`DeepseekV41Cache.crop`); contrastive and the other modes that are not
    transformers' core ones are rejected."""

    _supported_generation_modes = (
        GenerationMode.GREEDY_SEARCH,
        GenerationMode.SAMPLE,
        GenerationMode.BEAM_SEARCH,
        GenerationMode.BEAM_SAMPLE,
        GenerationMode.ASSISTED_GENERATION,
    )

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs) -> None:
        if generation_mode not in self._supported_generation_modes:
            raise ValueError(
                f"{type(self).__name__} supports greedy search, sampling, beam search and assisted generation, not "
                f"{generation_mode.value}"
            )
        if generation_config.use_mtp:  # transformers would only warn and decode without the draft head
            if generation_mode != GenerationMode.ASSISTED_GENERATION:
                raise ValueError(
                    "DSpark speculative decoding (use_mtp=True) works with greedy search and sampling, not "
                    f"{generation_mode.value} (num_beams={generation_config.num_beams})"
                )
            if generation_mode_kwargs.get("assistant_model") is not None:
                raise ValueError("use_mtp=True drafts with the model's own DSpark head: pass no assistant_model")
        super()._validate_generation_mode(generation_mode, generation_config, generation_mode_kwargs)

    def _prepare_generation_config(self, generation_config, **kwargs):
        """``dspark_confidence_threshold`` may be passed to ``generate`` like a generation-config field."""
        threshold = kwargs.pop("dspark_confidence_threshold", None)
        generation_config, model_kwargs = super()._prepare_generation_config(generation_config, **kwargs)
        if threshold is not None:
            generation_config.dspark_confidence_threshold = threshold
        return generation_config, model_kwargs

    def _assisted_decoding(
        self,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus=False,
        streamer=None,
        **model_kwargs,
    ):
        """``use_mtp=True``: DSpark speculative decoding, any batch size
        (:func:`.generation.speculative.dspark_decoding`)."""
        if generation_config.use_mtp:
            model_kwargs = {
                k: v
                for k, v in model_kwargs.items()
                if k not in ("inputs_tensor", "assistant_model", "assistant_tokenizer", "tokenizer")
            }
            return dspark_decoding(
                self,
                input_ids,
                logits_processor,
                stopping_criteria,
                generation_config,
                synced_gpus,
                streamer,
                **model_kwargs,
            )
        return super()._assisted_decoding(
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            synced_gpus=synced_gpus,
            streamer=streamer,
            **model_kwargs,
        )

    def _validate_generated_length(self, generation_config, input_ids_length, has_default_max_length) -> None:
        super()._validate_generated_length(generation_config, input_ids_length, has_default_max_length)
        check_generation_length(
            generation_config.max_length, input_ids_length, self.config.get_text_config().max_position_embeddings
        )

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the decode state is not per-token keys/values: see DeepseekV41Cache

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs: dict, generation_mode, batch_size: int, max_cache_length: int
    ) -> None:
        """``generate`` decodes with a :class:`DeepseekV41Cache` (the caller's, or a new one), or with a
        :class:`DeepseekV41StaticCache` for ``cache_implementation="static"`` (sized as transformers sizes its
        ``StaticCache``: this call's maximum length, or ``max_cache_len`` if larger; with ``use_mtp``, a
        verification block more)."""
        cache = model_kwargs.get("cache")
        if cache is not None and not isinstance(cache, DeepseekV41Cache):
            raise ValueError(f"DeepSeek-V4.1 generates with a DeepseekV41Cache, got {type(cache).__name__}")
        implementation = generation_config.cache_implementation
        if cache is None and implementation not in (None, "dynamic", "static"):
            raise ValueError(
                f"cache_implementation={implementation!r} is not supported: DeepSeek-V4.1 decodes with its own "
                "DeepseekV41Cache (cache_implementation unset or 'dynamic') or DeepseekV41StaticCache ('static')"
            )
        if cache is not None or not generation_config.use_cache:
            super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
        else:
            if implementation == "static":
                if generation_config.use_mtp:  # a row one token short of max_length verifies a whole block
                    max_cache_length += self.config.get_text_config().dspark_block_size + 1
                max_cache_length = max(max_cache_length, generation_config.max_cache_len or 0)
                model_kwargs["cache"] = DeepseekV41StaticCache(self.config, max_cache_len=max_cache_length)
            else:
                model_kwargs["cache"] = DeepseekV41Cache(self.config)
            if generation_config.is_assistant:  # a draft model's cache is cropped to the accepted tokens
                model_kwargs["cache"].activate_past_recording()

    def create_masks_for_generate(
        self, attention_mask: torch.Tensor | None = None, is_first_iteration: bool = False, **kwargs
    ) -> torch.Tensor | None:
        """What ``generate`` passes as the mask with a compileable (static) cache: the 2-D mask of the prefill, and
        nothing on decode steps, whose tokens are all real (a mask growing by a column a step would be a new shape
        to compile each time)."""
        return attention_mask if is_first_iteration else None

    def prepare_inputs_for_generation(
        self, input_ids: torch.LongTensor, image_token_types: torch.LongTensor | None = None, **kwargs
    ) -> dict:
        """The standard preparation, plus: generated tokens are text, so ``image_token_types`` is extended with
        text types and sliced like ``input_ids`` (decode steps need none); Engram still gets the ids when
        generation starts from ``inputs_embeds``; and a prefill (an empty cache) always gets the images, also an
        assistant model's, which transformers treats as a later iteration."""
        cache = kwargs.get("cache")
        if cache is None or cache.get_seq_length() == 0:
            kwargs["is_first_iteration"] = True
        model_inputs = super().prepare_inputs_for_generation(input_ids, **kwargs)
        new = model_inputs["input_ids"] if model_inputs.get("input_ids") is not None else model_inputs["inputs_embeds"]
        length = new.shape[1]
        if model_inputs.get("input_ids") is None and input_ids.shape[1] >= length:
            model_inputs["input_ids"] = input_ids[:, -length:]
        if image_token_types is not None and (kwargs.get("is_first_iteration") or not kwargs.get("use_cache", True)):
            total = max(input_ids.shape[1], image_token_types.shape[1])
            types = F.pad(image_token_types, (0, total - image_token_types.shape[1]), value=ImageTokenType.TEXT.value)
            model_inputs["image_token_types"] = types[:, -length:]
        return model_inputs

    def _expand_inputs_for_generation(
        self,
        expand_size: int = 1,
        is_encoder_decoder: bool = False,
        input_ids: torch.LongTensor | None = None,
        **model_kwargs,
    ) -> tuple[torch.LongTensor, dict]:
        """Beams and extra return sequences repeat each batch row; images are listed per image, not per row, so
        each is repeated along with the row that shows it."""
        images = {key: model_kwargs.pop(key, None) for key in ("pixel_values", "image_grid_hw")}
        if expand_size > 1 and images["pixel_values"] is not None:
            images = _repeat_images(
                **images, image_token_types=model_kwargs.get("image_token_types"), repeats=expand_size
            )
        input_ids, model_kwargs = super()._expand_inputs_for_generation(
            expand_size, is_encoder_decoder, input_ids, **model_kwargs
        )
        model_kwargs.update({key: value for key, value in images.items() if value is not None})
        return input_ids, model_kwargs


def _repeat_images(
    pixel_values: torch.Tensor,
    image_grid_hw: torch.Tensor | None,
    image_token_types: torch.Tensor | None,
    repeats: int,
) -> dict[str, torch.Tensor]:
    """pixel_values / image_grid_hw with every row's images repeated ``repeats`` times, rows kept in order."""
    if image_grid_hw is None or image_token_types is None:
        raise ValueError("pixel_values need image_grid_hw and image_token_types (as the processor returns them)")
    patches = pixel_values.split(image_grid_hw.prod(dim=-1).tolist())
    order, first = [], 0
    for count in (image_token_types == ImageTokenType.START.value).sum(dim=1).tolist():
        order += list(range(first, first + count)) * repeats
        first += count
    return {"pixel_values": torch.cat([patches[i] for i in order]), "image_grid_hw": image_grid_hw[order]}


__all__ = ["DeepseekV41GenerationMixin"]
