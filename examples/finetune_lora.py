"""Fine-tune the demo model with LoRA, against full fine-tuning at the same number of steps.

The base model is the demo's GPT-style DecoderLM: ``--base runs/demo`` fine-tunes the one ``make demo`` saved (with
its tokenizer); without ``--base`` a small one is pretrained here first on the built-in corpus (the Python standard
library's docstrings) *minus* one topic, networking by default (``--domain``). Both fine-tunings then start from
the same weights, train on the topic's documents for ``--steps`` steps and are evaluated on held-out documents of
the topic. The script reports trainable parameters, the memory of the training state (weights, gradients, AdamW
moments, measured from the tensors) and the validation loss before and after; then it saves the adapter in the
``peft`` layout, loads it onto a fresh copy of the base and checks that the loss is the same.

    python examples/finetune_lora.py                      # a few minutes on 2 CPU cores (pretraining is most of it)
    python examples/finetune_lora.py --base runs/demo --steps 300 --rank 16
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models import DecoderLM
from tokenization import Tokenizer, train_byte_level_bpe
from training import (
    CausalLMCollator,
    Trainer,
    TrainerConfig,
    WarmupCosineLR,
    decay_groups,
    load_corpus,
    packed_examples,
    split_corpus,
)

NETWORKING = r"\b(sockets?|HTTPS?|URLs?|servers?|clients?|requests?)\b"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--base", default=None, help="a saved DecoderLM folder with tokenizer.json (e.g. runs/demo); "
                                                     "default: pretrain one here")
    parser.add_argument("--data", nargs="*", default=None, help=".txt or .jsonl files; default: the built-in corpus")
    parser.add_argument("--domain", default=NETWORKING,
                        help="regular expression (case-insensitive) choosing the fine-tuning documents")
    parser.add_argument("--out", default="runs/finetune_lora", help="folder for the base model and the adapter")
    parser.add_argument("--steps", type=int, default=150, help="fine-tuning steps (the same for LoRA and full)")
    parser.add_argument("--pretrain-steps", type=int, default=300, help="steps of the base model (without --base)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    parser.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (the update is scaled by alpha / r)")
    parser.add_argument("--targets", default="all-linear",
                        help="'all-linear', or comma-separated module names such as q_proj,v_proj")
    parser.add_argument("--lora-lr", type=float, default=3e-3, help="peak learning rate of the LoRA run")
    parser.add_argument("--full-lr", type=float, default=1e-3, help="peak learning rate of the full fine-tuning")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    args = parser.parse_args(argv)
    for name in ("steps", "pretrain_steps", "rank", "vocab_size", "seq_len", "batch_size", "d_model", "layers",
                 "heads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        re.compile(args.domain)
    except re.error as e:
        parser.error(f"--domain {args.domain!r} is not a regular expression: {e}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the example; returns the measured figures of both fine-tunings (see ``compare``)."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    docs = load_corpus(args.data)
    topic = re.compile(args.domain, re.IGNORECASE)
    in_domain = [d for d in docs if topic.search(d)]
    if len(in_domain) < 4:
        raise SystemExit(f"--domain {args.domain!r} selects {len(in_domain)} documents; it needs at least 4")
    tune_docs, val_docs = split_corpus(in_domain, val_fraction=0.1)
    print(f"fine-tuning domain {args.domain!r}: {len(in_domain):,} of {len(docs):,} documents "
          f"({len(tune_docs):,} to train, {len(val_docs):,} held out)")

    if args.base is not None:
        base = DecoderLM.from_pretrained(args.base)
        tokenizer = base.tokenizer
        if tokenizer is None:
            raise SystemExit(f"{args.base} has no tokenizer.json; save the base model with its tokenizer")
        print(f"base: {args.base}, {base.num_parameters():,} parameters")
    else:
        base, tokenizer = pretrain([d for d in docs if not topic.search(d)], args)
        base.save_pretrained(out / "base", tokenizer=tokenizer)
    tune_rows = packed_examples(encode(tokenizer, tune_docs), min(args.seq_len, base.config.max_len))
    val_rows = packed_examples(encode(tokenizer, val_docs), min(args.seq_len, base.config.max_len))
    collator = CausalLMCollator(pad_token_id=tokenizer.pad_token_id)
    base_loss = evaluate(base, val_rows, collator, args)
    print(f"base model on the held-out {len(val_rows)} rows: validation loss {base_loss:.3f}")

    targets = "all-linear" if args.targets == "all-linear" else [t for t in args.targets.split(",") if t]
    lora = copy.deepcopy(base)
    lora.add_adapter("lora", r=args.rank, alpha=args.alpha, target_modules=targets)
    results = {
        "base_loss": base_loss,
        "lora": finetune(lora, tune_rows, val_rows, collator, args, lr=args.lora_lr, label="LoRA"),
        "full": finetune(copy.deepcopy(base).train(), tune_rows, val_rows, collator, args, lr=args.full_lr,
                         label="full"),
    }
    print(compare(results))

    adapter = lora.save_adapter(out / "adapter", base_model=args.base)
    fresh = copy.deepcopy(base)
    fresh.load_adapter(adapter)
    reloaded = evaluate(fresh, val_rows, collator, args)
    size = sum(p.stat().st_size for p in adapter.iterdir())
    modules = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    print(f"adapter saved to {adapter}/ ({size / 1e3:.0f} kB; peft layout, modules {modules}); "
          f"reloaded onto the base: validation loss {reloaded:.3f}")
    results["reloaded_loss"] = reloaded
    results["adapter_bytes"] = size
    return results


def pretrain(docs: list[str], args: argparse.Namespace) -> tuple[DecoderLM, Tokenizer]:
    """A tokenizer and a small DecoderLM (the demo's recipe) trained on ``docs``."""
    tokenizer = train_byte_level_bpe(docs, vocab_size=args.vocab_size)
    rows = packed_examples(encode(tokenizer, docs), args.seq_len)
    model = DecoderLM.from_preset(
        "tiny", vocab_size=tokenizer.vocab_size, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
        d_ff=4 * args.d_model, max_len=args.seq_len, dropout=0.0, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    print(f"pretraining the base model ({model.num_parameters():,} parameters) for {args.pretrain_steps} steps on "
          f"{len(rows):,} rows of the other documents")
    config = TrainerConfig(max_steps=args.pretrain_steps, batch_size=args.batch_size, seed=args.seed,
                           progress=not args.no_progress)
    steps = args.pretrain_steps
    trainer = Trainer(
        model, lambda params: torch.optim.AdamW(decay_groups(params, 0.1), lr=3e-3, betas=(0.9, 0.95)), config,
        rows, CausalLMCollator(pad_token_id=tokenizer.pad_token_id),
        scheduler=partial(WarmupCosineLR, warmup=min(50, steps), total=steps),
    )
    trainer.train()
    return model.eval(), tokenizer


def finetune(
    model: DecoderLM, rows: list, val_rows: list, collator: CausalLMCollator, args: argparse.Namespace, *,
    lr: float, label: str,
) -> dict[str, float]:
    """Train ``model``'s trainable parameters for ``args.steps`` steps; loss, time, parameters and memory."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    # Weight decay on the base model's matrices only: a LoRA's B starts at zero, decay would pull it back there.
    decay = 0.0 if len(trainable) < len(list(model.parameters())) else 0.1
    config = TrainerConfig(max_steps=args.steps, batch_size=args.batch_size, seed=args.seed,
                           progress=not args.no_progress)
    trainer = Trainer(
        model, lambda params: torch.optim.AdamW(decay_groups(params, decay), lr=lr, betas=(0.9, 0.95)), config,
        rows, collator, scheduler=partial(WarmupCosineLR, warmup=min(20, args.steps), total=args.steps),
    )
    start = time.perf_counter()
    history = trainer.train()
    seconds = time.perf_counter() - start
    optimizer_bytes = sum(t.numel() * t.element_size() for state in trainer.optimizer.state.values()
                          for t in state.values() if torch.is_tensor(t))
    result = {
        "trainable": sum(p.numel() for p in trainable),
        "total": model.num_parameters(),
        "weights_mb": _mb(model.parameters()),
        "grads_mb": _mb(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer_mb": optimizer_bytes / 2**20,
        "train_loss": history[-1]["loss"],
        "val_loss": evaluate(model, val_rows, collator, args),
        "seconds_per_step": seconds / args.steps,
    }
    print(f"{label}: trained {args.steps} steps in {seconds:.0f} s; validation loss {result['val_loss']:.3f}")
    return result


def evaluate(model: nn.Module, rows: list, collator: CausalLMCollator, args: argparse.Namespace) -> float:
    """Mean next-token loss over every target token of ``rows``."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(rows), args.batch_size):
            batch = collator(rows[i:i + args.batch_size])
            n = int((batch["labels"][:, 1:] != -100).sum())
            total += float(model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"]).loss) * n
            count += n
    return total / max(count, 1)


def compare(results: dict[str, Any]) -> str:
    """A table of both fine-tunings."""
    lora, full = results["lora"], results["full"]
    rows = [
        ("trainable parameters", f"{lora['trainable']:,} ({lora['trainable'] / lora['total']:.1%})",
         f"{full['trainable']:,} (100%)"),
        ("weights (MB)", f"{lora['weights_mb']:.2f}", f"{full['weights_mb']:.2f}"),
        ("gradients (MB)", f"{lora['grads_mb']:.2f}", f"{full['grads_mb']:.2f}"),
        ("AdamW state (MB)", f"{lora['optimizer_mb']:.2f}", f"{full['optimizer_mb']:.2f}"),
        ("time per step (s)", f"{lora['seconds_per_step']:.3f}", f"{full['seconds_per_step']:.3f}"),
        ("validation loss", f"{lora['val_loss']:.3f}", f"{full['val_loss']:.3f}"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':{width}}  {'LoRA':>20}  {'full fine-tuning':>20}"]
    lines += [f"{name:{width}}  {a:>20}  {b:>20}" for name, a, b in rows]
    lines.append(f"(the base model's validation loss: {results['base_loss']:.3f})")
    return "\n".join(lines)


def encode(tokenizer: Tokenizer, docs: list[str]) -> list[list[int]]:
    """Each document as BOS ... EOS ids."""
    return tokenizer(docs, padding=False, return_tensors=None)["input_ids"]


def _mb(params: Any) -> float:
    return sum(p.numel() * p.element_size() for p in params) / 2**20


if __name__ == "__main__":
    figures = main()
    if not all(math.isfinite(figures[k]["val_loss"]) for k in ("lora", "full")):
        raise SystemExit(1)
