"""Fine-tune an ``EncoderLM`` classifier on real text, offline: which standard-library package a docstring comes from.

    python examples/classify.py                 # 9 packages, ~2,000 docstrings, held out by module; a few minutes
    python examples/classify.py --steps 60      # a quick run

The labelled task is built from the corpus the project ships (the standard library's own docstrings, see
``training.data``): each docstring is labelled with its top-level package (``asyncio``, ``email``, ``tkinter`` ...),
and whole modules (files) are held out, so the test docstrings come from files the model never saw. A BPE tokenizer
is trained on the training docstrings, an ``EncoderLM`` with a ``sequence_classification`` head is trained from
scratch through the ``Trainer``, and accuracy and macro-F1 on the held-out modules are printed beside a TF-IDF +
logistic-regression baseline (scikit-learn) measured in the same run.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import sysconfig
from pathlib import Path

import torch
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import accuracy_score, f1_score

from models import EncoderLM, EncoderLMConfig
from tokenization.trainers import train_bpe
from training import Trainer, TrainerConfig
from training.collators import pad_rows

PACKAGES = ("asyncio", "email", "multiprocessing", "unittest", "xml", "importlib", "tkinter", "urllib", "http")
MIN_WORDS = 8


def labelled_docstrings(held_out_fraction: float = 0.25) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """``(train, test)`` lists of (docstring, package index); a module's docstrings all go to one side."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, test = [], []
    for label, package in enumerate(PACKAGES):
        files = sorted(f for f in (root / package).rglob("*.py") if not {"test", "tests"} & set(f.parts))
        for path in files:
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError):
                continue
            docs = [ast.get_docstring(node) for node in ast.walk(tree)
                    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
            docs = [d.strip() for d in docs if d and len(d.split()) >= MIN_WORDS]
            digest = int(hashlib.sha1(str(path.relative_to(root)).encode()).hexdigest(), 16)
            (test if digest % 1000 < held_out_fraction * 1000 else train).extend((d, label) for d in docs)
    return train, test


def collate(tokenizer, max_len: int, examples: list[dict]) -> dict[str, torch.Tensor]:
    rows = [tokenizer.encode(e["text"])[:max_len] for e in examples]
    ids, mask = pad_rows(rows, tokenizer.pad_token_id)
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([e["label"] for e in examples])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    torch.manual_seed(0)
    train, test = labelled_docstrings()
    print(f"{len(train)} training and {len(test)} held-out docstrings (whole modules held out), "
          f"{len(PACKAGES)} packages")
    truth = [label for _, label in test]

    tfidf = TfidfVectorizer(sublinear_tf=True, ngram_range=(1, 2), min_df=2)
    baseline = LogisticRegression(max_iter=2000).fit(tfidf.fit_transform([t for t, _ in train]),
                                                     [label for _, label in train])
    predicted = baseline.predict(tfidf.transform([t for t, _ in test])).tolist()
    scores = {"TF-IDF + logistic regression": (accuracy_score(truth, predicted),
                                               f1_score(truth, predicted, average="macro"))}

    tokenizer = train_bpe([t for t, _ in train], vocab_size=4000, template="encoder")
    config = EncoderLMConfig(
        vocab_size=len(tokenizer), d_model=128, n_heads=4, d_ff=512, n_layers=2, max_len=args.max_len, dropout=0.1,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, mask_token_id=tokenizer.mask_token_id,
        head="sequence_classification",
        options={"head": {"num_labels": len(PACKAGES), "id2label": dict(enumerate(PACKAGES))}},
    )
    model = EncoderLM(config)
    model.tokenizer = tokenizer
    trainer = Trainer(
        model, functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.01),
        TrainerConfig(max_steps=args.steps, batch_size=args.batch_size, device="cpu", progress=False),
        [{"text": t, "label": label} for t, label in train],
        functools.partial(collate, tokenizer, args.max_len),
    )  # the default loss of a task head: its problem type's (here single-label cross entropy), not the MLM loss
    trainer.train()
    model.eval()
    guesses = model.classify([t for t, _ in test])
    predicted = [PACKAGES.index(g["label"]) for g in guesses]
    scores["zoo EncoderLM classifier"] = (accuracy_score(truth, predicted), f1_score(truth, predicted, average="macro"))

    print("| model | accuracy | macro-F1 |\n|---|---|---|")
    for name, (accuracy, f1) in scores.items():
        print(f"| {name} | {accuracy:.3f} | {f1:.3f} |")
    winner = max(scores, key=lambda name: scores[name][1])
    print(f"best macro-F1: {winner}")


if __name__ == "__main__":
    main()
