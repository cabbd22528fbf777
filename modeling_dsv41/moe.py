"""DeepSeek-V4.1 mixture of experts: a biased top-k router with a second bias for image tokens, clamped
SwiGLU experts (only the selected ones run), and one shared expert every token goes through."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DeepseekV41Gate(nn.Module):
    """Router. ``bias`` (text) or ``bias_vl`` (image-span tokens) steers which experts are *chosen*; the routing
    weights come from the unbiased scores, renormalized over the chosen ones and scaled by ``route_scale``.

    Both biases are moved by the aux-loss-free balancing rule, not by gradients (see the trainer).
    """

    def __init__(self, config, use_vision_bias: bool):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.scoring_func = config.scoring_func
        self.gate_temp = config.gate_temp
        self.norm_topk_prob = config.norm_topk_prob
        self.route_scale = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32), requires_grad=False)
        self.bias_vl = (
            nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32), requires_grad=False)
            if use_vision_bias
            else None
        )

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Unbiased expert affinities [N, E] in fp32."""
        logits = F.linear(x.float(), self.weight.float()) / self.gate_temp
        if self.scoring_func == "softmax":
            return logits.softmax(dim=-1)
        if self.scoring_func == "sigmoid":
            return logits.sigmoid()
        return F.softplus(logits).sqrt()

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D], image_mask [N] bool → (weights [N, k] fp32, expert indices [N, k])."""
        scores = self.scores(x)
        bias = self.bias.float()
        if image_mask is not None and self.bias_vl is not None:
            bias = torch.where(image_mask.unsqueeze(-1), self.bias_vl.float(), bias)
        indices = (scores + bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # not norm_eps: matches training
        return weights * self.route_scale, indices


class DeepseekV41Expert(nn.Module):
    """SwiGLU FFN with the training clamps: up (``w3``) clamped to ±limit, gate (``w1``) clamped above at limit.
    The routing weight multiplies the activation before ``w2``."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.w1(x).float(), self.w3(x).float()
        if self.swiglu_limit > 0:
            up = up.clamp(-self.swiglu_limit, self.swiglu_limit)
            gate = gate.clamp(max=self.swiglu_limit)
        hidden = F.silu(gate) * up
        if weights is not None:
            hidden = weights * hidden
        return self.w2(hidden.to(x.dtype))


class DeepseekV41MoE(nn.Module):
    """Routed experts (``experts.{e}``) plus ``shared_experts``. Only experts that received tokens run."""

    def __init__(self, config, use_vision_bias: bool):
        super().__init__()
        self.n_routed_experts = config.n_routed_experts
        self.gate = DeepseekV41Gate(config, use_vision_bias)
        self.experts = nn.ModuleList(
            DeepseekV41Expert(config.hidden_size, config.moe_intermediate_size, config.swiglu_limit)
            for _ in range(config.n_routed_experts)
        )
        self.shared_experts = DeepseekV41Expert(config.hidden_size, config.moe_intermediate_size, config.swiglu_limit)
        self.last_expert_indices: torch.Tensor | None = None  # [B, S, k], read by the bias-balancing rule

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, indices = self.gate(x, None if image_mask is None else image_mask.reshape(-1))
        self.last_expert_indices = indices.detach().view(*shape[:-1], -1)
        out = torch.zeros_like(x, dtype=torch.float32)
        counts = torch.bincount(indices.flatten(), minlength=self.n_routed_experts).tolist()
        for e, count in enumerate(counts):  # expert order fixes the fp32 summation order, as in the reference
            if count == 0:
                continue
            token, slot = torch.where(indices == e)
            # index_select: its backward is a plain index_add, far cheaper than advanced indexing's scatter
            routed = self.experts[e](x.index_select(0, token), weights[token, slot, None])
            out.index_add_(0, token, routed.float())
        out = out + self.shared_experts(x).float()
        return out.to(x.dtype).view(shape)
