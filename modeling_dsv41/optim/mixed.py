"""One ``torch.optim.Optimizer`` for the whole model: Muon, head-wise Muon, Sinkhorn-balanced and AdamW groups.

Being a single optimizer (rather than one per algorithm) is what lets transformers' LR schedulers,
``clip_grad_norm_``, accelerate's wrapper and ``Trainer`` checkpointing work unchanged: they only ever see
``param_groups`` with an ``lr`` and a ``state_dict``. Each group names its algorithm in ``kind``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .kinds import KINDS, OPTIMIZER_KINDS, OptimizerKind
from .policy import build_param_groups

_COMMON_KEYS = {"params", "param_names", "kind", "lr"}


class MixedOptimizer(torch.optim.Optimizer):
    r"""DeepSeek-V4.1's optimizer: every param group carries a ``kind`` and that kind's hyperparameters.

    - ``"muon"``: Nesterov momentum, Newton–Schulz orthogonalization (one ``(a, b, c)`` per step in
      ``ns_coefficients``; default DeepSeek-V4's 8 + 2 hybrid), update scaled to RMS ``update_rms`` so that
      ``lr`` and decoupled ``weight_decay`` mean the same as for AdamW. A tensor ``[..., rows, cols]`` with
      more than two dims is a batch of matrices (e.g. stacked experts ``[E, out, in]``), each orthogonalized
      on its own.
    - ``"muon_headwise"``: as muon, but rows are cut into ``num_heads`` blocks (per split of ``split_sizes``
      for fused projections) and every head block is orthogonalized and RMS-scaled on its own.
    - ``"sinkhorn"``: Nesterov momentum, then :func:`~.sinkhorn.sinkhorn_balance`; rows with ~0 momentum are
      left exactly unchanged; update RMS ``update_rms``; 2-D parameters only, no weight decay.
    - ``"adamw"``: exactly ``torch.optim.AdamW`` (``betas``, ``eps``, decoupled ``weight_decay``).

    Sharded parameters (DTensor: FSDP2's ``fully_shard``, tensor/expert parallel meshes) get exactly the
    unsharded update: element-wise work runs on the local shards, every matrix (head block) is orthogonalized
    whole once, on one owner rank, and Sinkhorn all-reduces its column sums (see :mod:`.distributed`). Every
    rank must step the same parameters. DeepSpeed ZeRO's flat partitions are refused (``ValueError``).

    State per parameter: ``momentum_buffer`` (muon kinds, sinkhorn) or ``step``, ``exp_avg``, ``exp_avg_sq``
    (adamw), all tensors, so ``torch.load(weights_only=True)`` reads a saved ``state_dict``; from the first step
    on every parameter has it, zeros (the same as none) for those that got no gradient yet. Momentum follows
    torch.optim.Muon's convention ``B ← μ·B + (1 − μ)·g``, Nesterov ``g + μ·(B − g)``. Keys a group leaves
    out come from the kind's defaults (:mod:`.kinds`: torch.optim.Muon's and torch.optim.AdamW's plus the recipe's),
    then from ``lr``; unknown keys raise.

    ``params`` are the groups of :func:`~.policy.build_param_groups`, or the model itself: then the groups are built
    here, ``build_param_groups(model, lr=lr, **policy)``. That is how a ``Trainer`` that builds the optimizer from
    ``optimizer_cls_and_kwargs`` (TRL's trainers too) gets the policy: it hands ``kwargs["model"]`` over as the
    parameters, ``optimizer_cls_and_kwargs=(MixedOptimizer, {"model": model, "lr": args.learning_rate})``.

    Example::

        groups = build_param_groups(model, lr=3e-4)  # the docs/design.md §6 policy, see .policy
        optimizer = MixedOptimizer(groups)
        optimizer = MixedOptimizer(model, lr=3e-4, weight_decay=0.1)  # the same groups, built here
    """

    def __init__(self, params: Any, lr: float = 1e-3, **policy: Any) -> None:
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if isinstance(params, torch.nn.Module):
            params = build_param_groups(params, lr=lr, **policy)
        elif policy:
            raise ValueError(
                f"MixedOptimizer takes {sorted(policy)} only with the model as params (the groups are then built "
                "with build_param_groups); with ready groups, set them in build_param_groups(model, ...)"
            )
        super().__init__(params, {"lr": lr})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        name = param_group.get("kind")
        kind = OPTIMIZER_KINDS.get(name) if isinstance(name, str) else None
        if kind is None:
            raise ValueError(
                f"every param group needs a 'kind' in {KINDS}, got {name!r}: the kinds follow the parameter names, "
                "so build the groups with build_param_groups(model, lr=...) or pass the model itself, "
                "MixedOptimizer(model, lr=...); in a Trainer (TRL's too), "
                "optimizer_cls_and_kwargs=(MixedOptimizer, {'model': model, 'lr': args.learning_rate})"
            )
        for key, value in kind.defaults.items():
            param_group.setdefault(key, value)
        for key in kind.required:
            if key not in param_group:
                raise ValueError(f"a {name!r} param group needs {key!r}")
        unknown = set(param_group) - _COMMON_KEYS - kind.keys
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} for a {name!r} param group")
        super().add_param_group(param_group)
        kind.check(self.param_groups[-1])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``Optimizer.load_state_dict``, refusing a checkpoint whose groups have other kinds."""
        saved = [group.get("kind") for group in state_dict["param_groups"]]
        current = [group["kind"] for group in self.param_groups]
        if len(saved) == len(current) and saved != current:
            raise ValueError(f"checkpoint param-group kinds {saved} do not match this optimizer's {current}")
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(group, [p for p in group["params"] if p.grad is not None]) for group in self.param_groups]
        for group, params in work:  # every check before any update
            kind = OPTIMIZER_KINDS[group["kind"]]
            for p in params:
                if p.grad.is_sparse:
                    raise ValueError(f"{kind.name} does not support sparse gradients")
                if kind.check_param is not None:
                    kind.check_param(kind.name, p)
        for group, params in work:
            kind = OPTIMIZER_KINDS[group["kind"]]
            self._init_state(kind, group)
            if params:
                kind.step(self.state, group, params)
        return loss

    def _init_state(self, kind: OptimizerKind, group: dict[str, Any]) -> None:
        """Zero state, equal to none, for every parameter of ``group``, gradient or not: a checkpoint then holds
        the same keys whichever parameters got gradients (e.g. the ViT in text-only batches), which sharded
        (DCP) checkpoints need to resume, since their loader asks for the state of every parameter."""
        for p in group["params"]:
            if not self.state[p]:
                self.state[p].update(kind.init_state(p))
