"""``model.embed`` against ``SentenceTransformer.encode`` on the same folder: throughput on texts of mixed lengths.

    python -m benchmarks.embed             # BERT-base shape (12 x 768), 128 docstrings, batch 32, max 256 tokens
    python -m benchmarks.embed --quick     # tiny shapes: checks that the script runs

One random BERT-base-shaped encoder (fp32, eval) with a BPE tokenizer trained on the built-in corpus is saved as a
sentence-transformers folder (mean pooling, normalised); ``SentenceTransformer`` loads it and the zoo loads it with
``models.from_pretrained``. Both embed the same standard-library docstrings (mixed lengths, truncated at the folder's
maximum sequence length) with the same batch size, interleaved A B A B, medians of ``--repeats`` runs after a
warm-up; the vectors are compared too. sentence-transformers sorts the texts by character length and pads each batch
to its longest row; the zoo sorts by token count and skips the attention mask of batches without padding.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from sentence_transformers import SentenceTransformer
from sentence_transformers import models as st_models

import models
from tokenization.trainers import train_bpe
from training.data import stdlib_docstrings

BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
QUICK = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def build(folder: Path, shape: dict, max_seq_length: int, docs: list[str]) -> tuple[SentenceTransformer, object]:
    """The sentence-transformers model and the zoo model of one folder."""
    tokenizer = train_bpe(docs[:3000], vocab_size=8000, template="encoder")
    (folder / "bert").mkdir(parents=True)
    tokenizer.save(folder / "bert" / "tokenizer.json")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(tokenizer), max_position_embeddings=512,
                                     pad_token_id=tokenizer.pad_token_id, **shape)
    transformers.BertModel(config).eval().save_pretrained(folder / "bert")
    transformer = st_models.Transformer(str(folder / "bert"), max_seq_length=max_seq_length)
    st = SentenceTransformer(modules=[transformer, st_models.Pooling(shape["hidden_size"], "mean"),
                                      st_models.Normalize()], device="cpu")
    st.save(str(folder / "st"))
    return st, models.from_pretrained(folder / "st")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-seq-length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few texts")
    args = parser.parse_args()
    shape = QUICK if args.quick else BASE
    n = 32 if args.quick else args.texts
    docs = stdlib_docstrings()
    texts = random.Random(0).sample(docs, n)
    with tempfile.TemporaryDirectory() as tmp:
        st, zoo = build(Path(tmp), shape, args.max_seq_length, docs)
        lengths = [len(ids) for ids in zoo.token_rows(texts, None, zoo.embedding_options())]
        print(f"machine: {torch.get_num_threads()} threads, torch {torch.__version__}, fp32; "
              f"{n} texts of {min(lengths)}-{max(lengths)} tokens (mean {statistics.mean(lengths):.0f}), "
              f"batch {args.batch_size}, BERT {shape['num_hidden_layers']} x {shape['hidden_size']}")
        with torch.inference_mode():
            ours = zoo.embed(texts, batch_size=args.batch_size)
            theirs = st.encode(texts, batch_size=args.batch_size, convert_to_tensor=True)
            print(f"max |zoo - sentence-transformers| = {float((ours - theirs).abs().max()):.2e}")
            times: dict[str, list[float]] = {"zoo embed": [], "SentenceTransformer.encode": []}
            for _ in range(args.repeats):
                start = time.perf_counter()
                zoo.embed(texts, batch_size=args.batch_size)
                times["zoo embed"].append(time.perf_counter() - start)
                start = time.perf_counter()
                st.encode(texts, batch_size=args.batch_size)
                times["SentenceTransformer.encode"].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print("| embedder | texts/s | median s |\n|---|---|---|")
    for name, seconds in medians.items():
        print(f"| {name} | {n / seconds:.1f} | {seconds:.2f} |")
    print(f"ratio zoo / sentence-transformers: {medians['SentenceTransformer.encode'] / medians['zoo embed']:.2f}x")


if __name__ == "__main__":
    main()
