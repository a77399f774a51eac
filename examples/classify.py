"""Fine-tune an ``EncoderLM`` classifier on real text, offline: which standard-library package a docstring comes from.

    python examples/classify.py                 # 9 packages, ~2,000 docstrings, held out by module; a few minutes
    python examples/classify.py --steps 60      # a quick run
    python examples/classify.py --lora --save out/   # MLM pre-training, then LoRA + head; peft loads the result

The labelled task is built from the corpus the project ships (the standard library's own docstrings, see
``training.data``): each docstring is labelled with its top-level package (``asyncio``, ``email``, ``tkinter`` ...),
and whole modules (files) are held out, so the test docstrings come from files the model never saw. A BPE tokenizer
is trained on the training docstrings, an ``EncoderLM`` with a ``sequence_classification`` head is trained from
scratch through the ``Trainer``, and accuracy and macro-F1 on the held-out modules are printed beside a TF-IDF +
logistic-regression baseline (scikit-learn) measured in the same run.

With ``--lora`` the encoder is first pre-trained with masked LM on the training docstrings (no labels) and written as a
``transformers`` checkpoint (``base/``); it is loaded again with a new ``sequence_classification`` head (BERT's
pooler + classifier), and only a LoRA on the attention and feed-forward projections plus the head are trained. The
adapter is saved in the ``peft`` layout with the head as ``modules_to_save`` (``adapter/``), and ``peft`` loads it
onto ``transformers``' ``BertForSequenceClassification`` in the same run: the script prints the largest logit
difference to the zoo model.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import sysconfig
import tempfile
import warnings
from pathlib import Path

import torch
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import accuracy_score, f1_score

import models
from models import EncoderLM, EncoderLMConfig
from models.convert import save_transformers
from tokenization.trainers import train_bpe
from training import MLMCollator, Trainer, TrainerConfig
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


def lora_classifier(args: argparse.Namespace, config: EncoderLMConfig, tokenizer, train: list, folder: Path
                    ) -> EncoderLM:
    """MLM pre-training, then LoRA + head fine-tuning (see the module docstring); writes ``folder/base`` and
    ``folder/adapter``."""
    optimizer = functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.01)
    base = EncoderLM(config.replace(head="mlm", options={}))
    Trainer(base, optimizer, TrainerConfig(max_steps=args.mlm_steps, batch_size=args.batch_size, device="cpu",
                                           progress=False),
            [t for t, _ in train], MLMCollator(tokenizer, max_length=args.max_len)).train()
    save_transformers(base, folder / "base", model_type="bert")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "newly initialized: head.*": the head is new, as intended
        # BERT's pooler before the classifier: the head of transformers' BertForSequenceClassification
        model = models.from_pretrained(folder / "base", head="sequence_classification",
                                       head_options={**config.options["head"], "pre_classifier": "bert"})
    model.tokenizer = tokenizer
    model.train()
    model.add_adapter(r=args.rank, alpha=2 * args.rank,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
    model.head.requires_grad_(True)  # trained with the LoRA, saved whole beside it (peft's modules_to_save)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for n, p in model.named_parameters() if ".adapters." not in n)
    print(f"LoRA r={args.rank} + head: {trainable:,} trainable parameters ({trainable / total:.1%} of {total:,})")
    Trainer(model, optimizer, TrainerConfig(max_steps=args.steps, batch_size=args.batch_size, device="cpu",
                                            progress=False),
            [{"text": t, "label": label} for t, label in train], functools.partial(collate, tokenizer, args.max_len),
            ).train()
    model.eval().save_adapter(folder / "adapter")
    return model


def check_with_peft(model: EncoderLM, tokenizer, texts: list[str], folder: Path, max_len: int) -> float:
    """The largest difference between the zoo model's logits and ``peft``'s on ``transformers`` (base + adapter)."""
    import peft
    import transformers

    batch = collate(tokenizer, max_len, [{"text": t, "label": 0} for t in texts])
    transformers.logging.set_verbosity_error()  # its load report lists the new head, which the adapter replaces
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        hf = transformers.BertForSequenceClassification.from_pretrained(  # the head comes from the adapter
            folder / "base", num_labels=model.head.num_labels).eval()
        reference = peft.PeftModel.from_pretrained(hf, folder / "adapter").eval()
        expected = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long()).logits
        actual = model(batch["input_ids"], batch["attention_mask"]).logits
    return float((expected - actual).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--lora", action="store_true",
                        help="pre-train with masked LM, then train a LoRA + the head (see the module docstring)")
    parser.add_argument("--mlm-steps", type=int, default=400, help="with --lora: masked-LM pre-training steps")
    parser.add_argument("--rank", type=int, default=8, help="with --lora: the LoRA rank")
    parser.add_argument("--save", type=Path, default=None,
                        help="with --lora: the folder for base/ and adapter/ (default: a temporary folder)")
    args = parser.parse_args()
    if min(args.steps, args.mlm_steps, args.rank) < 1:
        parser.error("--steps, --mlm-steps and --rank must be positive")
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
    if args.lora:
        with tempfile.TemporaryDirectory() as scratch:
            folder = args.save or Path(scratch)
            model = lora_classifier(args, config, tokenizer, train, folder)
            difference = check_with_peft(model, tokenizer, [t for t, _ in test[:16]], folder, args.max_len)
        print(f"peft on transformers (base/ + adapter/) vs the zoo model: max |logit difference| {difference:.2e}"
              + (f"; written to {folder}" if args.save else ""))
        name = f"zoo EncoderLM, MLM pre-trained, LoRA r={args.rank} + head"
    else:
        model = EncoderLM(config)
        model.tokenizer = tokenizer
        trainer = Trainer(
            model, functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.01),
            TrainerConfig(max_steps=args.steps, batch_size=args.batch_size, device="cpu", progress=False),
            [{"text": t, "label": label} for t, label in train],
            functools.partial(collate, tokenizer, args.max_len),
        )  # the default loss of a task head: its problem type's (here single-label cross entropy), not the MLM loss
        trainer.train()
        name = "zoo EncoderLM classifier"
    model.eval()
    guesses = model.classify([t for t, _ in test])
    predicted = [PACKAGES.index(g["label"]) for g in guesses]
    scores[name] = (accuracy_score(truth, predicted), f1_score(truth, predicted, average="macro"))

    print("| model | accuracy | macro-F1 |\n|---|---|---|")
    for name, (accuracy, f1) in scores.items():
        print(f"| {name} | {accuracy:.3f} | {f1:.3f} |")
    winner = max(scores, key=lambda name: scores[name][1])
    print(f"best macro-F1: {winner}")


if __name__ == "__main__":
    main()
