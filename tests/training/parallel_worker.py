"""Run by ``test_parallel.py`` under ``torchrun`` on CPU processes (gloo).

``two`` (2 processes): FSDP2 training with a sharded checkpoint at step 2 and a consolidated export at the
end; tensor-parallel forward and backward against the unsharded model (GQA + rotary + SwiGLU, and ALiBi);
a checkpoint written by one process resumed on a 1 x 2 FSDP + TP mesh; DPO (its reference copy sharded too) and
SimPO under FSDP2, DPO on the 1 x 2 FSDP + TP mesh (given a checkpoint). ``four`` (4 processes): 2 x 2 FSDP + TP
training. ``build`` and ``build_dpo`` are shared with the single-process references in the test.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import safetensors.torch
import torch

from models import DecoderLM, EncoderLM
from training import CausalLMCollator, Trainer, TrainerConfig, WarmupCosineLR, cleanup, init_distributed
from training.parallel import apply_parallelism, consolidated_state_dict

GLOBAL_BATCH = 4
CONFIG = dict(vocab_size=40, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, n_layers=2, max_len=32, dropout=0.0,
              positional="rotary", ffn="swiglu", norm="rmsnorm")


#: A mixture-of-experts model (3 experts, top 2, load-balancing loss in the training loss).
MOE_CONFIG = {**CONFIG, "ffn": "moe", "options": {"ffn": {"n_experts": 3, "top_k": 2, "aux_loss_coef": 0.05}}}


def build(out: Path, parallel: str = "ddp", processes: int = 1, tp_size: int | None = None, moe: bool = False,
          grad_accum_steps: int = 1) -> Trainer:
    """The same model, data and AdamW in every process; each data-parallel replica reads its slice."""
    torch.manual_seed(0)
    model = DecoderLM.from_preset("tiny", **(MOE_CONFIG if moe else CONFIG))
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 14, (32,), generator=g).tolist()
    data = [[2] + torch.randint(5, 40, (k,), generator=g).tolist() + [3] for k in lengths]
    dp = {"tp": 1, "fsdp+tp": processes // (tp_size or 1)}.get(parallel, processes)
    config = TrainerConfig(max_steps=4, batch_size=GLOBAL_BATCH // dp // grad_accum_steps,
                           grad_accum_steps=grad_accum_steps, max_grad_norm=0.5, progress=False,
                           device="cpu", checkpoint_dir=str(out), parallel=parallel, tp_size=tp_size)
    return Trainer(model, functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1), config, data,
                   CausalLMCollator(pad_token_id=0), scheduler=lambda opt: WarmupCosineLR(opt, warmup=2, total=4))


#: Preference pairs for DPO under FSDP2 (``build_dpo``): a global batch of 4 pairs per step.
PAIRS = [
    {"prompt": "What is the capital of France?", "chosen": " Paris is the capital.", "rejected": " Berlin."},
    {"prompt": "2+2=", "chosen": "4", "rejected": " the lazy dog jumps"},
    {"prompt": "The quick brown", "chosen": " fox jumps", "rejected": " dog"},
    {"prompt": "Paris is", "chosen": " the capital of France.", "rejected": " 6"},
] * 2


def build_dpo(checkpoint: Path, parallel: str = "ddp", processes: int = 1, method: str = "dpo",
              tp_size: int | None = None) -> Trainer:
    """Full fine-tuning with DPO (the reference: a frozen copy made before sharding, sharded at the first batch) or
    SimPO (``method="simpo"``, no reference) on the tiny Llama at ``checkpoint``, global batches of 4 pairs."""
    import models
    from training.preference import PreferenceCollator, PreferenceLoss

    torch.manual_seed(0)
    model = models.from_pretrained(checkpoint)
    dp = processes // (tp_size or 1)
    config = TrainerConfig(max_steps=2, batch_size=GLOBAL_BATCH // dp, max_grad_norm=1.0, progress=False,
                           device="cpu", shuffle=False, parallel=parallel, tp_size=tp_size)
    return Trainer(model, functools.partial(torch.optim.AdamW, lr=1e-2), config, PAIRS,
                   PreferenceCollator(model.tokenizer), loss_fn=PreferenceLoss(model, method, beta=0.5, gamma=0.3))


def tensor_parallel_matches(model_class: type, **config) -> None:
    """Logits and every gradient of the sharded model equal the unsharded model's (each process checks)."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(1)
    reference = model_class.from_preset("tiny", **config)
    sharded = model_class.from_preset("tiny", **config)
    sharded.load_state_dict(reference.state_dict())
    apply_parallelism(sharded, "tp", torch.device("cpu"))
    ids = torch.randint(5, 40, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 6:] = False
    want, got = reference(ids, attention_mask=mask, labels=ids), sharded(ids, attention_mask=mask, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    want.loss.backward()
    got.loss.backward()
    checked = 0
    for (name, p), q in zip(sharded.named_parameters(), reference.parameters(), strict=True):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
        checked += isinstance(p, DTensor)
    assert checked >= 7 * config["n_layers"], checked  # q, k, v, o, up, (gate), down of every layer were sharded


def main(scenario: str, out: Path, dpo_checkpoint: str | None = None) -> None:
    context = init_distributed("gloo", timeout_s=60)
    results: dict[str, object] = {}
    if scenario == "two":
        trainer = build(out / "fsdp", "fsdp", processes=2)
        trainer.train(until=2)
        trainer.save_checkpoint()
        step2 = consolidated_state_dict(trainer.model)
        trainer.train()
        results["fsdp_losses"] = [r["loss"] for r in trainer.history]
        trainer.save_pretrained(out / "export")
        if context.is_main:
            safetensors.torch.save_file({k: v.contiguous() for k, v in step2.items() if k != "lm_head.weight"},
                                        str(out / "fsdp_step2.safetensors"))

        tensor_parallel_matches(DecoderLM, **CONFIG)
        tensor_parallel_matches(EncoderLM, **{**CONFIG, "positional": "alibi", "ffn": "gelu", "n_kv_heads": 4})

        resumed = build(out / "single", "fsdp+tp", processes=2, tp_size=2)
        resumed.load_checkpoint("latest", allow_world_size_change=True)
        loaded = consolidated_state_dict(resumed.model)
        saved = safetensors.torch.load_file(str(out / "single_step2.safetensors"))
        results["bit_exact_from_one"] = all(torch.equal(loaded[k], v) for k, v in saved.items())
        resumed.train()
        results["resumed_losses"] = [r["loss"] for r in resumed.history]

        if dpo_checkpoint:  # DPO and SimPO through the Trainer under FSDP2 (the same processes: no second launch)
            from torch.distributed.tensor import DTensor

            for method in ("dpo", "simpo"):
                tuned = build_dpo(Path(dpo_checkpoint), "fsdp", processes=2, method=method)
                tuned.train()
                results[f"{method}_losses"] = [r["loss"] for r in tuned.history]
                final = consolidated_state_dict(tuned.model)
                if context.is_main:
                    safetensors.torch.save_file({k: v.contiguous() for k, v in final.items()},
                                                str(out / f"{method}_final.safetensors"))
                reference = tuned.loss_fn.reference
                if reference is not None:  # DPO's frozen copy: this process holds its shard of each weight only
                    results["reference_sharded"] = tuned.loss_fn.reference_sharded
                    results["reference"] = {
                        name: [type(p).__name__, list(p.to_local().shape if isinstance(p, DTensor) else p.shape),
                               list(p.shape)] for name, p in reference.named_parameters()}
            # On a 1 x 2 FSDP + TP mesh the reference copy is split by tensor parallelism like the model.
            tuned = build_dpo(Path(dpo_checkpoint), "fsdp+tp", processes=2, tp_size=2)
            tuned.train()
            results["dpo_tp_losses"] = [r["loss"] for r in tuned.history]
            results["tp_reference"] = {name: list(p.to_local().shape) for name, p in
                                       tuned.loss_fn.reference.named_parameters() if name.endswith("q_proj.weight")}
    elif scenario == "moe":
        trainer = build(out / "moe", "fsdp", processes=2, moe=True)
        trainer.train()
        results["losses"] = [r["loss"] for r in trainer.history]
        final = consolidated_state_dict(trainer.model)  # a collective: every process takes part
        if context.is_main:
            safetensors.torch.save_file({k: v.contiguous() for k, v in final.items() if k != "lm_head.weight"},
                                        str(out / "moe_final.safetensors"))
    elif scenario == "four":
        trainer = build(out / "four", "fsdp+tp", processes=4, tp_size=2)
        trainer.train(until=3)
        results["losses"] = [r["loss"] for r in trainer.history]
        results["dp_size"], results["tp_size"] = trainer.layout.dp_size, trainer.layout.tp_size
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    if context.is_main:
        (out / f"{scenario}.json").write_text(json.dumps(results))
    cleanup()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])
