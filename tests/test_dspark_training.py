"""Training the DSpark draft head on the frozen backbone's own predictions (``dspark_loss``, the Trainer's
``train_dspark_head``): the teacher-forced training drafts are the decoding drafts, the backbone does not move, the
mixed optimizer gives the head's parameters their kinds by name, and a few steps raise the acceptance."""

import pytest
import torch

from modeling_dsv41.generation.cache import DeepseekV41DSparkCache
from modeling_dsv41.optim.policy import assign_kinds
from modeling_dsv41.training.trainer import DeepseekV41Trainer, DeepseekV41TrainingArguments
from test_dspark_generation import Forwards, dspark_model
from test_generation import random_prompt


def test_teacher_forced_drafts_are_the_decoding_drafts():
    """From every position c of a sequence, the training path's logits and confidences equal those of a decoding
    draft whose rings hold positions ≤ c and whose columns take the same (teacher) tokens. The window is 16: c = 20
    reads a wrapped ring. fp32 weights; the two paths order the ring's slots differently (fp32 rounding)."""
    model = dspark_model()
    ids = random_prompt(24, 11)
    with torch.no_grad():
        out = model(ids, output_dspark_hidden_states=True)
        predictions = out.logits.argmax(-1)
        valid = torch.ones_like(ids, dtype=torch.bool)
        logits, confidence, targets = model.mtp.teacher_forced(
            out.dspark_hidden_states, predictions, valid, model.model.embed, model.lm_head
        )
        assert logits.shape == (1, 24, 4, 512) and targets[0, 22].tolist() == [
            int(predictions[0, 23]),
            -100,
            -100,
            -100,
        ]
        for c in (3, 15, 20):
            rings = DeepseekV41DSparkCache(len(model.mtp), 16)
            model.mtp.write_ring(rings, out.dspark_hidden_states[:, : c + 1], torch.arange(c + 1).unsqueeze(0))
            teacher = lambda column_logits, i: predictions[:, min(c + 1 + i, 23)]  # noqa: E731  (the last is unused)
            _, draft_logits, draft_confidence = model.mtp.draft(
                rings, predictions[:, c], torch.tensor([c]), model.model.embed, model.lm_head, choose=teacher
            )
            torch.testing.assert_close(logits[:, c], draft_logits, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(confidence[:, c], draft_confidence, rtol=1e-4, atol=1e-4)


def test_the_head_gets_its_optimizer_kinds_by_name():
    kinds = assign_kinds(dspark_model())
    assert kinds["mtp.0.main_proj.weight"] == "muon"
    assert kinds["mtp.0.attn.wq_b.weight"] == "muon_headwise"
    assert kinds["mtp.1.ffn.experts.gate_up_proj"] == "muon_headwise"
    assert kinds["mtp.1.markov_head.embed.weight"] == kinds["mtp.1.markov_head.head.weight"] == "sinkhorn"
    assert kinds["mtp.1.confidence_head.proj.weight"] == "adamw"
    assert kinds["mtp.0.hc_attn_fn"] == "muon" and kinds["mtp.0.attn_norm.weight"] == "adamw"


class Sequences(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i])}


def test_trainer_trains_the_head_alone_and_acceptance_rises(tmp_path):
    model = dspark_model()
    prompts = torch.cat([random_prompt(6, s) for s in range(8)])
    # the backbone's own greedy continuations: what it will be asked to draft at decoding time
    sequences = model.generate(prompts, max_new_tokens=26, do_sample=False)
    backbone = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("mtp.")}
    with torch.no_grad():
        before = model.dspark_loss(sequences)
    args = DeepseekV41TrainingArguments(
        output_dir=str(tmp_path),
        train_dspark_head=True,
        max_steps=30,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        report_to=[],
        save_strategy="no",
        logging_steps=10,
        use_cpu=True,
    )
    trainer = DeepseekV41Trainer(model=model, args=args, train_dataset=Sequences(sequences))
    trainer.train()
    assert trainer.router_balancing is None
    with torch.no_grad():
        after = model.dspark_loss(sequences)
    # measured: accuracy 0.001 → 0.54, draft loss 6.27 → 5.36 (the random backbone's logits are far from one-hot)
    assert after.draft_loss < before.draft_loss and after.accuracy > before.accuracy + 0.3, (before, after)
    for name, param in model.named_parameters():
        if name in backbone:
            assert torch.equal(param, backbone[name]), name
    # decoding with the trained head: the same tokens, fewer forwards
    model.eval()
    plain = model.generate(prompts[:2], max_new_tokens=26, do_sample=False)
    forwards = Forwards(model)
    spec = model.generate(prompts[:2], max_new_tokens=26, do_sample=False, use_mtp=True)
    assert torch.equal(spec, plain) and forwards.count < 20, forwards.count


def test_train_dspark_head_needs_the_head(tmp_path):
    from configuration import DeepseekV41Config
    from modeling_dsv41 import DeepseekV41ForCausalLM

    args = DeepseekV41TrainingArguments(output_dir=str(tmp_path), train_dspark_head=True, report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="train_dspark_head needs"):
        DeepseekV41Trainer(model=DeepseekV41ForCausalLM(DeepseekV41Config.from_preset("tiny")), args=args)
