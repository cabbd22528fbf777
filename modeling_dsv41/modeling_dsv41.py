"""DeepSeek-V4.1 for transformers: embed → (merge images) → [Engram] → blocks on ``hc_mult`` residual copies →
collapse → ``norm`` → fp32 ``lm_head``.

:class:`DeepseekV41ForCausalLM` holds the backbone as ``model`` (a :class:`DeepseekV41Model`) and ``lm_head``, as
every transformers causal LM does. Inside the backbone, module names are the released checkpoint's (``embed``,
``layers.{i}.attn.wq_a``, ``layers.{i}.hc_attn_fn``, ``layers.{i}.engram.wkv``, ``vision.*``, ``aligner.*``); the
routed experts are fused (``layers.{i}.ffn.experts.gate_up_proj`` / ``down_proj``). The released names (no
``model.`` prefix, ``head``, per-expert ``w1``/``w2``/``w3``) are mapped on load and, on request, on save by the
conversions of :mod:`.released.conversions` (registered below for ``deepseek_v41``).
"""

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.utils import can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from configuration.configuration_dsv41 import DeepseekV41Config

from .attention import DeepseekV41Attention, DeepseekV41Indexer
from .decoder_layer import DeepseekV41DecoderLayer, DeepseekV41DecoderLayerOutput, DeepseekV41LayerInputs
from .dspark import DeepseekV41DSpark, DeepseekV41DSparkLossOutput
from .generation.cache import DeepseekV41Cache, DeepseekV41StaticCache
from .generation.generate import DeepseekV41GenerationMixin
from .engram import DeepseekV41Engram, DeepseekV41NgramHasher
from .hyper_connections import DeepseekV41HyperConnectedBlock, DeepseekV41HyperConnection
from .layer_cache import CacheStep
from .linear import DeepseekV41Fp32Linear, DeepseekV41GroupedLinear
from .moe import DeepseekV41Experts, DeepseekV41Gate
from .norms import DeepseekV41RMSNorm
from .numerics import under_configured_numerics
from .outputs import CollectedOutputs, DeepseekV41CausalLMOutputWithPast, DeepseekV41ModelOutputWithPast
from .padding import align_rows, in_caller_layout, new_tokens_per_row, prefill_alignment
from .pipeline import (
    DeepseekV41PipelineStage,
    check_pipeline_call,
    hand_on_to_next_stage,
    logits_on_every_stage,
    stage_layers,
    stream_from_previous_stage,
)
from .placement import gather_engram_rows
from .released.conversions import NOT_LOADED, register_layout_conversions
from .released.pretrained_io import ReleasedCheckpointMixin
from .residual_stream import ResidualStream
from .rotary import DeepseekV41RotaryEmbedding
from .validation import check_image_inputs, check_pixel_values, check_text_inputs
from .vision import (
    DeepseekV41Aligner,
    DeepseekV41VisionTransformer,
    encode_images,
    image_positions,
    image_token_grids,
    merge_image_embeddings,
)

# the released checkpoint's names and layout, mapped onto ours on load (and back by save_pretrained)
register_layout_conversions(DeepseekV41Config.model_type)


class DeepseekV41PreTrainedModel(ReleasedCheckpointMixin, PreTrainedModel):
    """The weights' names, dtypes and initialization; loading, saving and distribution (and the per-instance dtype and
    key lists, in ``post_init``) come from :class:`~.released.pretrained_io.ReleasedCheckpointMixin`."""

    config_class = DeepseekV41Config
    config: DeepseekV41Config
    base_model_prefix = "model"
    main_input_name = "input_ids"
    input_modalities = ("image", "text")
    supports_gradient_checkpointing = True
    _no_split_modules = ["DeepseekV41DecoderLayer", "DeepseekV41VisionBlock", "DeepseekV41DSparkBlock"]
    # The Engram tables are not bound to their layer's device: our planned device maps may leave them off the map, in
    # host memory (placement.py), and accelerate's dispatch then must not require them on it. When transformers plans
    # the map itself (device_map="auto" with a quantization_config), a table that fits no fresh accelerator stays off.
    _no_placement_params = ["engram.embed.weight", "engram.embed.scale"]
    # fp32 in the reference whatever the model dtype: mHC, sinks, router biases (and, per instance, what only some
    # configs have: see post_init). Plain module names, matched as transformers does (`(?:^|\.)name(?:\.|$)`).
    _keep_in_fp32_modules_strict = [
        "hc_attn_fn",
        "hc_ffn_fn",
        "hc_attn_base",
        "hc_ffn_base",
        "hc_attn_scale",
        "hc_ffn_scale",
        "attn_sink",
        "gate.bias",
    ]
    # the released checkpoint carries an unused image_pad vector, and the DSpark draft head (mtp.*), which a model
    # without the head (or the bare backbone) ignores: see post_init. A reference state dict also lists the shared
    # embed / head under every draft block (aliases, never stored by the release).
    _keys_to_ignore_on_load_unexpected = list(NOT_LOADED)
    # ... but no Engram token map: from_pretrained builds it from the tokenizer
    _keys_to_ignore_on_load_missing = [r"(^|\.)engram_hasher\.token_map$"]
    _supports_sdpa = False
    _supports_flash_attn = False
    # transformers' output capture (`output_router_logits=True`): each router's logits, the first thing it returns
    _can_record_outputs = {"router_logits": OutputRecorder(DeepseekV41Gate, index=0)}

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return False  # CSA2 sink attention over per-query slots is eager only (attention.py); no SDPA/flash kernel

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.get_text_config().initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding, DeepseekV41GroupedLinear)):
            if module.weight.dtype.is_floating_point and module.weight.element_size() > 1:
                init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, DeepseekV41RMSNorm) or type(module).__name__ == "DeepseekV41VisionRMSNorm":
            init.ones_(module.weight)
        elif isinstance(module, DeepseekV41HyperConnectedBlock):
            for fn, scale, base in module.hc_parameters():
                init.normal_(fn, mean=0.0, std=std)
                init.zeros_(base)
                init.ones_(scale)
        elif isinstance(module, DeepseekV41Attention):
            init.zeros_(module.attn_sink)
        elif isinstance(module, DeepseekV41Experts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, DeepseekV41Gate):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.bias)
            if module.bias_vl is not None:
                init.zeros_(module.bias_vl)
        elif isinstance(module, DeepseekV41Engram):
            init.ones_(module.q_weight)
            init.ones_(module.k_weight)
        elif isinstance(module, DeepseekV41NgramHasher):
            module.init_buffers()  # hash constants derive from the config; a loaded token map is kept
        elif isinstance(module, DeepseekV41Model) and module.config.has_vision:
            for name in ("image_start", "image_newline", "image_end"):
                init.normal_(getattr(module, name), mean=0.0, std=std)


class DeepseekV41Model(DeepseekV41PreTrainedModel):
    """The DeepSeek-V4.1 backbone (and, with a vision config, DeepSeek-ViT and the aligner).

    ``forward`` returns ``last_hidden_state`` = ``norm`` of the collapsed stream [B, S, D]; with
    ``output_hidden_states`` the per-layer residual streams [B, S, hc_mult, D] (embedding copies first).
    """

    # Pipeline plan: what crosses a stage boundary. Between layers that is the whole residual stream (its copies, the
    # mix the next layer collapses them with, the compressed context), not one [B, S, D] tensor: `.pipeline` sends it
    # rather than transformers' naive `inputs_embeds`. Engram layers hash the input ids, which every stage keeps. The
    # last stage collapses the copies before `norm`.
    _pp_plan = {
        "embed": (["input_ids"], ["inputs_embeds"]),
        "layers": (list(ResidualStream.TENSORS), list(ResidualStream.TENSORS)),
        "norm": (["hidden_states", "pre_mix"], ["hidden_states"]),
    }
    _pp_stage: DeepseekV41PipelineStage | None = None  # this rank's stage under pipeline parallelism (.pipeline)

    def __init__(self, config: DeepseekV41Config):
        super().__init__(config)
        text = config.text_config
        self.text_config = text
        self.embed = nn.Embedding(text.vocab_size, text.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV41DecoderLayer(text, i, use_vision_bias=config.has_vision) for i in range(text.num_hidden_layers)
        )
        self.norm = DeepseekV41RMSNorm(text.hidden_size, text.rms_norm_eps)
        self.window_rotary = DeepseekV41RotaryEmbedding(text.qk_rope_head_dim, text.rope_theta)
        self.compress_rotary = DeepseekV41RotaryEmbedding(
            text.qk_rope_head_dim, text.compress_rope_theta, text.compress_rope_scaling
        )
        self.engram_hasher = DeepseekV41NgramHasher(text) if any(spec.has_engram for spec in text.layer_plan) else None
        if config.has_vision:
            self.vision = DeepseekV41VisionTransformer(config.vision_config)
            self.aligner = DeepseekV41Aligner(config.vision_config, text.hidden_size)
            self.image_start = nn.Parameter(torch.empty(text.hidden_size))
            self.image_newline = nn.Parameter(torch.empty(text.hidden_size))
            self.image_end = nn.Parameter(torch.empty(text.hidden_size))
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed = value

    # ---- inputs ---------------------------------------------------------------------------------------
    @can_return_tuple
    @under_configured_numerics
    def get_image_features(
        self,
        pixel_values: torch.Tensor,
        image_grid_hw: torch.Tensor,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPooling:
        """DeepSeek-ViT, then the aligner.

        Returns ``last_hidden_state``: the ViT output of every patch [total_patches, vision hidden_size], images
        concatenated as in ``pixel_values``; ``pooler_output``: per image, its LM tokens [h_tok·w_tok, D] in reading
        order (what the model writes into the image span); ``hidden_states``: ``num_hidden_layers + 1`` tensors
        [total_patches, vision hidden_size] (patch embeddings, then each block's output); ``attentions``: per ViT
        block, one map [heads, h·w, h·w] per image (attention never crosses images).
        """
        if not self.config.has_vision:
            raise ValueError("images were passed but this DeepSeek-V4.1 config has no vision_config")
        check_pixel_values(pixel_values, image_grid_hw)
        vision = self.config.vision_config
        output_hidden_states = _flag(output_hidden_states, vision, "output_hidden_states")
        output_attentions = _flag(output_attentions, vision, "output_attentions")
        return encode_images(
            self.vision, self.aligner, pixel_values, image_grid_hw, output_hidden_states, output_attentions
        )

    def _input_stream(
        self,
        input_ids: torch.LongTensor | None,
        inputs_embeds: torch.Tensor | None,
        pixel_values: torch.Tensor | None,
        image_grid_hw: torch.LongTensor | None,
        image_token_types: torch.LongTensor | None,
        output_hidden_states: bool,
        output_attentions: bool,
    ) -> tuple[ResidualStream, torch.Tensor | None, BaseModelOutputWithPooling | None]:
        """The stream entering this stage's first layer: ``hc_mult`` copies of the LM input [B, S, D] (images merged
        into their spans), or what the previous pipeline stage handed on; with the LM input and what the image
        encoder returned (None where not computed here)."""
        stream = stream_from_previous_stage(self._pp_stage, self._stage_layers()[0].hc_attn_fn.device)
        if stream is not None:
            return stream, None, None
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("pass input_ids or inputs_embeds")
            inputs_embeds = self.embed(input_ids)
        image_outputs = None
        if pixel_values is not None:
            if not self.config.has_vision:
                raise ValueError("images were passed but this DeepSeek-V4.1 config has no vision_config")
            if image_grid_hw is None or image_token_types is None:
                raise ValueError(
                    "pixel_values need image_grid_hw and image_token_types (as the processor returns them)"
                )
            grids = image_token_grids(image_grid_hw, self.config.vision_config)
            image_outputs = self.get_image_features(
                pixel_values,
                image_grid_hw,
                output_hidden_states=output_hidden_states,
                output_attentions=output_attentions,
                return_dict=True,
            )
            inputs_embeds = merge_image_embeddings(
                inputs_embeds,
                image_token_types,
                image_outputs.pooler_output,
                self.image_start,
                self.image_newline,
                self.image_end,
                grids,
            )
        return ResidualStream.from_embeddings(inputs_embeds, self.text_config.hc_mult), inputs_embeds, image_outputs

    def _stage_layers(self) -> list[DeepseekV41DecoderLayer]:
        """The decoder layers this model runs: all of them, or its pipeline stage's."""
        return stage_layers(self.layers, self._pp_stage)

    def gather_engram_rows(self, hash_ids: torch.Tensor | None) -> dict[int, torch.Tensor]:
        """The rows every Engram layer this model runs reads, gathered before the first layer runs: layer id →
        ``[B, S, n_cols·d]`` (see :func:`~.placement.gather_engram_rows`)."""
        return gather_engram_rows(self._stage_layers(), hash_ids)

    # ---- forward --------------------------------------------------------------------------------------
    @capture_outputs
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @under_configured_numerics
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_hw: torch.LongTensor | None = None,
        image_token_types: torch.LongTensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        cache: DeepseekV41Cache | None = None,
        use_cache: bool | None = None,
        output_dspark_hidden_states: bool = False,
        **kwargs,
    ) -> DeepseekV41ModelOutputWithPast:
        """Full-sequence forward from position 0, or the next tokens of a cached sequence (docs/design.md §3).

        Args:
            input_ids: [B, S]; the Engram n-gram hashes read them even when ``inputs_embeds`` feeds the stream.
            image_token_types: [B, S] as the processor returns them, with or without ``pixel_values``.
            cache: a :class:`DeepseekV41Cache` (formerly ``past_key_values``): the prefill while empty, then only
                the new tokens, all real. ``use_cache`` defaults to ``config.use_cache`` in eval mode.
            output_dspark_hidden_states: see :class:`DeepseekV41ModelOutputWithPast`.
        """
        # the inputs: checked, and a prefill's left-padded rows aligned to start at position 0
        dspark_targets = self._dspark_targets(output_dspark_hidden_states)
        output_hidden_states = _flag(output_hidden_states, self.config, "output_hidden_states")
        output_attentions = _flag(output_attentions, self.config, "output_attentions")
        cache = self._resolve_cache(cache, use_cache)
        self._check_inputs(
            input_ids, inputs_embeds, attention_mask, pixel_values, image_grid_hw, image_token_types, cache
        )
        prefill = cache is None or cache.is_empty  # else the new tokens of every cached row, at its next positions
        shift = prefill_alignment(attention_mask, output_hidden_states or output_attentions) if prefill else None
        input_ids, inputs_embeds, image_token_types, attention_mask = align_rows(
            shift, input_ids, inputs_embeds, image_token_types, attention_mask
        )
        # embed → residual stream → this stage's layers, at the tokens' cache rows, n-gram hashes and positions
        stream, embeds, image_outputs = self._input_stream(
            input_ids,
            inputs_embeds,
            pixel_values,
            image_grid_hw,
            image_token_types,
            output_hidden_states,
            output_attentions,
        )
        inputs = self._layer_inputs(
            stream, input_ids, attention_mask, image_token_types, cache, prefill, output_attentions, dspark_targets
        )
        collected = CollectedOutputs.asked(embeds, output_hidden_states, output_attentions)
        stream = self._run_layers(stream, inputs, collected)
        # collapse → norm → the outputs in the caller's row layout, or the stream handed on to the next stage
        if hand_on_to_next_stage(self._pp_stage, stream):
            return DeepseekV41ModelOutputWithPast(cache=cache, image_outputs=image_outputs)
        last_hidden_state = self.norm(DeepseekV41HyperConnection.collapse(stream.hidden_states, stream.pre_mix))
        return in_caller_layout(collected.outputs(last_hidden_state, cache, image_outputs), shift)

    def _dspark_targets(self, output_dspark_hidden_states: bool) -> tuple[int, ...]:
        """The layers whose stream the DSpark head reads, when its inputs are asked for (else none)."""
        if not output_dspark_hidden_states:
            return ()
        if not self.text_config.has_dspark:
            raise ValueError(
                "output_dspark_hidden_states needs a config with the DSpark draft head (dspark_block_size > 0)"
            )
        return tuple(self.text_config.dspark_target_layer_ids)

    def _check_inputs(
        self,
        input_ids: torch.LongTensor | None,
        inputs_embeds: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        pixel_values: torch.Tensor | None,
        image_grid_hw: torch.LongTensor | None,
        image_token_types: torch.LongTensor | None,
        cache: DeepseekV41Cache | None,
    ) -> None:
        """Refuse malformed text and image inputs; skipped while compiling, as the checks read values on the host."""
        if torch.compiler.is_compiling():
            return
        past_length = 0 if cache is None else cache.get_seq_length()
        check_text_inputs(
            input_ids,
            inputs_embeds,
            attention_mask,
            self.text_config.vocab_size,
            past_length,
            self.text_config.max_position_embeddings,
        )
        if self.config.has_vision and past_length == 0:
            check_image_inputs(
                input_ids, inputs_embeds, pixel_values, image_grid_hw, image_token_types, self.config.image_token_id
            )

    def _layer_inputs(
        self,
        stream: ResidualStream,
        input_ids: torch.LongTensor | None,
        attention_mask: torch.Tensor | None,
        image_token_types: torch.LongTensor | None,
        cache: DeepseekV41Cache | None,
        prefill: bool,
        output_attentions: bool,
        dspark_targets: tuple[int, ...],
    ) -> DeepseekV41LayerInputs:
        """What every layer reads beside the stream: where this call's tokens sit (their cache step, i.e. their rows
        of the decode state; their Engram n-gram hash ids; the rotary tables of their positions), and what to hand
        back beside the stream."""
        hidden = stream.hidden_states
        step = None
        if cache is not None:
            new_tokens = new_tokens_per_row(attention_mask, hidden, prefill)
            step = cache.step(new_tokens, hidden.shape[1], self.compress_rotary)
        image_mask = image_positions(image_token_types)
        hash_ids = self._engram_hash_ids(input_ids, image_mask, attention_mask if prefill else None, cache, step)
        positions = torch.arange(hidden.shape[1], device=hidden.device) if prefill else step.positions
        return DeepseekV41LayerInputs(
            rotations={False: self.window_rotary(positions), True: self.compress_rotary(positions)},
            image_mask=image_mask,
            engram_mask=None if image_mask is None else ~image_mask,
            engram_hash_ids=hash_ids,
            cache=cache,
            step=step,
            output_attentions=output_attentions,
            dspark_targets=dspark_targets,
        )

    def _engram_hash_ids(
        self,
        input_ids: torch.LongTensor | None,
        image_mask: torch.Tensor | None,
        real: torch.Tensor | None,
        cache: DeepseekV41Cache | None,
        step: CacheStep | None,
    ) -> torch.LongTensor | None:
        """The Engram n-gram hash ids [B, S, n_layers, n_cols] of this call's tokens (None without Engram layers);
        ``real`` marks a prefill's real tokens (None: a later call's tokens are all real)."""
        if self.engram_hasher is None:
            return None
        return self.engram_hasher.hash_ids(input_ids, image_mask, real, cache, step)

    def _run_layers(
        self, stream: ResidualStream, inputs: DeepseekV41LayerInputs, collected: CollectedOutputs
    ) -> ResidualStream:
        """This stage's decoder layers on ``stream`` → the stream the last one hands up; what each layer returns
        beside it goes to ``collected``, and the cache step (if any) is finished."""
        engram_rows = self.gather_engram_rows(inputs.engram_hash_ids)
        for layer in self._stage_layers():
            # named again: reentrant gradient checkpointing hands the layer's output back as a plain tuple
            out = DeepseekV41DecoderLayerOutput(
                *layer(*stream.tensors(), engram_rows.get(layer.layer_id), inputs=inputs)
            )
            stream = out.stream
            collected.add(out)
        if inputs.cache is not None:
            inputs.cache.finish_step(inputs.step, stream.hidden_states.shape[1])
        return stream

    def _resolve_cache(self, cache: DeepseekV41Cache | None, use_cache: bool | None) -> DeepseekV41Cache | None:
        if cache is not None and not isinstance(cache, DeepseekV41Cache):
            raise ValueError(
                f"DeepSeek-V4.1 keeps its decode state in a DeepseekV41Cache, got {type(cache).__name__}: its window, "
                "compressed rows and open compression groups do not fit a per-token key/value cache"
            )
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            if cache is not None:
                raise ValueError(
                    "a cache cannot be used with gradient checkpointing in training (it would be written twice)"
                )
            return None
        compiled = any(layer._compiled_call_impl is not None for layer in self.layers)
        if use_cache is None:
            use_cache = self.text_config.use_cache and not self.training and not compiled
        if cache is None and use_cache:
            cache = DeepseekV41Cache(self.config)
        if compiled and cache is not None and not cache.is_compileable:
            raise ValueError(
                "the decoder layers are compiled (compile_blocks, or the Trainer's torch_compile=True): a compiled "
                "layer takes the static cache only (DeepseekV41Cache grows by data-dependent shapes). Generate with "
                "cache_implementation='static', pass a DeepseekV41StaticCache, or use_cache=False"
            )
        return cache


class DeepseekV41ForCausalLM(DeepseekV41PreTrainedModel, DeepseekV41GenerationMixin):
    """DeepSeek-V4.1: the backbone ``model`` and its LM head ``lm_head`` (kept in fp32; logits come out in fp32).
    Takes images when the config has a vision part: it is also registered for ``AutoModelForImageTextToText``."""

    _tied_weights_keys = None
    _tp_plan = {"lm_head": "colwise_gather_output"}  # vocabulary-sharded, logits gathered
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}  # on the last stage; the logits go to every stage
    _pp_stage: DeepseekV41PipelineStage | None = None

    def __init__(self, config: DeepseekV41Config):
        super().__init__(config)
        text = config.get_text_config()
        self.model = DeepseekV41Model(config)
        self.lm_head = DeepseekV41Fp32Linear(text.hidden_size, text.vocab_size, bias=False, dtype=torch.float32)
        # the DSpark draft head, under the release's names `mtp.{k}` (see dspark.py); it shares `embed` and `lm_head`
        self.mtp = DeepseekV41DSpark(config) if text.has_dspark else None
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def get_image_features(
        self, pixel_values: torch.Tensor, image_grid_hw: torch.Tensor, **kwargs
    ) -> BaseModelOutputWithPooling:
        """See :meth:`DeepseekV41Model.get_image_features`."""
        return self.model.get_image_features(pixel_values, image_grid_hw, **kwargs)

    @can_return_tuple
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @under_configured_numerics
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_hw: torch.LongTensor | None = None,
        image_token_types: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        output_router_logits: bool | None = None,
        return_dict: bool | None = None,
        cache: DeepseekV41Cache | None = None,
        use_cache: bool | None = None,
        output_dspark_hidden_states: bool = False,
        **kwargs,
    ) -> DeepseekV41CausalLMOutputWithPast:
        """As :meth:`DeepseekV41Model.forward`, plus ``labels`` ([B, S], -100 ignored; shifted inside, as in every
        transformers causal LM) and ``logits_to_keep`` (an int keeps the last N positions, a tensor indexes)."""
        output_router_logits = _flag(output_router_logits, self.config, "output_router_logits")
        check_pipeline_call(
            self._pp_stage,
            input_ids if input_ids is not None else inputs_embeds,
            labels,
            self.training,
            output_hidden_states=_flag(output_hidden_states, self.config, "output_hidden_states"),
            output_attentions=_flag(output_attentions, self.config, "output_attentions"),
            output_router_logits=output_router_logits,
        )
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            pixel_values=pixel_values,
            image_grid_hw=image_grid_hw,
            image_token_types=image_token_types,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            output_router_logits=output_router_logits,
            cache=cache,
            use_cache=use_cache,
            output_dspark_hidden_states=output_dspark_hidden_states,
            return_dict=True,
        )
        device = (input_ids if input_ids is not None else inputs_embeds).device
        logits = self._logits(outputs.last_hidden_state, logits_to_keep, device)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.get_text_config().vocab_size, **kwargs)
        return DeepseekV41CausalLMOutputWithPast.from_backbone(outputs, loss=loss, logits=logits)

    def _logits(
        self, hidden: torch.Tensor | None, logits_to_keep: int | torch.Tensor, device: torch.device
    ) -> torch.Tensor:
        """fp32 logits of the kept positions of ``hidden`` [B, S, D], on every pipeline stage (``hidden`` is None on
        all but the last)."""
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = None if hidden is None else self.lm_head(hidden[:, keep])
        return logits_on_every_stage(self._pp_stage, logits, device)

    def dspark_loss(
        self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None, **inputs
    ) -> DeepseekV41DSparkLossOutput:
        """The draft head's training loss on sequences [B, S] (any other inputs, e.g. images, go to the backbone),
        from the backbone's own predictions: the backbone runs without gradient; ``y[:, j]`` = its argmax at j.
        The draft from every position c (first token ``y[:, c]``, teacher-forced Markov tokens ``y[:, c + i]``) is
        trained with cross-entropy towards ``y[:, c + i + 1]`` (``draft_loss``), and the confidence head with binary
        cross-entropy towards whether each drafted argmax equals it (``confidence_loss``: would greedy
        verification accept it)."""
        if self.mtp is None:
            raise ValueError("dspark_loss needs the DSpark draft head (dspark_block_size > 0)")
        with torch.no_grad():
            out = self(
                input_ids=input_ids,
                attention_mask=attention_mask,
                output_dspark_hidden_states=True,
                use_cache=False,
                **inputs,
            )
        predictions = out.logits.argmax(dim=-1)
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        return self.mtp.loss(out.dspark_hidden_states, predictions, valid, self.model.embed, self.lm_head)


def _flag(value: bool | None, config, name: str) -> bool:
    """An ``output_*`` argument, or the config's setting when it is None."""
    return bool(getattr(config, name, False)) if value is None else value


__all__ = [
    "DeepseekV41PreTrainedModel",
    "DeepseekV41Model",
    "DeepseekV41ForCausalLM",
    "DeepseekV41Cache",
    "DeepseekV41StaticCache",
    "DeepseekV41DecoderLayer",
    "DeepseekV41Indexer",
]
