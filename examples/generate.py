"""Train a byte-level BPE tokenizer and a small GPT-style DecoderLM on text, save both, reload, and sample.

With no ``--data`` the text is the built-in corpus: the Python standard library's docstrings and pydoc
pages, collected from this interpreter's sources (no download). The model trains on packed blocks of
``--seq-len`` tokens with AdamW and warmup-cosine, reports validation perplexity on held-out documents,
is saved with its tokenizer to ``--out``, loaded back with ``DecoderLM.from_pretrained`` and sampled.

    python examples/generate.py                           # CPU defaults: a few minutes on 2 cores
    python examples/generate.py --steps 3000 --d-model 256 --layers 6 --out runs/gpt
    python examples/generate.py --data my_texts.jsonl --prompt "Once upon a time"
    torchrun --nproc_per_node=2 examples/generate.py      # data-parallel (DDP) on 2 processes
    torchrun --nproc_per_node=2 examples/generate.py --parallel fsdp           # FSDP2: parameters sharded
    torchrun --nproc_per_node=2 examples/generate.py --parallel tp             # tensor parallel
    torchrun --nproc_per_node=4 examples/generate.py --parallel fsdp+tp --tp-size 2
    torchrun --nproc_per_node=1 examples/generate.py --checkpoint-every 100 --resume   # any N resumes any N
    python examples/generate.py --checkpoint-every 100 --resume --steps 1600   # extend a finished run

Ctrl-C stops after the running step; with ``--checkpoint-every`` a checkpoint is saved then, and ``--resume``
continues from it. ``--resume`` with a larger ``--steps`` extends a run (``WarmupCosineLR.extendable``).

``--batch-size`` is the global batch (rows per optimiser step over all data-parallel replicas), so runs on
different numbers of processes train on the same batches and a checkpoint resumes across a change of N.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from models import DecoderLM
from tokenization import Tokenizer, train_byte_level_bpe
from training import (
    PARALLEL_MODES,
    CausalLMCollator,
    Trainer,
    TrainerConfig,
    TrainingInterrupted,
    WarmupCosineLR,
    cleanup,
    decay_groups,
    init_distributed,
    load_corpus,
    packed_examples,
    split_corpus,
)
from training.parallel import parallel_layout

PROMPTS = ["Return the", "This module provides", "The default value is", "If the file"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data", nargs="*", default=None,
                        help="text (.txt: one document per paragraph) or .jsonl files; default: the built-in corpus")
    parser.add_argument("--text-field", default="text", help="the JSONL field holding the text")
    parser.add_argument("--out", default="runs/generate", help="folder for the model, tokenizer and checkpoints")
    parser.add_argument("--steps", type=int, default=800, help="optimiser steps")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per packed training row")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="rows per micro-batch over all data-parallel replicas (each takes its share)")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=50,
                        help="steps of linear warmup (at most --steps; give it again to extend a shorter run)")
    parser.add_argument("--parallel", choices=PARALLEL_MODES, default="ddp",
                        help="how several processes (torchrun) share the model: replicas, FSDP2 shards, tensor "
                             "parallel, or both on a (data x tensor) mesh")
    parser.add_argument("--tp-size", type=int, default=None,
                        help="tensor-parallel processes per group (--parallel fsdp+tp; tp uses all processes)")
    parser.add_argument("--mixed-precision", choices=["bf16", "fp16"], default=None,
                        help="FSDP2 compute dtype (fp32 master weights and gradient reduction); for GPUs")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each layer's activations in the backward pass (less memory)")
    parser.add_argument("--checkpoint-every", type=int, default=None, help="save a resumable checkpoint every N steps")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    parser.add_argument("--prompt", action="append", default=None, help="prompt to continue (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    for name in ("steps", "vocab_size", "seq_len", "batch_size", "grad_accum", "d_model", "layers", "heads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the example; returns ``{"val_loss", "val_perplexity", "train_seconds"}``."""
    args = parse_args(argv)
    context = init_distributed()
    try:
        dp_size, _ = parallel_layout(args.parallel, context.world_size, args.tp_size)
    except ValueError as err:
        raise SystemExit(f"generate.py: error: {err}") from err
    if args.batch_size % dp_size:
        raise SystemExit(f"generate.py: error: --batch-size {args.batch_size} must be divisible by the "
                         f"{dp_size} data-parallel replicas")
    torch.manual_seed(args.seed)
    out = Path(args.out)
    say = print if context.is_main else (lambda *a, **k: None)

    docs = load_corpus(args.data, text_field=args.text_field)
    train_docs, val_docs = split_corpus(docs, val_fraction=0.05)
    say(f"corpus: {len(docs):,} documents, {sum(map(len, docs)) / 1e6:.1f} MB "
        f"({len(train_docs):,} for training, {len(val_docs):,} held out)")
    tokenizer_file = out / "checkpoints" / "tokenizer.json"
    if args.resume and tokenizer_file.is_file():
        tokenizer = Tokenizer.from_file(tokenizer_file)  # the checkpoints' ids mean these tokens
    else:
        tokenizer = train_byte_level_bpe(train_docs, vocab_size=args.vocab_size)
        if args.checkpoint_every and context.is_main:
            tokenizer_file.parent.mkdir(parents=True, exist_ok=True)
            tokenizer.save(tokenizer_file)
    train_rows = packed_examples(_encode(tokenizer, train_docs), args.seq_len)
    val_rows = packed_examples(_encode(tokenizer, val_docs), args.seq_len)
    say(f"tokenizer: byte-level BPE, {tokenizer.vocab_size} ids; {len(train_rows):,} training rows and "
        f"{len(val_rows):,} validation rows of {args.seq_len} tokens")

    model = DecoderLM.from_preset(
        "tiny", vocab_size=tokenizer.vocab_size, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
        d_ff=4 * args.d_model, max_len=args.seq_len, dropout=args.dropout, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    say(f"model: DecoderLM, {model.num_parameters():,} parameters")
    config = TrainerConfig(
        max_steps=args.steps, batch_size=args.batch_size // dp_size, grad_accum_steps=args.grad_accum,
        max_grad_norm=1.0, checkpoint_dir=str(out / "checkpoints"), checkpoint_every=args.checkpoint_every,
        keep_checkpoints=2, seed=args.seed, progress=not args.no_progress, parallel=args.parallel,
        tp_size=args.tp_size, mixed_precision=args.mixed_precision,
        activation_checkpointing=args.activation_checkpointing,
    )
    collator = CausalLMCollator(pad_token_id=tokenizer.pad_token_id)
    # The Trainer shards the model first and then builds the optimiser and its schedule over the shards.
    trainer = Trainer(
        model, lambda params: torch.optim.AdamW(decay_groups(params, 0.1), lr=args.lr, betas=(0.9, 0.95)),
        config, train_rows, collator, eval_data=val_rows,
        scheduler=lambda opt: WarmupCosineLR(opt, warmup=min(args.warmup, args.steps), total=args.steps),
    )
    say(f"parallel: {args.parallel} on {context.world_size} process(es): {trainer.layout.dp_size} data-parallel "
        f"x {trainer.layout.tp_size} tensor-parallel")
    if args.resume:
        # The global batch is the same at any N, so a checkpoint resumes on another number of processes; a larger
        # --steps extends a finished or interrupted run (its cosine then ends at the new --steps).
        try:
            loaded = trainer.load_checkpoint("latest", allow_world_size_change=True)
        except (ValueError, FileNotFoundError) as err:
            why = " ".join(str(err).split())  # one line
            raise SystemExit(f"generate.py: error: {why}; resume with the same options (a larger --steps extends the "
                             "run), or start afresh with another --out (or delete the folder)") from None
        say(f"resuming from {loaded} (step {trainer.step} of {args.steps})")
    start, first = time.perf_counter(), trainer.step
    try:
        trainer.train()
    except TrainingInterrupted as stop:
        if not args.checkpoint_every:
            raise SystemExit(f"\ninterrupted at step {stop.step} of {args.steps}; nothing saved (--checkpoint-every "
                             "N keeps checkpoints to resume from)") from None
        saved = trainer.save_checkpoint()
        raise SystemExit(f"\ninterrupted at step {stop.step} of {args.steps}; saved {saved}: run the same command "
                         "with --resume (make demo: again) to continue") from None
    if args.checkpoint_every and trainer.step % args.checkpoint_every:
        trainer.save_checkpoint()  # the end of the run, to extend it later
    seconds = time.perf_counter() - start
    result = trainer.eval_history[-1]
    say(f"trained steps {first + 1}-{trainer.step} in {seconds:.0f} s; validation loss {result['loss']:.3f}, "
        f"perplexity {result['perplexity']:.1f} (uniform over the vocabulary: {tokenizer.vocab_size})"
        if trainer.step > first else f"the run in {out} had done its {trainer.step} steps already (--steps N "
        f"extends it); validation loss {result['loss']:.3f}, perplexity {result['perplexity']:.1f}")

    trainer.save_pretrained(out, tokenizer=tokenizer)  # every process: a sharded model is gathered first
    if context.is_main:
        reloaded = DecoderLM.from_pretrained(out)
        say(f"saved to {out}/ and reloaded ({', '.join(sorted(p.name for p in out.iterdir() if p.is_file()))})")
        sample(reloaded, reloaded.tokenizer, args.prompt or PROMPTS, args)
    cleanup()
    return {"val_loss": result["loss"], "val_perplexity": result["perplexity"], "train_seconds": seconds}


def sample(model: DecoderLM, tokenizer: Tokenizer, prompts: list[str], args: argparse.Namespace) -> None:
    """Print a sampled continuation of every prompt."""
    generator = torch.Generator().manual_seed(args.seed)
    for prompt in prompts:
        ids = [tokenizer.bos_token_id] + tokenizer.encode(prompt, add_special_tokens=False)
        ids = torch.tensor([ids[-(model.config.max_len - 1):]])  # learned positions end at max_len
        max_new = min(args.max_new_tokens, model.config.max_len - ids.shape[1])
        out = model.generate(ids, max_new_tokens=max_new, do_sample=True, temperature=args.temperature,
                             top_k=args.top_k, generator=generator)
        print(f"\n>>> {tokenizer.decode(out[0])}")


def _encode(tokenizer: Tokenizer, docs: list[str]) -> list[list[int]]:
    """Each document as BOS ... EOS ids (the decoder template)."""
    return tokenizer(docs, padding=False, return_tensors=None)["input_ids"]


if __name__ == "__main__":
    try:
        metrics = main()
    except KeyboardInterrupt:  # before or after training (during it, a checkpoint is saved first)
        raise SystemExit("\ninterrupted") from None
    if not math.isfinite(metrics["val_loss"]):
        raise SystemExit(1)
