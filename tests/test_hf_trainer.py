"""transformers' Trainer on a tiny converted delta model: activation checkpointing in both
reentrant settings, routing parameters kept out of weight decay, save, exact resume, reload."""

import pytest
import torch
from train_setup import convert_tiny_llama

from mhar_hf.folder import is_routing_parameter
from mhar_hf.tiny import demo_corpus
from mhar_hf.train import no_weight_decay_on_routing

STEPS = 4


class TokenRows(torch.utils.data.Dataset):
    """The demo text as rows of 32 tokens (labels = inputs: the model shifts them)."""

    def __init__(self, tokenizer, length=32):
        ids = torch.tensor(tokenizer(demo_corpus())["input_ids"])
        self.rows = ids[: len(ids) // length * length].view(-1, length)[:16]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def make_trainer(model_path, output, data, reentrant, resume_hook=True):
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import mhar_hf  # noqa: F401  (registers the model type)

    model = AutoModelForCausalLM.from_pretrained(model_path)
    args = TrainingArguments(
        output_dir=str(output), max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-2,
        weight_decay=0.1, lr_scheduler_type="constant", logging_steps=1, save_steps=2, report_to="none",
        use_cpu=True, seed=0, data_seed=0, activation_checkpointing=True,
        activation_checkpointing_kwargs={"use_reentrant": reentrant}, dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    return no_weight_decay_on_routing(trainer) if resume_hook else trainer


def losses(trainer):
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


@pytest.mark.parametrize("reentrant", [False, True])
def test_trainer_trains_every_parameter_resumes_exactly_and_reloads(tmp_path, tokenizer, reentrant):
    from transformers import AutoModelForCausalLM

    model_path = convert_tiny_llama(tmp_path / "converted", tokenizer)
    data = TokenRows(tokenizer)
    initial = {n: p.detach().clone() for n, p in AutoModelForCausalLM.from_pretrained(model_path).named_parameters()}

    trainer = make_trainer(model_path, tmp_path / "run", data, reentrant)
    trainer.train()
    decay_of = {id(p): group["weight_decay"] for group in trainer.optimizer.param_groups for p in group["params"]}
    trained = dict(trainer.model.named_parameters())
    for name, param in trained.items():
        assert decay_of[id(param)] == (0.0 if is_routing_parameter(name) or param.ndim < 2 else 0.1), name
        # under checkpointing every parameter learns: the gates open, then the rest follows
        assert not torch.equal(param.detach(), initial[name]), f"{name} did not move"

    resumed = make_trainer(model_path, tmp_path / "run", data, reentrant)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    uninterrupted, continued = losses(trainer), losses(resumed)
    assert [e["step"] for e in resumed.state.log_history if "loss" in e] == [1, 2, 3, 4]  # 1, 2 from the checkpoint
    for step in (3, 4):
        assert continued[step] == pytest.approx(uninterrupted[step], rel=1e-5)

    resumed.save_model(str(tmp_path / "final"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    for name, param in reloaded.named_parameters():
        assert torch.equal(param, resumed.model.get_parameter(name).detach()), name


def test_without_the_hook_trainer_decays_the_gates(tmp_path, tokenizer):
    model_path = convert_tiny_llama(tmp_path / "converted", tokenizer)
    trainer = make_trainer(model_path, tmp_path / "run", TokenRows(tokenizer), False, resume_hook=False)
    decayed = set(trainer.get_decay_parameter_names(trainer.model))
    assert "model.layers.1.attn_router.gate" in decayed  # what the hook is for
    hooked = no_weight_decay_on_routing(trainer)
    assert not any(is_routing_parameter(name) for name in hooked.get_decay_parameter_names(trainer.model))
    trainer.create_optimizer()
    with pytest.raises(ValueError, match="before trainer.train"):
        no_weight_decay_on_routing(trainer)
