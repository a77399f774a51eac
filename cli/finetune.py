"""``zoo finetune``: supervised fine-tuning on chat data and preference tuning, resumable.

    zoo finetune ./base --data chat.jsonl --method sft --lora --out runs/sft --steps 200
    zoo finetune runs/sft/model --data prefs.jsonl --method dpo --beta 0.1 --lora --out runs/dpo
    zoo finetune ./base --data prefs.jsonl --method simpo --beta 2 --gamma 1 --out runs/simpo

``--data`` is JSON Lines: ``{"messages": [...]}`` per line for ``sft`` (the loss on the assistant's tokens, whole
conversations packed into rows of ``--max-length``), ``{"prompt", "chosen", "rejected"}`` for ``dpo`` and ``simpo``.
Checkpoints go to ``OUT/checkpoints`` every ``--checkpoint-every`` steps; running the same command again continues
from the newest one (``--restart`` starts over). The result is ``OUT/adapter`` (with ``--lora``: the adapter in
peft's layout, for ``zoo merge`` or ``zoo eval --adapter``) or ``OUT/model`` (a full checkpoint).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

METHODS = ("sft", "dpo", "simpo")


def add_commands(sub: Any) -> dict[str, Callable[[argparse.Namespace], None]]:
    """Add ``finetune`` to the subparsers ``sub`` of the ``zoo`` command.

    Args:
        sub: what ``ArgumentParser.add_subparsers`` returned.

    Returns:
        ``{"finetune": handler}``.
    """
    p = sub.add_parser("finetune", help="fine-tune a model on chat data (sft) or preference pairs (dpo, simpo)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a checkpoint folder, Hub repo id or .gguf file")
    p.add_argument("--data", required=True, help="a JSON Lines file (see above)")
    p.add_argument("--method", choices=METHODS, default="sft")
    p.add_argument("--out", required=True, help="the run's folder (checkpoints and the result)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=4, help="examples per micro-batch (pairs for dpo/simpo)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 2e-4 with --lora, else 1e-5)")
    p.add_argument("--schedule", choices=("constant", "cosine"), default="constant",
                   help="the learning rate: constant after the warmup, or a cosine decay to a tenth at --steps")
    p.add_argument("--warmup", type=int, default=0, help="steps of linear warmup from 0 to --lr")
    p.add_argument("--max-length", type=int, default=None, help="tokens per row (default: the model's context)")
    p.add_argument("--no-pack", action="store_true", help="sft: one conversation per row instead of packing")
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter instead of every weight")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--lora-targets", default="all-linear",
                   help="'all-linear' or comma-separated module names (e.g. q_proj,v_proj)")
    p.add_argument("--beta", type=float, default=None, help="dpo/simpo β (default 0.1 for dpo, 2.0 for simpo)")
    p.add_argument("--gamma", type=float, default=0.5, help="simpo's target margin γ")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--restart", action="store_true", help="delete OUT/checkpoints and start over")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return {"finetune": run}


def build(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model (adapter added with ``--lora``) and its ``Trainer`` for the parsed arguments.

    Args:
        args: the parsed ``zoo finetune`` options.

    Returns:
        ``(model, trainer)``: the model to train and a ``Trainer`` over the data read from ``--data``.

    Raises:
        ValueError: a bad value or data file (naming it).
    """
    import torch

    import models
    from training import Trainer, TrainerConfig, WarmupCosineLR
    from training.chat_sft import ChatSFTCollator, ChatSFTDataset
    from training.jsonl import read_preferences
    from training.preference import PreferenceCollator, PreferenceLoss

    for name in ("steps", "batch_size", "grad_accum", "checkpoint_every", "lora_r"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be an integer >= 0, got {args.warmup}")
    torch.manual_seed(args.seed)
    model = models.from_pretrained(args.model)
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer; fine-tuning reads text")
    if args.lora:
        targets = args.lora_targets if args.lora_targets == "all-linear" else args.lora_targets.split(",")
        model.add_adapter(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout, target_modules=targets)
    max_length = args.max_length or int(model.config.max_len)
    if args.method == "sft":
        data: Any = ChatSFTDataset.from_jsonl(args.data, tokenizer, max_length=max_length)
        collate: Any = ChatSFTCollator(tokenizer.pad_token_id, max_length=max_length, pack=not args.no_pack)
        loss_fn = None
    else:
        data = read_preferences(args.data)
        collate = PreferenceCollator(tokenizer, max_length=max_length)
        data = [collate.tokenize(pair) for pair in data]  # tokenized once, bad pairs reported before training
        beta = args.beta if args.beta is not None else (0.1 if args.method == "dpo" else 2.0)
        loss_fn = PreferenceLoss(model, args.method, beta=beta, gamma=args.gamma)
    lr = args.lr if args.lr is not None else (2e-4 if args.lora else 1e-5)
    config = TrainerConfig(max_steps=args.steps, batch_size=min(args.batch_size, len(data)),
                           grad_accum_steps=args.grad_accum, checkpoint_dir=str(Path(args.out) / "checkpoints"),
                           checkpoint_every=args.checkpoint_every, progress=not args.no_progress, seed=args.seed)
    scheduler = None
    if args.schedule == "cosine":
        scheduler = functools.partial(WarmupCosineLR, warmup=args.warmup, total=args.steps)
    elif args.warmup:
        scheduler = functools.partial(WarmupCosineLR, warmup=args.warmup, total=args.steps, min_ratio=1.0)
    trainer = Trainer(model, functools.partial(torch.optim.AdamW, lr=lr), config, data, collate, loss_fn=loss_fn,
                      scheduler=scheduler)
    return model, trainer


def run(args: argparse.Namespace) -> None:
    """Run ``zoo finetune`` (see the module docstring); a bad argument or data file exits with its message.

    Args:
        args: the parsed ``zoo finetune`` options.

    Raises:
        SystemExit: ``build`` refused an argument or the data file.
    """
    from models.checkpoints.atomic import write_file
    from training import list_checkpoints

    out = Path(args.out)
    if args.restart and (out / "checkpoints").exists():
        shutil.rmtree(out / "checkpoints")
    try:
        model, trainer = build(args)
    except ValueError as err:
        raise SystemExit(f"zoo finetune: {err}") from None
    done = list_checkpoints(out / "checkpoints")
    if done:
        print(f"resuming from {done[-1]}")
        trainer.load_checkpoint(done[-1])
    history = trainer.train()
    if trainer.step % args.checkpoint_every:
        trainer.save_checkpoint()
    if args.lora:
        target = model.save_adapter(out / "adapter", base_model=str(args.model))
    else:
        target = trainer.save_pretrained(out / "model", tokenizer=model.tokenizer)
    summary = {"method": args.method, "steps": trainer.step, "result": str(target),
               "loss": history[-1]["loss"] if history else None}
    metrics = getattr(trainer.loss_fn, "metrics", None)
    if metrics:
        summary.update(metrics)
    write_file(out / "summary.json", json.dumps(summary, indent=2) + "\n")  # atomic: old or new file
    print(json.dumps(summary))
