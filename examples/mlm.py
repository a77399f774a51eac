"""Train a WordPiece tokenizer and a small BERT-style EncoderLM with masked language modelling, then fill masks.

With no ``--data`` the text is the built-in corpus (the standard library's docstrings, no download). Documents
are cut into windows of ``--seq-len`` tokens framed by ``[BOS] … [EOS]`` (BERT's ``[CLS] … [SEP]`` seats);
15% of the tokens are chosen for prediction (80% ``[MASK]``, 10% random, 10% unchanged). The validation MLM
loss is printed next to the unigram baseline — the loss of always predicting the training-set token
frequencies — and the model, saved with its tokenizer and reloaded, fills the ``[MASK]`` in sample sentences.

    python examples/mlm.py                                # CPU defaults: a few minutes on 2 cores
    python examples/mlm.py --whole-word-mask --steps 2000 --out runs/bert
    python examples/mlm.py --sentence "Return a [MASK] of the list."
"""

from __future__ import annotations

import argparse
import math
import time
from collections import Counter
from pathlib import Path

import torch

import blocks
from models import EncoderLM
from tokenization import Tokenizer, train_wordpiece
from training import (
    MLMCollator,
    Trainer,
    TrainerConfig,
    WarmupCosineLR,
    cleanup,
    init_distributed,
    load_corpus,
    split_corpus,
)

SENTENCES = [
    "Return the [MASK] of the list.",
    "Raise a [MASK] if the file does not exist.",
    "This function returns true if the object is an [MASK] of the class.",
    "The default [MASK] is none.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data", nargs="*", default=None,
                        help="text (.txt: one document per paragraph) or .jsonl files; default: the built-in corpus")
    parser.add_argument("--text-field", default="text", help="the JSONL field holding the text")
    parser.add_argument("--out", default="runs/mlm", help="folder for the model and tokenizer")
    parser.add_argument("--steps", type=int, default=1200, help="optimiser steps")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per window, [BOS] and [EOS] included")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--sublayer", choices=["post_norm", "pre_norm"], default="post_norm",
                        help="BERT's post-norm, or pre-norm (often easier to train)")
    parser.add_argument("--positional", choices=blocks.names("positional"), default="rotary",
                        help="position encoding (BERT: learned; rotary learns word order much sooner at this size)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--whole-word-mask", action="store_true", help="mask whole words instead of tokens")
    parser.add_argument("--sentence", action="append", default=None, help="sentence with [MASK] to fill (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    for name in ("steps", "vocab_size", "batch_size", "d_model", "layers", "heads", "warmup"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.seq_len < 3:
        parser.error(f"--seq-len must be >= 3 (room for [BOS], a token and [EOS]), got {args.seq_len}")
    return args


def windows(tokenizer: Tokenizer, docs: list[str], seq_len: int) -> list[dict[str, list[int]]]:
    """Every document cut into ``[BOS] piece [EOS]`` examples of at most ``seq_len`` tokens, with word ids
    (``-1`` on the special tokens) for whole-word masking."""
    enc = tokenizer(docs, padding=False, return_tensors=None, add_special_tokens=False, return_word_ids=True)
    bos, eos, size = tokenizer.bos_token_id, tokenizer.eos_token_id, seq_len - 2
    examples = []
    for ids, words in zip(enc["input_ids"], enc["word_ids"], strict=True):
        for lo in range(0, len(ids), size):
            piece, piece_words = ids[lo: lo + size], words[lo: lo + size]
            first = piece_words[0]
            # Word ids restart in each window, so they index a small per-row table in the collator.
            examples.append({"input_ids": [bos] + piece + [eos],
                             "word_ids": [-1] + [w - first for w in piece_words] + [-1]})
    return examples


def unigram_loss(train: list[dict[str, list[int]]], val: list[dict[str, list[int]]], tokenizer: Tokenizer) -> float:
    """Cross-entropy (nats per token) of predicting every non-special validation token from the training
    frequencies (add-one smoothed) — the loss of a model that ignores context. MLM targets are a uniform sample
    of exactly these tokens, so this is the baseline for the MLM loss."""
    special = set(tokenizer.all_special_ids)
    counts = Counter(t for e in train for t in e["input_ids"] if t not in special)
    total = sum(counts.values()) + tokenizer.vocab_size - len(special)
    val_tokens = [t for e in val for t in e["input_ids"] if t not in special]
    return -sum(math.log((counts[t] + 1) / total) for t in val_tokens) / len(val_tokens)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the example; returns ``{"val_loss", "unigram_loss", "train_seconds"}``."""
    args = parse_args(argv)
    context = init_distributed()
    torch.manual_seed(args.seed)
    say = print if context.is_main else (lambda *a, **k: None)

    docs = load_corpus(args.data, text_field=args.text_field)
    train_docs, val_docs = split_corpus(docs, val_fraction=0.05)
    tokenizer = train_wordpiece(train_docs, vocab_size=args.vocab_size)
    train_set, val_set = (windows(tokenizer, d, args.seq_len) for d in (train_docs, val_docs))
    say(f"corpus: {len(docs):,} documents -> {len(train_set):,} training and {len(val_set):,} validation windows; "
        f"WordPiece vocabulary {tokenizer.vocab_size}")

    model = EncoderLM.from_preset(
        "tiny", vocab_size=tokenizer.vocab_size, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
        d_ff=4 * args.d_model, max_len=args.seq_len, dropout=args.dropout, sublayer=args.sublayer,
        positional=args.positional,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        mask_token_id=tokenizer.mask_token_id,
    )
    say(f"model: EncoderLM, {model.num_parameters():,} parameters")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    scheduler = WarmupCosineLR(optimizer, warmup=min(args.warmup, args.steps), total=args.steps)
    config = TrainerConfig(max_steps=args.steps, batch_size=args.batch_size, max_grad_norm=1.0, seed=args.seed,
                           progress=not args.no_progress)
    collator = MLMCollator(tokenizer, whole_word_mask=args.whole_word_mask)
    trainer = Trainer(model, optimizer, config, train_set, collator, scheduler=scheduler, eval_data=val_set)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    val_loss = trainer.eval_history[-1]["loss"]
    baseline = unigram_loss(train_set, val_set, tokenizer)
    say(f"trained {args.steps} steps in {seconds:.0f} s; validation MLM loss {val_loss:.3f} nats/token "
        f"(perplexity {math.exp(val_loss):.1f}) vs unigram baseline {baseline:.3f} "
        f"(perplexity {math.exp(baseline):.1f})")

    if context.is_main:
        out = Path(args.out)
        model.save_pretrained(out, tokenizer=tokenizer)
        reloaded = EncoderLM.from_pretrained(out)
        say(f"saved to {out}/ and reloaded")
        for sentence in args.sentence or SENTENCES:
            for candidates in reloaded.fill_mask_text(sentence, top_k=5):
                guesses = ", ".join(f"{c['token']} ({c['score']:.2f})" for c in candidates)
                say(f"  {sentence}\n      -> {guesses}")
    cleanup()
    return {"val_loss": val_loss, "unigram_loss": baseline, "train_seconds": seconds}


if __name__ == "__main__":
    main()
