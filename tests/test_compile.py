"""Per-block ``torch.compile`` (modeling_dsv41/training/compilation.py): a decoder layer and a DSpark block compile as
one graph, forward and backward, with gradient checkpointing on; a second step of the same shapes compiles nothing,
a new sequence length once; compiled and eager agree; the Trainer's ``torch_compile=True`` compiles block by block;
reference numerics refuse to compile.

The graphs are traced with the ``aot_eager`` backend (dynamo and AOTAutograd, forward and backward, without inductor's
C++ build, which takes minutes on a loaded 2-core machine); benchmarks/compile.py runs inductor.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_processes import WORLD, spawn
from test_dspark_generation import dspark_model
from test_trainer import Rows, training_args
from tiny_models import tiny_model, tiny_training_model
from torch._dynamo.testing import CompileCounterWithBackend

from modeling_dsv41.training.trainer import DeepseekV41Trainer
from modeling_dsv41.training.compilation import compile_blocks


def _layer_inputs(model, ids, which):
    """The positional and keyword arguments decoder layer ``which`` receives in ``model(ids)``, as leaves."""
    captured = {}
    handle = model.model.layers[which].register_forward_pre_hook(
        lambda module, args, kwargs: captured.update(args=args, kwargs=kwargs), with_kwargs=True
    )
    with torch.no_grad():
        model(ids)
    handle.remove()
    args = [
        a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
        for a in captured["args"]
    ]
    return args, captured["kwargs"]


def _step(layer, args, kwargs):
    """Outputs, input gradients and parameter gradients of one forward+backward of ``layer``."""
    layer.zero_grad()
    args = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
    outputs = [o for o in layer(*args, **kwargs) if isinstance(o, torch.Tensor) and o.is_floating_point()]
    weights = torch.Generator().manual_seed(0)
    sum((o.float() * torch.randn(o.shape, generator=weights)).sum() for o in outputs).backward()
    grads = [a.grad for a in args if isinstance(a, torch.Tensor) and a.grad is not None]
    return outputs + grads + [p.grad for p in layer.parameters() if p.grad is not None]


def _assert_agree(compiled, eager):
    assert len(compiled) == len(eager)
    for c, e in zip(compiled, eager):
        # fp32: the experts' grouped products are GEMMs of other shapes than the eager per-expert loop's, and the
        # recomputed regions' backward is autograd of the region traced into the graph rather than run again; the
        # absolute floor is for gradients that cancel to ~1e-8 (a one-hot pre_mix's), sums of terms of order 1
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5 * e.abs().max().item() + 1e-6)


def test_decoder_layer_compiles_as_one_graph_forward_and_backward():
    """Layer 1 of the tiny model: Engram, compressor (ratio 2), indexer, mHC, MoE, under gradient checkpointing."""
    model = tiny_training_model(2)
    model.activation_checkpointing_enable()
    layer = model.model.layers[1]
    assert layer.engram is not None and layer.attn.compressor is not None and layer.attn.indexer is not None
    ids = torch.randint(3, 500, (2, 64), generator=torch.Generator().manual_seed(0))
    args, kwargs = _layer_inputs(model, ids, 1)
    shorter = [_layer_inputs(model, ids[:, :length], 1) for length in (48, 40)]
    eager = _step(layer, args, kwargs)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compile_blocks(model, backend=counter)  # fullgraph=True: any graph break raises
    compiled = _step(layer, args, kwargs)
    assert counter.frame_count == 1
    _assert_agree(compiled, eager)
    _assert_agree(_step(layer, args, kwargs), eager)
    assert counter.frame_count == 1  # the second step of the same shapes reuses the graph

    for args, kwargs in shorter:  # a new length compiles once with dynamic shapes, the next reuses it
        _step(layer, args, kwargs)
    assert counter.frame_count == 2


def _parameter_grads(model, ids) -> dict[str, torch.Tensor | None]:
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_compiled_and_eager_give_gradients_to_the_same_parameters():
    """Every decoder layer compiled whole: the parameters eager leaves without a gradient (the indexer's key
    projection, which only feeds the discrete top-k) have none compiled either, so an optimizer does not update or
    weight-decay them only when compiled; the others agree within fp32 rounding."""
    model = tiny_training_model(3)
    assert model.model.layers[1].attn.indexer.wk is not None
    ids = torch.randint(3, 500, (2, 48), generator=torch.Generator().manual_seed(0))
    eager = _parameter_grads(model, ids)
    torch._dynamo.reset()
    compile_blocks(model, backend="aot_eager")
    compiled = _parameter_grads(model, ids)
    without = sorted(name for name, grad in eager.items() if grad is None)
    assert "model.layers.1.attn.indexer.wk.weight" in without
    assert sorted(name for name, grad in compiled.items() if grad is None) == without
    names = [name for name, grad in eager.items() if grad is not None]
    _assert_agree([compiled[name] for name in names], [eager[name] for name in names])


def test_dspark_block_compiles_as_one_graph_forward_and_backward():
    model = dspark_model().train()
    captured = {}
    block = model.mtp[0]
    block.register_forward_pre_hook(lambda module, args: captured.update(args=args))
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    model.dspark_loss(ids)
    args = [a.detach().requires_grad_(a.is_floating_point()) for a in captured["args"]]
    eager = _step(block, args, {})
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compile_blocks(model, backend=counter)
    _assert_agree(_step(block, args, {}), eager)
    _step(block, args, {})
    assert counter.frame_count == 1


def test_compiled_model_trains_then_evaluates_without_a_dynamic_cache():
    """Six layers of six kinds (compression ratio, Engram, KV / index sources) each compile a training graph and a
    ``no_grad`` one: 12 graphs of one code object, past dynamo's default limit of 8, which with ``fullgraph=True`` is
    an error (compile_blocks raises the limit per block). An evaluation forward builds no dynamic cache (a compiled
    layer cannot take one: its rows grow by data-dependent shapes) and gives the eager logits; asking for that cache
    is a clear error."""
    model = tiny_training_model(6)
    model.activation_checkpointing_enable()
    ids = torch.randint(3, 500, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model.eval()(ids).logits
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")  # dynamo alone: its limit and its refusal of the cache
    compile_blocks(model, backend=counter)
    model.train()(ids, labels=ids).loss.backward()
    model.eval()
    with torch.no_grad():
        compiled = model(ids)
    assert counter.frame_count > 8
    assert compiled.past_key_values is None
    torch.testing.assert_close(compiled.logits, eager, rtol=1e-5, atol=1e-5)  # the traced graphs run the same ops
    with pytest.raises(ValueError, match="static cache only"):
        model(ids, use_cache=True)


def _losses_eager_and_compiled(tmp: Path, steps: int, batches: int, check) -> None:
    """The Trainer's logged losses of ``steps`` steps (``batches`` batches), eager and with ``torch_compile=True``
    (aot_eager), each on a fresh copy of one tiny model with gradient checkpointing, agree; ``check(trainer, model,
    compiled)`` after each run. The first losses differ by the forward's fp32 rounding only; the later ones also by
    the optimizer steps taken from gradients that differ by GEMM rounding (see _assert_agree), which AdamW's and
    Muon's normalised updates pass on at the learning rate's scale wherever a gradient is near zero."""
    losses = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = tiny_training_model(2)
        args = training_args(
            tmp / str(compiled),
            max_steps=steps,
            activation_checkpointing=True,
            torch_compile=compiled,
            torch_compile_backend="aot_eager" if compiled else None,
            logging_strategy="steps",
            logging_steps=1,
        )
        rows = Rows(batches * args.train_batch_size * args.world_size)
        trainer = DeepseekV41Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
        check(trainer, model, compiled)
        losses.append([entry["loss"] for entry in trainer.state.log_history if "loss" in entry])
    eager, compiled = losses
    assert len(eager) == steps
    assert compiled[0] == pytest.approx(eager[0], rel=1e-6)
    assert compiled == pytest.approx(eager, rel=1e-4)


def test_trainer_torch_compile_trains_block_by_block(tmp_path):
    """``torch_compile=True``: every decoder layer compiled in place (accelerate compiles nothing), gradient
    checkpointing on; the losses of three steps are the eager Trainer's."""

    def check(trainer, model, compiled):
        assert all((layer._compiled_call_impl is not None) == compiled for layer in model.model.layers)
        assert trainer.model is model  # not wrapped in an OptimizedModule

    _losses_eager_and_compiled(tmp_path, 3, 3, check)


def _fsdp2_compiled_trains_as_eager(rank: int, tmp: Path) -> None:
    """What ``accelerate launch`` hands every process of an FSDP2 config (fp32), here on gloo CPU processes."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_WORLD_SIZE=str(WORLD),
        ACCELERATE_USE_FSDP="true",
        FSDP_VERSION="2",
        ACCELERATE_MIXED_PRECISION="no",
    )
    from torch.distributed.fsdp import FSDPModule

    def check(trainer, model, compiled):
        assert trainer.accelerator.is_fsdp2
        for layer in model.model.layers:  # each layer its own FSDP2 unit, its forward compiled inside it
            assert isinstance(layer, FSDPModule) and (layer._compiled_call_impl is not None) == compiled

    _losses_eager_and_compiled(tmp, 2, 2, check)


@pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")
def test_trainer_torch_compile_under_fsdp2_trains_as_eager(tmp_path):
    """``torch_compile=True`` with accelerate's FSDP2 plugin on 2 processes: the layers are sharded, then compiled
    inside their units (FSDP2's hooks around the compiled forward); two steps' losses are eager FSDP2's."""
    spawn(_fsdp2_compiled_trains_as_eager, tmp_path, timeout_s=300)


def test_engram_hashing_compiles_whole_and_rereads_the_default_map():
    """Whether ``token_map`` holds the default map decides whether ids beyond it fold like the default's; compiled,
    that test is a tensor (a host-side ``torch.equal`` broke the whole model's graph) read from the contents on every
    call, so a map written in place after compiling counts at once, as in eager."""
    hasher = tiny_model(engram_map=None).model.engram_hasher
    vocab, size = hasher.token_map.numel(), hasher.compressed_vocab_size
    ids = torch.tensor([[5, 7, vocab + 3, 11, 2]])
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    hashed, compressed = (torch.compile(f, fullgraph=True, backend=counter) for f in (hasher, hasher.compress))
    assert hasher.uses_default_token_map
    assert torch.equal(hashed(ids), hasher(ids))
    assert torch.equal(compressed(ids), hasher.compress(ids)) and compressed(ids)[0, 2] == (vocab + 3) % size

    with torch.no_grad():
        hasher.token_map.copy_((hasher.token_map + 1) % size)  # written in place: no longer the default
    assert not hasher.uses_default_token_map
    inside = [0, 1, 3, 4]
    assert torch.equal(compressed(ids)[:, inside], hasher.compress(ids[:, inside]))
    assert compressed(ids)[0, 2] != (vocab + 3) % size  # no longer folded (eager raises on that id)
    assert torch.equal(hashed(ids)[:, :2], hasher(ids[:, :2]))
    assert counter.frame_count == 2  # nothing recompiled: the map's contents are read inside the graph


def test_reference_numerics_refuse_to_compile():
    model = tiny_training_model(2)
    model.config.reference_numerics = True
    with pytest.raises(ValueError, match="reference_numerics"):
        compile_blocks(model)
    ids = torch.randint(3, 500, (1, 8))
    with pytest.raises(Exception, match="reference_numerics runs eagerly"):  # fullgraph: the eager call is a break
        torch.compile(model.model.forward, fullgraph=True, backend="eager")(ids)
