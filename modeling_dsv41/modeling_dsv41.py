"""DeepSeek-V4.1 for transformers: embed → (merge images) → [Engram] → blocks on ``hc_mult`` residual copies →
collapse → ``norm`` → fp32 ``head``.

Module and parameter names are the released checkpoint's (``embed``, ``layers.{i}.attn.wq_a``,
``layers.{i}.ffn.experts.{e}.w1``, ``layers.{i}.hc_attn_fn``, ``layers.{i}.engram.wkv``, ``head``, ``vision.*``,
``aligner.*``), so released weights load without renaming. The LM head sits next to the backbone (no
``model.`` prefix), which is why :class:`DeepseekV41ForCausalLM` extends :class:`DeepseekV41Model`.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from configuration.configuration_dsv41 import DeepseekV41Config

from .attention import CompressedContext, DeepseekV41Attention, DeepseekV41Indexer
from .engram import DeepseekV41Engram, DeepseekV41NgramHasher
from .hyper_connections import DeepseekV41HyperConnection, identity_pre_mix
from .linear import DeepseekV41Fp32Linear, DeepseekV41GroupedLinear
from .moe import DeepseekV41Gate, DeepseekV41MoE
from .norms import DeepseekV41RMSNorm
from .rotary import DeepseekV41RotaryEmbedding
from .vision import DeepseekV41Aligner, DeepseekV41VisionTransformer, image_token_grid, merge_image_embeddings

IMAGE_TOKEN_TYPE_TEXT = -1


class DeepseekV41DecoderLayer(GradientCheckpointingLayer):
    """One block: [Engram] → mHC collapse → attention → mHC expand → mHC collapse → MoE → mHC expand.

    Each sub-block computes its mHC coefficients from its own input; its ``pre`` collapses the copies for
    the *next* sub-block (single-pass mHC), so ``forward`` takes the previous FFN's ``pre`` and returns its own.
    """

    def __init__(self, config, layer_id: int, use_vision_bias: bool):
        super().__init__()
        self.layer_id = layer_id
        hc, dim = config.hc_mult, config.hidden_size
        mix = (2 + hc) * hc
        self.engram = DeepseekV41Engram(config, layer_id) if layer_id in config.engram_layer_ids else None
        self.attn = DeepseekV41Attention(config, layer_id)
        self.ffn = DeepseekV41MoE(config, use_vision_bias)
        self.attn_norm = DeepseekV41RMSNorm(dim, config.rms_norm_eps)
        self.ffn_norm = DeepseekV41RMSNorm(dim, config.rms_norm_eps)
        self.hc = DeepseekV41HyperConnection(hc, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
        self.hc_attn_fn = nn.Parameter(torch.empty(mix, hc * dim, dtype=torch.float32))
        self.hc_ffn_fn = nn.Parameter(torch.empty(mix, hc * dim, dtype=torch.float32))
        self.hc_attn_base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.hc_ffn_base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.hc_attn_scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        self.hc_ffn_scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(
        self,
        hidden_states: torch.Tensor,
        pre_mix: torch.Tensor,
        rotation: torch.Tensor,
        ctx: CompressedContext,
        image_mask: torch.Tensor | None = None,
        engram_hash_ids: torch.Tensor | None = None,
        engram_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, CompressedContext]:
        """hidden_states [B,S,hc,D], pre_mix [B,S,hc] → (hidden_states, this FFN's pre, what this layer publishes)."""
        x = hidden_states
        if self.engram is not None:
            x = self.engram(x, engram_hash_ids[:, :, self.engram.hash_index], engram_mask)
        ctx = replace(ctx)  # a private copy: recomputation under gradient checkpointing sees the same inputs

        residual = x
        attn_pre, post, comb = self.hc.mixes(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        out = self.attn(self.attn_norm(self.hc.collapse(x, pre_mix)), rotation, ctx)
        x = self.hc.expand(out, residual, post, comb)

        residual = x
        ffn_pre, post, comb = self.hc.mixes(x, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base)
        out = self.ffn(self.ffn_norm(self.hc.collapse(x, attn_pre)), image_mask)
        x = self.hc.expand(out, residual, post, comb)
        return x, ffn_pre, ctx


class DeepseekV41PreTrainedModel(PreTrainedModel):
    config_class = DeepseekV41Config
    config: DeepseekV41Config
    base_model_prefix = "model"  # neither class has a `model` attribute: released names sit at the root
    main_input_name = "input_ids"
    input_modalities = ("image", "text")
    supports_gradient_checkpointing = True
    _no_split_modules = ["DeepseekV41DecoderLayer", "DeepseekV41VisionBlock"]
    # fp32 in the reference whatever the model dtype: mHC, sinks, router biases, ratio-2 compressor, head
    _keep_in_fp32_modules_strict = [
        "hc_attn_fn", "hc_ffn_fn", "hc_attn_base", "hc_ffn_base", "hc_attn_scale", "hc_ffn_scale",
        "attn_sink", "gate.bias", "gate.bias_vl", "head",
    ]
    # the released checkpoint also carries the DSpark draft head (mtp.*) and an unused image_pad vector
    _keys_to_ignore_on_load_unexpected = [r"^mtp\.", r"^image_pad$"]
    _supports_sdpa = False
    _supports_flash_attn = False

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
        elif isinstance(module, DeepseekV41DecoderLayer):
            for kind in ("attn", "ffn"):
                init.normal_(getattr(module, f"hc_{kind}_fn"), mean=0.0, std=std)
                init.zeros_(getattr(module, f"hc_{kind}_base"))
                init.ones_(getattr(module, f"hc_{kind}_scale"))
        elif isinstance(module, DeepseekV41Attention):
            init.zeros_(module.attn_sink)
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
        self.engram_hasher = DeepseekV41NgramHasher(text) if text.engram_layer_ids else None
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
    def get_image_features(self, pixel_values: torch.Tensor, image_grid_hw: torch.Tensor) -> list[torch.Tensor]:
        """ViT + aligner: one [h_tok·w_tok, D] tensor per image, rows in reading order."""
        if not self.config.has_vision:
            raise ValueError("images were passed but this DeepSeek-V4.1 config has no vision_config")
        return self.aligner(self.vision(pixel_values, image_grid_hw), image_grid_hw)

    def _embed_inputs(self, input_ids, inputs_embeds, pixel_values, image_grid_hw, image_token_types):
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("pass input_ids or inputs_embeds")
            inputs_embeds = self.embed(input_ids)
        if pixel_values is None:
            return inputs_embeds
        if image_grid_hw is None or image_token_types is None:
            raise ValueError("pixel_values need image_grid_hw and image_token_types (as the processor returns them)")
        vision = self.config.vision_config
        grids = [image_token_grid(g, vision.downsample_ratio) for g in image_grid_hw.tolist()]
        for index, (h, w) in enumerate(grids):
            if h * (w + 1) + 2 > vision.max_image_tokens:
                raise ValueError(
                    f"image {index} needs {h * (w + 1) + 2} positions, more than max_image_tokens "
                    f"({vision.max_image_tokens}); preprocess it with the DeepseekV41ImageProcessor"
                )
        features = self.get_image_features(pixel_values, image_grid_hw)
        return merge_image_embeddings(
            inputs_embeds, image_token_types, features, self.image_start, self.image_newline, self.image_end, grids
        )

    def _engram_hash_ids(self, input_ids, image_mask, attention_mask):
        if self.engram_hasher is None:
            return None
        if input_ids is None:
            raise ValueError(
                "Engram hashes token ids: pass input_ids (alongside inputs_embeds if you supply embeddings yourself)"
            )
        return self.engram_hasher(input_ids, image_mask, attention_mask)

    # ---- forward --------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_hw: torch.LongTensor | None = None,
        image_token_types: torch.LongTensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """Full-sequence forward from position 0.

        Args:
            input_ids: [B, S]. Needed for Engram hashing even when ``inputs_embeds`` is given (then the two are
                used together: embeddings for the stream, ids for the n-gram hashes).
            attention_mask: [B, S] 1 for real tokens. Right padding never reaches a real token (attention is
                causal); left-padded rows are aligned to start at position 0 so every row computes exactly
                what it computes alone.
            pixel_values / image_grid_hw / image_token_types: as :class:`DeepseekV41Processor` returns them;
                ``image_token_types`` alone (without pixels) still selects ``bias_vl`` and shuts Engram on the
                image span, for callers who merge image embeddings into ``inputs_embeds`` themselves.
        """
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        shift = _left_padding_shift(attention_mask)
        if shift is not None:  # align left-padded rows so positions count from each row's first real token
            input_ids, inputs_embeds, image_token_types, attention_mask = (
                _roll_rows(t, -shift) for t in (input_ids, inputs_embeds, image_token_types, attention_mask)
            )
        embeds = self._embed_inputs(input_ids, inputs_embeds, pixel_values, image_grid_hw, image_token_types)
        image_mask = None if image_token_types is None else image_token_types != IMAGE_TOKEN_TYPE_TEXT
        engram_mask = None if image_mask is None else ~image_mask
        hash_ids = self._engram_hash_ids(input_ids, image_mask, attention_mask)

        text = self.text_config
        positions = torch.arange(embeds.shape[1], device=embeds.device)
        rotations = {False: self.window_rotary(positions), True: self.compress_rotary(positions)}
        hidden = embeds.unsqueeze(2).repeat(1, 1, text.hc_mult, 1)  # [B, S, hc, D]
        pre_mix = identity_pre_mix(hidden, text.hc_mult)
        ctx = CompressedContext()
        all_hidden = [hidden] if output_hidden_states else None
        for layer in self.layers:
            rotation = rotations[text.compress_ratios[layer.layer_id] > 0]
            hidden, pre_mix, ctx = layer(hidden, pre_mix, rotation, ctx, image_mask, hash_ids, engram_mask)
            if output_hidden_states:
                all_hidden.append(hidden)
        last = self.norm(DeepseekV41HyperConnection.collapse(hidden, pre_mix))
        if shift is not None:
            last = _roll_rows(last, shift)
            all_hidden = [_roll_rows(h, shift) for h in all_hidden] if all_hidden else None
        return BaseModelOutputWithPast(
            last_hidden_state=last, hidden_states=tuple(all_hidden) if all_hidden else None
        )


class DeepseekV41ForCausalLM(DeepseekV41Model, GenerationMixin):
    """DeepSeek-V4.1 with its LM ``head`` (kept in fp32; logits come out in fp32). Takes images when the
    config has a vision part: it is also registered for ``AutoModelForImageTextToText``."""

    _tied_weights_keys = None

    def __init__(self, config: DeepseekV41Config):
        text = config.text_config
        super().__init__(config)
        self.head = DeepseekV41Fp32Linear(text.hidden_size, text.vocab_size, bias=False, dtype=torch.float32)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.head = value

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
        return_dict: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """As :meth:`DeepseekV41Model.forward`, plus ``labels`` ([B, S], -100 ignored; shifted inside, as in every
        transformers causal LM) and ``logits_to_keep`` (an int keeps the last N positions, a tensor indexes)."""
        outputs = super().forward(
            input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
            pixel_values=pixel_values, image_grid_hw=image_grid_hw, image_token_types=image_token_types,
            output_hidden_states=output_hidden_states,
        )
        hidden = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.head(hidden[:, keep])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.text_config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states)


def _left_padding_shift(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Per-row count of leading padding, or None when no row is left-padded."""
    if attention_mask is None or attention_mask.ndim != 2:
        return None
    mask = attention_mask.bool()
    leading = (~mask).int().cumprod(dim=1).sum(dim=1)
    return leading if bool(leading.any()) else None


def _roll_rows(t: torch.Tensor | None, shift: torch.Tensor) -> torch.Tensor | None:
    """Roll each row of ``t`` ([B, S, ...]) along dim 1 by its own ``shift``."""
    if t is None:
        return None
    seq = t.shape[1]
    index = (torch.arange(seq, device=t.device).unsqueeze(0) - shift.unsqueeze(1)) % seq  # [B, S]
    index = index.view(*index.shape, *([1] * (t.ndim - 2))).expand_as(t)
    return t.gather(1, index)


__all__ = [
    "DeepseekV41PreTrainedModel",
    "DeepseekV41Model",
    "DeepseekV41ForCausalLM",
    "DeepseekV41DecoderLayer",
    "DeepseekV41Indexer",
]
