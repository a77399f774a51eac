"""DPO and SimPO: losses, rewards and gradients equal TRL's (``DPOTrainer.compute_loss``; ``CPOTrainer``'s SimPO loss
and log-probabilities) on the same tiny Llama and batch; DPO on LoRA takes the base model with adapters off as its
reference; under the Trainer, accumulation gives one big batch's step and a resumed run continues exactly."""

from __future__ import annotations

import copy
from functools import partial
from types import SimpleNamespace

import pytest
import torch

import models
from models.convert.export import to_transformers
from training import Trainer, TrainerConfig
from training.jsonl import read_preferences
from training.preference import PreferenceCollator, PreferenceLoss, sequence_logps

PAIRS = [
    {"prompt": "What is the capital of France?", "chosen": " Paris is the capital.", "rejected": " Berlin."},
    {"prompt": "2+2=", "chosen": "4", "rejected": " the lazy dog jumps"},
    {"prompt": "The quick brown", "chosen": " fox jumps", "rejected": " dog"},
]
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def hf_pair(tiny_llama_dir):
    """(base, policy) as transformers models: the policy is the base with seeded noise on every weight."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    policy = copy.deepcopy(base)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return base, policy


def zoo_twin(tmp_path, hf_model) -> torch.nn.Module:
    """The zoo model holding ``hf_model``'s weights (saved by transformers, loaded by the zoo)."""
    folder = tmp_path / f"twin-{id(hf_model)}"
    hf_model.save_pretrained(folder)
    return models.from_pretrained(folder).eval()


def zoo_grads_as_hf(zoo) -> dict[str, torch.Tensor]:
    """The zoo model's gradients under transformers' names (export a copy whose weights are the gradients)."""
    twin = copy.deepcopy(zoo)
    with torch.no_grad():
        for p, q in zip(twin.parameters(), zoo.parameters(), strict=True):
            p.copy_(q.grad if q.grad is not None else torch.zeros_like(q))
    return to_transformers(twin)[1]


@pytest.fixture(scope="module")
def batch(tiny_llama_dir):
    tok = models.from_pretrained(tiny_llama_dir).tokenizer
    collator = PreferenceCollator(tok)
    return collator, [collator.tokenize(p) for p in PAIRS]


def test_zoo_twin_is_the_same_model(tmp_path, hf_pair, batch) -> None:
    collator, split = batch
    ids = collator(split)
    zoo = zoo_twin(tmp_path, hf_pair[1])
    real = ids["attention_mask"]
    with torch.no_grad():
        torch.testing.assert_close(zoo(ids["input_ids"], real).logits[real],
                                   hf_pair[1](input_ids=ids["input_ids"], attention_mask=real).logits[real], **TOL)


def test_dpo_equals_trl(tiny_llama_dir, hf_pair, batch, tmp_path) -> None:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    base, policy = hf_pair
    policy, ref = copy.deepcopy(policy).train(), copy.deepcopy(base)
    collator, split = batch
    args = DPOConfig(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=len(PAIRS), beta=0.2,
                     use_cpu=True, max_length=None, disable_dropout=True, bf16=False)  # fp32 as ours
    tok = collator.tokenizer
    trl = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(PAIRS[:1]),
                     processing_class=_hf_tokenizer(tiny_llama_dir))
    trl_batch = DataCollatorForPreference(pad_token_id=tok.pad_token_id)(split)
    trl_loss = trl.compute_loss(policy, trl_batch)
    trl_loss.backward()
    metrics = {k: v[-1] for k, v in trl._metrics["train"].items()}

    zoo = zoo_twin(tmp_path, policy).train()
    loss_fn = PreferenceLoss(zoo, "dpo", beta=0.2, reference=zoo_twin(tmp_path, trl.ref_model))
    ours = collator(split)
    assert torch.equal(ours["input_ids"], trl_batch["input_ids"])
    assert torch.equal(ours["completion_mask"], trl_batch["completion_mask"].bool())
    loss = loss_fn(zoo, ours) / loss_fn.count(ours)
    loss.backward()
    assert loss.item() == pytest.approx(trl_loss.item(), abs=1e-5)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected"):
        assert loss_fn.metrics[key] == pytest.approx(metrics[key], abs=1e-5), key
    assert abs(metrics["rewards/margins"]) > 1e-2  # the policy is not its reference: the rewards mean something
    grads = zoo_grads_as_hf(zoo)
    for name, p in policy.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=name)


def test_simpo_equals_trl(tmp_path, hf_pair, batch) -> None:
    from trl.experimental.cpo import CPOTrainer

    policy = copy.deepcopy(hf_pair[1]).train()
    collator, split = batch
    ids = collator(split)
    labels = ids["input_ids"].masked_fill(~ids["completion_mask"], -100)
    logits = policy(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).logits
    logps = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    stub = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=0.7, beta=2.0, label_smoothing=0.1,
                           accelerator=SimpleNamespace(device=torch.device("cpu")))
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(stub, *logps.chunk(2))
    losses.mean().backward()

    zoo = zoo_twin(tmp_path, policy).train()
    loss_fn = PreferenceLoss(zoo, "simpo", beta=2.0, gamma=0.7, label_smoothing=0.1)
    ours, ours_chosen, ours_rejected = loss_fn.pair_losses(zoo, ids)
    torch.testing.assert_close(ours.detach(), losses.detach(), **TOL)
    torch.testing.assert_close(ours_chosen, chosen_rewards, **TOL)
    torch.testing.assert_close(ours_rejected, rejected_rewards, **TOL)
    (loss_fn(zoo, ids) / loss_fn.count(ids)).backward()
    grads = zoo_grads_as_hf(zoo)
    for name, p in policy.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=name)


def _hf_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def lora_model(folder):
    model = models.from_pretrained(folder)
    torch.manual_seed(0)  # the same lora_A in every run
    model.add_adapter(r=4, target_modules="all-linear")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def test_dpo_with_lora_takes_the_base_as_reference(tiny_llama_dir, batch) -> None:
    collator, split = batch
    ids = collator(split)
    model = lora_model(tiny_llama_dir)
    loss_fn = PreferenceLoss(model, "dpo", beta=0.5)
    assert loss_fn.reference is None  # no second copy
    base = models.from_pretrained(tiny_llama_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(loss_fn.reference_logps(model, ids), sequence_logps(base, ids), atol=0, rtol=0)
        assert not torch.allclose(sequence_logps(model, ids), sequence_logps(base, ids))  # the adapter runs again
    loss_fn(model, ids).backward()
    assert all((p.grad is not None) == (".adapters." in n) for n, p in model.named_parameters())


def test_the_reference_copy_stays_whole_in_one_process_and_must_be_frozen(tiny_llama_dir, batch) -> None:
    # Sharding itself is tested under FSDP2 in tests/training/test_parallel.py (two processes equal one).
    from training.preference_sharding import shard_reference_like

    collator, split = batch
    model = models.from_pretrained(tiny_llama_dir)
    loss_fn = PreferenceLoss(model, "dpo", beta=0.5)
    assert loss_fn.owns_reference and loss_fn(model, collator(split)).isfinite()
    assert not loss_fn.reference_sharded  # one process: nothing to shard
    assert all(type(p) is torch.nn.Parameter for p in loss_fn.reference.parameters())
    with pytest.raises(ValueError, match="must be frozen"):
        shard_reference_like(models.from_pretrained(tiny_llama_dir), model)


def run(folder, tmp_path, *, batch_size, accum, steps=4, resume=None):
    model = lora_model(folder)
    tok = model.tokenizer
    config = TrainerConfig(max_steps=steps, batch_size=batch_size, grad_accum_steps=accum, progress=False,
                           checkpoint_dir=str(tmp_path), checkpoint_every=2, device="cpu", shuffle=False)
    loss_fn = PreferenceLoss(model, "dpo", beta=0.5)
    trainer = Trainer(model, partial(torch.optim.AdamW, lr=1e-2), config, PAIRS + PAIRS[:1],
                      PreferenceCollator(tok), loss_fn=loss_fn)
    if resume is not None:
        trainer.load_checkpoint(resume)
    return trainer.train(), model


def test_dpo_under_the_trainer_accumulates_and_resumes_exactly(tiny_llama_dir, tmp_path) -> None:
    whole, model = run(tiny_llama_dir, tmp_path / "a", batch_size=4, accum=1, steps=2)
    split, model2 = run(tiny_llama_dir, tmp_path / "b", batch_size=2, accum=2, steps=2)
    assert [h["loss"] for h in split] == pytest.approx([h["loss"] for h in whole], abs=1e-5)
    for (n, p), q in zip(model.named_parameters(), model2.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5, msg=n)
    full, _ = run(tiny_llama_dir, tmp_path / "c", batch_size=2, accum=1)
    later, _ = run(tiny_llama_dir, tmp_path / "c", batch_size=2, accum=1,
                   resume=sorted((tmp_path / "c").iterdir())[0])
    assert [h["loss"] for h in later[-2:]] == pytest.approx([h["loss"] for h in full[-2:]], abs=1e-6)


@pytest.mark.parametrize(("line", "message"), [
    ('{"prompt": "a", "chosen": "b"}', r"missing \['rejected'\]"),
    ('{"prompt": "a", "chosen": " ", "rejected": "c"}', "'chosen' is empty"),
    ('{"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant", "content": "c"}]}', "all be strings"),
    ('{"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "user", "content": "b"}], '
     '"rejected": [{"role": "assistant", "content": "c"}]}', "assistant"),
    ("not json", "not JSON"),
])
def test_bad_preference_files_name_the_line(tmp_path, line: str, message: str) -> None:
    path = tmp_path / "prefs.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"prefs\.jsonl, line 2.*{message}"):
        read_preferences(path)
