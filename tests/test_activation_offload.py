"""Activation offloading (training/offload.py): the checkpointed layers' inputs in host memory until their backward,
each shared tensor copied once, the same gradients; the Trainer's ``offload_activations`` and its refusals.

This machine has no accelerator, and a CPU tensor already lives in host memory, so the tests that check the copies
treat CPU tensors as device tensors (``HostOffload.in_host_memory``); benchmarks/memory.py --train --device cuda
measures the device memory it saves."""

from __future__ import annotations

import weakref

import pytest
import torch
from tiny_models import tiny_training_model

from modeling_dsv41.training.activation_memory import activation_peak
from modeling_dsv41.training.offload import HostOffload, offload_checkpointed_inputs
from modeling_dsv41.training.trainer import DeepseekV41Trainer, DeepseekV41TrainingArguments

SEQ = 48


def checkpointed_model():
    model = tiny_training_model(6).to(torch.bfloat16).train()
    model.activation_checkpointing_enable()
    return model


def step(model, ids):
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def offloading_cpu_tensors(monkeypatch):
    """Copies CPU tensors as if they lived on an accelerator, and records what was packed and copied."""
    packed, copies = [], []
    pack = HostOffload._pack

    def recording(self, tensor):
        device, host = pack(self, tensor)
        packed.append(weakref.ref(tensor))
        if not any(host is copy() for copy in copies):
            copies.append(weakref.ref(host))
        return device, host

    monkeypatch.setattr(HostOffload, "in_host_memory", staticmethod(lambda tensor: False))
    monkeypatch.setattr(HostOffload, "_pack", recording)
    return packed, copies


def test_offloading_moves_every_checkpointed_input_once_and_keeps_the_gradients(offloading_cpu_tensors):
    packed, copies = offloading_cpu_tensors
    ids = torch.randint(3, 500, (2, SEQ), generator=torch.Generator().manual_seed(0))
    model = checkpointed_model()
    expected = step(model, ids)
    offload_checkpointed_inputs(model)
    offload_checkpointed_inputs(model)  # idempotent: one host copy, not two
    assert not packed
    grads = step(model, ids)
    assert grads.keys() == expected.keys()
    for name, grad in expected.items():
        assert torch.equal(grads[name], grad), name  # the same values come back

    # one forward: every decoder layer's inputs went to the host, the originals are gone once it is over
    packed.clear(), copies.clear()
    loss = model(ids, labels=ids).loss
    layers = model.config.text_config.num_hidden_layers
    assert len(packed) >= 2 * layers  # each layer's stream and pre-mix at least
    assert all(original() is None for original in packed)
    host_bytes = sum(copy().untyped_storage().nbytes() for copy in copies)
    # shared tensors (rotations, compressed context, Engram rows) are copied once, not once per layer
    assert len(copies) < len(packed)
    planned = activation_peak(model.config.text_config, SEQ, batch_size=2, rank=0, offload_activations=True)
    assert planned.host_bytes == pytest.approx(host_bytes, rel=0.10)
    loss.backward()
    assert all(copy() is None for copy in copies)  # released by the backward


def test_offloading_needs_checkpointed_layers():
    with pytest.raises(ValueError, match="enable gradient checkpointing"):
        offload_checkpointed_inputs(tiny_training_model(2))


def test_a_host_tensor_stays_where_it_is():
    hooks = HostOffload()
    tensor = torch.randn(3)
    device, kept = hooks._pack(tensor)
    assert kept is tensor and hooks._unpack((device, kept)) is tensor


def test_the_trainer_offloads_when_asked(tmp_path):
    with pytest.raises(ValueError, match="activation_checkpointing=True"):
        DeepseekV41TrainingArguments(output_dir=str(tmp_path), offload_activations=True)
    with pytest.raises(ValueError, match="keep one"):
        DeepseekV41TrainingArguments(
            output_dir=str(tmp_path),
            offload_activations=True,
            activation_checkpointing=True,
            activation_checkpointing_kwargs={"offload": True},
        )
    args = DeepseekV41TrainingArguments(
        output_dir=str(tmp_path),
        offload_activations=True,
        activation_checkpointing=True,
        max_steps=1,
        per_device_train_batch_size=1,
        report_to=[],
        save_strategy="no",
        bias_update_speed=0,
    )
    ids = torch.randint(3, 500, (SEQ,), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ids, "labels": ids}]
    trainer = DeepseekV41Trainer(model=tiny_training_model(2), args=args, train_dataset=data)
    trainer.train()
    layers = trainer.model.model.layers
    assert all(getattr(layer._gradient_checkpointing_func, "offloads_to_host", False) for layer in layers)
