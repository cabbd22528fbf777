"""bitsandbytes on the fused routed experts: 4-bit (NF4 / FP4, with or without double quantization) and 8-bit.

transformers' bitsandbytes integration replaces ``nn.Linear`` modules only, so the 3-D ``gate_up_proj`` [E, 2·I, D] and
``down_proj`` [E, D, I] of :class:`~.moe.DeepseekV41Experts` (most of the model's parameters) would load in full
precision. The quantizers of :mod:`.bnb_quantizer` make them :class:`Bnb4bitExperts` / :class:`Bnb8bitExperts`
(defined here: their storage and their forward), quantized tensor by tensor as they load, with bitsandbytes' own
functions and one block-wise state per expert (each expert quantized on its own, its scales in row ``e`` of the
state tensors): an expert can be sharded or placed whole, with its state.

* 4-bit: ``bitsandbytes.functional.quantize_4bit`` on each expert's [out, in] weight (blocks of 64 row-major,
  ``bnb_4bit_quant_type``, ``bnb_4bit_use_double_quant`` compressing the block scales to 8 bits with one nested state
  per expert); stored as the packed bytes [E, out, in/2] and ``{name}_absmax`` [E, blocks] (plus, double-quantized,
  ``{name}_nested_absmax`` [E, blocks/256] and ``{name}_nested_offset`` [E]); computed in ``bnb_4bit_compute_dtype``
  as ``Linear4bit`` does.
* 8-bit: ``int8_vectorwise_quant``, the row-wise absmax int8 ``Linear8bitLt`` stores, [E, out, in] int8 and
  ``{name}_scb`` [E, out]; computed weight-only (the weight dequantized to the input's dtype: no outlier
  decomposition, which needs int8 GEMM kernels).

The forward is the reference's eager computation (:func:`~.moe.routed_experts_forward`): only experts tokens are
routed to are dequantized, inside their products and again in the backward (nothing dequantized is kept), with the
input's exact gradient. PEFT's ``target_parameters`` adapters (``LoraConfig(target_parameters=["experts.gate_up_proj",
"experts.down_proj"])``) have the logical per-expert shape and add their delta to each expert's output
(:mod:`~.released.native_lora`), so QLoRA trains them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .moe import DeepseekV41Experts, per_slot_experts_forward, routed_experts_forward

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
# bitsandbytes' 4-bit block (its default on every backend) and the nested block of double quantization
BLOCK_4BIT, NESTED_BLOCK = 64, 256

# expert e → the LoRA factors adapting one of its weights [out, in]: [(lora_A [r, in], lora_B [out, r], scaling), ...]
ExpertFactors = Callable[[int], list[tuple[torch.Tensor, torch.Tensor, float]]]


class _FrozenDequantizedLinear(torch.autograd.Function):
    """``x @ W.T`` for a frozen ``W = dequantize()``, whose backward dequantizes ``W`` again: the dequantized weight is
    never kept between the passes (autograd through ``F.linear`` would keep it until the backward)."""

    @staticmethod
    def forward(ctx, x, dequantize):
        ctx.dequantize = dequantize
        with torch.no_grad():
            return F.linear(x, dequantize())

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output @ ctx.dequantize(), None


class QuantizedExpertWeight:
    """One routed expert's quantized weight [out, in] as :func:`~.moe.routed_experts_forward` applies it (a
    :class:`~.moe.ProjectedWeight`): dequantized for the rows a product needs, in the compute dtype, LoRA factors added
    to the output, ``x·Wᵀ + scaling·(x·Aᵀ)·Bᵀ``."""

    def __init__(self, experts: "BnbExperts", name: str, expert: int, factors: list | None = None):
        self.experts, self.name, self.expert, self.factors = experts, name, expert, factors or []
        self.shape = torch.Size(experts.weight_shape(name)[1:])

    def linear(self, x: torch.Tensor, rows: slice) -> torch.Tensor:
        dtype = self.experts.compute_dtype or x.dtype
        out = _FrozenDequantizedLinear.apply(
            x.to(dtype), lambda: self.experts.dequantize(self.name, self.expert, rows, dtype)
        ).to(x.dtype)
        for lora_a, lora_b, scaling in self.factors:  # in the factors' dtype, as PEFT's Linear computes its delta
            delta = F.linear(F.linear(x.to(lora_a.dtype), lora_a), lora_b[rows]) * scaling
            out = out + delta.to(out.dtype)
        return out


class BnbExperts(DeepseekV41Experts):
    """:class:`~.moe.DeepseekV41Experts` whose ``gate_up_proj`` / ``down_proj`` hold bitsandbytes-quantized bytes, one
    state per expert (subclasses say how). Built on the meta device from the experts it replaces, filled by
    :meth:`quantize` (one tensor at a time, as the checkpoint loads)."""

    def __init__(self, config, num_experts: int | None = None, compute_dtype: torch.dtype | None = None):
        with torch.device("meta"):
            super().__init__(config, num_experts)
        self.compute_dtype = compute_dtype
        self._shapes = {name: tuple(getattr(self, name).shape) for name in EXPERT_WEIGHTS}
        for name in EXPERT_WEIGHTS:
            for state, tensor in self._storage(*self._shapes[name]).items():
                if state:
                    self.register_buffer(f"{name}_{state}", tensor)
                else:
                    setattr(self, name, nn.Parameter(tensor, requires_grad=False))

    @classmethod
    @torch.no_grad()
    def from_dense(cls, experts: DeepseekV41Experts, **kwargs) -> "BnbExperts":
        """``experts`` (loaded, not meta) quantized: what loading with a ``BitsAndBytesConfig`` builds, tensor by
        tensor."""
        quantized = cls(experts.config, experts.num_experts, **kwargs)
        for name in EXPERT_WEIGHTS:
            for attribute, tensor in quantized.quantize(name, getattr(experts, name)).items():
                if attribute in EXPERT_WEIGHTS:
                    tensor = nn.Parameter(tensor, requires_grad=False)
                setattr(quantized, attribute, tensor)
        return quantized

    @classmethod
    def unfit(cls, experts: DeepseekV41Experts) -> str | None:
        """Why ``experts`` cannot be stored this way (None if they can)."""
        return None

    def weight_shape(self, name: str) -> tuple[int, int, int]:
        """The logical shape [E, out, in] of ``name``."""
        return self._shapes[name]

    def _storage(self, experts: int, rows: int, columns: int) -> dict[str, torch.Tensor]:
        """Meta tensors of one weight's storage: the weight itself under key ``""``, its states by suffix."""
        raise NotImplementedError

    def quantize(self, name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The storage of the dense ``weight`` [E, out, in] of ``name``: attribute name → tensor."""
        raise NotImplementedError

    def dequantize(
        self, name: str, expert: int, rows: slice = slice(None), dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        """Expert ``expert``'s weight ``name`` [out, in] (the ``rows`` of it) in ``dtype``."""
        raise NotImplementedError

    def gathered(self, name: str, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Experts ``experts`` [n] of weight ``name`` dequantized to ``dtype`` at once: [n, out, in], the values
        :meth:`dequantize` gives each, from their gathered bytes and states (no value read back)."""
        raise NotImplementedError

    @torch.no_grad()
    def dequantized(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Every expert's weight ``name`` [E, out, in] in ``dtype``."""
        return torch.stack([self.dequantize(name, expert, dtype=dtype) for expert in range(self.num_experts)])

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        adapters: Mapping[str, ExpertFactors] | None = None,
    ) -> torch.Tensor:
        """hidden_states [N, D], top_k_index / top_k_weights [N, k] → fp32 [N, D], the eager computation with each
        routed expert's weights dequantized inside its products; ``adapters``: the LoRA factors of PEFT's wrappers
        around this module (:mod:`~.released.native_lora`).

        Decoding (no more slots than experts, no adapter, no input gradient, the compute dtype the input's), each
        slot's expert is dequantized from its gathered bytes (:func:`~.moe.per_slot_experts_forward`: no host sync);
        otherwise the loop over the experts with tokens (one host sync reading how many each got)."""
        adapters = adapters or {}
        dtype = self.compute_dtype or hidden_states.dtype
        needs_input_grad = torch.is_grad_enabled() and hidden_states.requires_grad
        decoding = top_k_index.numel() <= self.num_experts
        if decoding and not adapters and not needs_input_grad and dtype == hidden_states.dtype:
            return per_slot_experts_forward(
                hidden_states,
                top_k_index,
                top_k_weights,
                self.swiglu_limit,
                self.num_experts,
                lambda ids: (self.gathered("gate_up_proj", ids, dtype), self.gathered("down_proj", ids, dtype)),
            )

        def weight(name: str, expert: int) -> QuantizedExpertWeight:
            return QuantizedExpertWeight(self, name, expert, adapters[name](expert) if name in adapters else None)

        return routed_experts_forward(
            hidden_states,
            top_k_index,
            top_k_weights,
            self.num_experts,
            self.swiglu_limit,
            lambda expert: (weight("gate_up_proj", expert), weight("down_proj", expert)),
        )


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _blocks(rows: int, columns: int) -> int:
    return -(-rows * columns // BLOCK_4BIT)


class Bnb4bitExperts(BnbExperts):
    """Experts stored 4-bit (``Linear4bit``'s format, per expert): packed bytes [E, out, in/2] (two codes a byte,
    row-major) and one absmax per 64 weights, [E, ⌈out·in/64⌉] fp32, or 8-bit with double quantization (with
    its nested absmax [E, ⌈blocks/256⌉] and offset [E] per expert)."""

    def __init__(
        self,
        config,
        num_experts: int | None = None,
        compute_dtype: torch.dtype | None = None,
        quant_type: str = "nf4",
        double_quant: bool = False,
    ):
        self.quant_type, self.double_quant = quant_type, double_quant
        super().__init__(config, num_experts, compute_dtype)
        if double_quant:  # bitsandbytes' signed dynamic map, shared by every nested state
            self.register_buffer("nested_code", _meta(256, dtype=torch.float32))

    @classmethod
    def unfit(cls, experts: DeepseekV41Experts) -> str | None:
        if experts.hidden_dim % 2 or experts.intermediate_dim % 2:  # two codes a byte, row by row
            return f"odd hidden or expert width ({experts.hidden_dim}, {experts.intermediate_dim})"
        return None

    def _storage(self, experts: int, rows: int, columns: int) -> dict[str, torch.Tensor]:
        blocks = _blocks(rows, columns)
        storage = {
            "": _meta(experts, rows, columns // 2, dtype=torch.uint8),
            "absmax": _meta(experts, blocks, dtype=torch.uint8 if self.double_quant else torch.float32),
        }
        if self.double_quant:
            storage["nested_absmax"] = _meta(experts, -(-blocks // NESTED_BLOCK), dtype=torch.float32)
            storage["nested_offset"] = _meta(experts, dtype=torch.float32)
        return storage

    def quantize(self, name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        import bitsandbytes.functional as bnb_functional

        packed, absmax, nested_absmax, offsets = [], [], [], []
        for expert in weight:
            data, state = bnb_functional.quantize_4bit(
                expert, blocksize=BLOCK_4BIT, compress_statistics=self.double_quant, quant_type=self.quant_type
            )
            packed.append(data.view(expert.shape[0], -1))
            absmax.append(state.absmax)
            if self.double_quant:
                nested_absmax.append(state.state2.absmax)
                offsets.append(state.offset.reshape(()))
                code = state.state2.code
        out = {name: torch.stack(packed), f"{name}_absmax": torch.stack(absmax)}
        if self.double_quant:
            out |= {
                f"{name}_nested_absmax": torch.stack(nested_absmax),
                f"{name}_nested_offset": torch.stack(offsets),
                "nested_code": code.float(),
            }
        return out

    def _absmax(self, name: str, expert: int) -> torch.Tensor:
        """Expert ``expert``'s fp32 block scales of ``name``, undoing the double quantization."""
        absmax = getattr(self, f"{name}_absmax")[expert]
        if not self.double_quant:
            return absmax
        import bitsandbytes.functional as bnb_functional

        nested = bnb_functional.QuantState(
            absmax=getattr(self, f"{name}_nested_absmax")[expert],
            code=self.nested_code,
            blocksize=NESTED_BLOCK,
            dtype=torch.float32,
        )
        return bnb_functional.dequantize_blockwise(absmax, nested) + getattr(self, f"{name}_nested_offset")[expert]

    def _gathered_absmax(self, name: str, experts: torch.Tensor) -> torch.Tensor:
        """The fp32 block scales [n, blocks] of ``experts`` [n], each padded to whole nested blocks and dequantized in
        one call under double quantization (a nested block never spans two experts)."""
        absmax = getattr(self, f"{name}_absmax").index_select(0, experts)
        if not self.double_quant:
            return absmax
        import bitsandbytes.functional as bnb_functional

        blocks = absmax.shape[1]
        nested_absmax = getattr(self, f"{name}_nested_absmax").index_select(0, experts)  # [n, nested blocks]
        padded = F.pad(absmax, (0, nested_absmax.shape[1] * NESTED_BLOCK - blocks))
        nested = bnb_functional.QuantState(
            absmax=nested_absmax.flatten(), code=self.nested_code, blocksize=NESTED_BLOCK, dtype=torch.float32
        )
        scales = bnb_functional.dequantize_blockwise(padded.flatten(), nested).view(len(experts), -1)[:, :blocks]
        return scales + getattr(self, f"{name}_nested_offset").index_select(0, experts).unsqueeze(1)

    def gathered(self, name: str, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        import bitsandbytes.functional as bnb_functional

        _, out_features, in_features = self._shapes[name]
        count, numel = len(experts), out_features * in_features
        absmax = self._gathered_absmax(name, experts)  # [n, blocks]
        codes = getattr(self, name).index_select(0, experts).view(count, -1)  # [n, out·in/2], two codes a byte
        if numel % BLOCK_4BIT:  # each expert's last block is partial: padded so that no block spans two experts
            codes = F.pad(codes, (0, absmax.shape[1] * BLOCK_4BIT // 2 - codes.shape[1]))
        state = bnb_functional.QuantState(
            absmax=absmax.flatten(),
            shape=torch.Size((count, 2 * codes.shape[1])),
            dtype=dtype,
            blocksize=BLOCK_4BIT,
            quant_type=self.quant_type,
        )
        dense = bnb_functional.dequantize_4bit(codes.reshape(-1, 1), state)
        return dense[:, :numel].view(count, out_features, in_features)

    def dequantize(
        self, name: str, expert: int, rows: slice = slice(None), dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        import bitsandbytes.functional as bnb_functional

        _, out_features, in_features = self._shapes[name]
        first, last, _ = rows.indices(out_features)
        absmax = self._absmax(name, expert)
        if in_features % BLOCK_4BIT:  # blocks straddle rows: the whole expert, then its rows
            first, last, rows = 0, out_features, slice(first, last)
        else:  # whole blocks per row: the rows' blocks only
            absmax, rows = absmax[first * in_features // BLOCK_4BIT : last * in_features // BLOCK_4BIT], slice(None)
        state = bnb_functional.QuantState(
            absmax=absmax,
            shape=torch.Size((last - first, in_features)),
            dtype=dtype,
            blocksize=BLOCK_4BIT,
            quant_type=self.quant_type,
        )
        return bnb_functional.dequantize_4bit(getattr(self, name)[expert, first:last].reshape(-1, 1), state)[rows]


class Bnb8bitExperts(BnbExperts):
    """Experts stored as ``Linear8bitLt`` stores its weight, per expert: int8 rows [E, out, in] and each row's absmax
    [E, out] fp32 (``{name}_scb``)."""

    def _storage(self, experts: int, rows: int, columns: int) -> dict[str, torch.Tensor]:
        return {"": _meta(experts, rows, columns, dtype=torch.int8), "scb": _meta(experts, rows, dtype=torch.float32)}

    def quantize(self, name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        import bitsandbytes.functional as bnb_functional

        experts, rows, columns = weight.shape  # of the fp16 weight, as Int8Params quantizes
        codes, scb, _ = bnb_functional.int8_vectorwise_quant(weight.reshape(experts * rows, columns).to(torch.float16))
        return {name: codes.view(experts, rows, columns), f"{name}_scb": scb.view(experts, rows)}

    def dequantize(
        self, name: str, expert: int, rows: slice = slice(None), dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        import bitsandbytes.functional as bnb_functional

        codes, scb = getattr(self, name)[expert, rows], getattr(self, f"{name}_scb")[expert, rows]
        return bnb_functional.int8_vectorwise_dequant(codes, scb).to(dtype)

    def gathered(self, name: str, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        import bitsandbytes.functional as bnb_functional

        codes = getattr(self, name).index_select(0, experts)  # [n, out, in]
        scb = getattr(self, f"{name}_scb").index_select(0, experts)  # [n, out]
        return bnb_functional.int8_vectorwise_dequant(codes.flatten(0, 1), scb.flatten()).view(codes.shape).to(dtype)


def dequantized_experts(experts: BnbExperts, dtype: torch.dtype) -> DeepseekV41Experts:
    """Plain :class:`~.moe.DeepseekV41Experts` holding ``experts``' dequantized weights in ``dtype``."""
    with torch.device("meta"):
        dense = DeepseekV41Experts(experts.config, experts.num_experts)
    for name in EXPERT_WEIGHTS:
        setattr(dense, name, nn.Parameter(experts.dequantized(name, dtype), requires_grad=False))
    return dense


__all__ = [
    "Bnb4bitExperts",
    "Bnb8bitExperts",
    "BnbExperts",
    "QuantizedExpertWeight",
    "dequantized_experts",
]
