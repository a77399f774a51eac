"""Train the paper's encoder-decoder on a synthetic task and decode held-out inputs with beam search.

The task (``--task``) is copy, reverse (default) or add, generated on the fly (``training.synthetic``). Training
follows *Attention Is All You Need* at a tiny size: label smoothing ε = 0.1 (§5.4), Adam with β = (0.9, 0.98)
and ε = 1e-9 and the Noam learning-rate schedule (§5.3). Held-out sources — none of them seen in training — are
decoded with beam search (4 beams, length penalty 0.6, §6.1) and the exact-match accuracy is printed.

    python examples/translate.py                          # reverse, CPU defaults: a few minutes on 2 cores
    python examples/translate.py --task copy --steps 600
    python examples/translate.py --task add --max-len 3 --steps 4000 --d-model 128
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from models import Seq2SeqTransformer
from training import (
    TASKS,
    NoamLR,
    Seq2SeqCollator,
    SyntheticTask,
    TokenLoss,
    Trainer,
    TrainerConfig,
    cleanup,
    held_out,
    init_distributed,
    paper_adam,
)
from training.synthetic import BOS_ID, EOS_ID, PAD_ID


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--task", choices=TASKS, default="reverse")
    parser.add_argument("--out", default="runs/translate", help="folder for the trained model")
    parser.add_argument("--steps", type=int, default=2500, help="optimiser steps")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--train-size", type=int, default=100_000, help="distinct training examples")
    parser.add_argument("--test-size", type=int, default=500, help="held-out examples to decode")
    parser.add_argument("--n-symbols", type=int, default=10, help="alphabet size of copy/reverse")
    parser.add_argument("--min-len", type=int, default=1)
    parser.add_argument("--max-len", type=int, default=10, help="longest sequence (digits per number for add)")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2, help="encoder and decoder layers each")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=400, help="Noam warmup steps (the paper: 4000)")
    parser.add_argument("--lr-factor", type=float, default=1.0, help="multiplier of the Noam rate")
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "train_size", "test_size", "n_symbols", "min_len", "max_len", "d_model",
                 "layers", "heads", "warmup", "beams"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def train_model(args: argparse.Namespace) -> tuple[Seq2SeqTransformer, SyntheticTask]:
    """Build the task and train the model as the arguments say."""
    torch.manual_seed(args.seed)
    task = SyntheticTask(args.task, args.train_size, n_symbols=args.n_symbols, min_len=args.min_len,
                         max_len=args.max_len, seed=args.seed)
    model = Seq2SeqTransformer.from_preset(
        "tiny", vocab_size=task.vocab_size, d_model=args.d_model, n_heads=args.heads, d_ff=4 * args.d_model,
        n_encoder_layers=args.layers, n_decoder_layers=args.layers, dropout=args.dropout,
        max_len=max(task.max_source_length, task.max_target_length) + 1,
        pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    )
    optimizer = paper_adam(model.parameters())
    scheduler = NoamLR(optimizer, d_model=args.d_model, warmup=args.warmup, factor=args.lr_factor)
    config = TrainerConfig(max_steps=args.steps, batch_size=args.batch_size, max_grad_norm=None, seed=args.seed,
                           progress=not args.no_progress)
    # §5.4: label smoothing; the smoothing mass skips padding, as in the annotated transformer.
    loss = TokenLoss(label_smoothing=args.label_smoothing, exclude_from_smoothing=PAD_ID)
    collator = Seq2SeqCollator(pad_token_id=PAD_ID, decoder_start_token_id=BOS_ID)
    Trainer(model, optimizer, config, task, collator, scheduler=scheduler, loss_fn=loss).train()
    return model, task


def exact_match(model: Seq2SeqTransformer, examples: list[tuple[list[int], list[int]]], beams: int,
                batch_size: int = 100) -> tuple[float, list[tuple[list[int], list[int], list[int]]]]:
    """Beam-search every source; returns the share decoded exactly and ``(source, target, output)`` triples."""
    collator = Seq2SeqCollator(pad_token_id=PAD_ID, decoder_start_token_id=BOS_ID)
    device = next(model.parameters()).device
    model.eval()
    triples = []
    for lo in range(0, len(examples), batch_size):
        chunk = examples[lo: lo + batch_size]
        batch = collator(chunk)
        longest = max(len(t) for _, t in chunk)
        out = model.generate(batch["src_ids"].to(device), batch["src_mask"].to(device), num_beams=beams,
                             max_new_tokens=longest + 5)
        for (source, target), row in zip(chunk, out.tolist(), strict=True):
            body = row[1:]  # drop the decoder start token
            output = body[: body.index(EOS_ID) + 1] if EOS_ID in body else body
            triples.append((source, target, output))
    accuracy = sum(t == o for _, t, o in triples) / len(triples)
    return accuracy, triples


def main(argv: list[str] | None = None) -> float:
    """Run the example; returns the held-out exact-match accuracy."""
    args = parse_args(argv)
    context = init_distributed()
    start = time.perf_counter()
    model, task = train_model(args)
    seconds = time.perf_counter() - start
    accuracy = 0.0
    if context.is_main:
        test = held_out(task, args.test_size, seed=args.seed + 1)
        accuracy, triples = exact_match(model, test, args.beams)
        print(f"{args.task}: trained {args.steps} steps in {seconds:.0f} s; exact match on {len(test)} held-out "
              f"sources (beam search, {args.beams} beams): {accuracy:.1%}")
        for source, target, output in triples[:5]:
            mark = "ok " if output == target else "BAD"
            print(f"  {mark} {task.decode(source):>24} -> {task.decode(output):<24} (expected {task.decode(target)})")
        model.save_pretrained(Path(args.out))
        print(f"saved to {args.out}/")
    cleanup()
    return accuracy


if __name__ == "__main__":
    main()
