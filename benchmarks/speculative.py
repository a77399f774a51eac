"""Speculative decoding on the demo model: acceptance rate and tokens/s of a small draft trained next to it.

    python -m benchmarks.speculative                      # train target + drafts, then measure (see below)
    python -m benchmarks.speculative --target runs/demo   # reuse the model ``make demo`` trained
    python -m benchmarks.speculative --no-compile         # eager rows only (no inductor builds, half the rows)
    python -m benchmarks.speculative --distill            # also drafts distilled from the target (see below)
    python -m benchmarks.speculative --quick              # tiny models: checks that the script runs (seconds)

On 2 shared CPU cores the target trained in ~23 min (``make demo`` alone: a few minutes), the drafts in ~4.5 min
together, and the measurement (36 rows, 1 + 5 passes each, three inductor compiles) took ~18 min; a second run
reuses the saved target and drafts.

The target is the demo configuration (``examples/generate.py``'s defaults: byte-level BPE 2048, ``DecoderLM``
preset "tiny" with d_model 128, 4 layers, 4 heads, 128-token rows, 800 steps on the built-in corpus of standard
library docstrings), trained by that example itself unless ``--target`` names a folder that already holds it.
Each draft (``--draft LAYERSxD_MODEL``, default ``1x128`` and ``1x64``) is a ``DecoderLM`` trained with the same
tokenizer, data, optimiser and schedule by the project's ``Trainer``; drafts are kept under ``--out`` and reused
by later runs (``--retrain-drafts`` trains them again).

``--distill`` adds, per shape, a draft that imitates the target rather than the corpus (``NAME-distilled``): a copy
of the plain draft trained further (``--distill-steps``, same optimiser, schedule and batch) on the KL divergence
to the target's next-token distributions (word-level distillation), over the target's own continuations of the
first ``--prompt-tokens`` ids of ``--distill-prompts`` TRAINING documents — each continued once greedily and once
sampled at ``--temperature``, up to the target's ``max_len`` (sequence-level distillation, Kim & Rush 2016) — and,
with ``--distill-corpus``, the packed corpus rows. The held-out prompts are never seen. The continuations are saved
under ``--out`` and reused for the same target. On 2 shared CPU cores (1 thread): 78 s to generate 4,096
continuations, 550 s for the default 3,000 steps of the 1x64 draft. Measured (1x64, k = 4): acceptance 39% plain,
69% after 1,500 steps on continuations + corpus rows, 72% after 3,000 steps on continuations only; a 1x128 draft
distilled the first way accepted a little more (70.5%) but its dearer step made it slower.

On held-out documents (the example's own validation split, never trained on), one run interleaves, repeat by
repeat: plain greedy decoding, speculative greedy decoding for every draft and ``k`` in ``--ks``, plain sampling
(temperature 0.8) and speculative sampling. Greedy speculative output is checked to equal plain greedy output on
every prompt (the script stops if not). Tokens/s is the median over repeats of new tokens ÷ seconds summed over
the prompts; speed-up = that median ÷ the plain median of the same mode; acceptance = accepted ÷ proposed draft
tokens. Everything is fp32 on this process's threads (``torch.get_num_threads()``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.compare import Table
from examples import generate as demo
from models import DecoderLM
from models.generation.sampling import SamplingParams
from models.generation.speculative import speculative_decode
from tokenization import Tokenizer
from training import (
    CausalLMCollator,
    TokenLoss,
    Trainer,
    TrainerConfig,
    WarmupCosineLR,
    decay_groups,
    load_corpus,
    packed_examples,
    split_corpus,
)

#: ``examples/generate.py`` arguments of the ``--quick`` target: seconds to train, same code path.
QUICK_TARGET = ["--steps", "4", "--vocab-size", "300", "--d-model", "32", "--layers", "2", "--heads", "2",
                "--seq-len", "48", "--batch-size", "4", "--warmup", "2", "--max-new-tokens", "2",
                "--prompt", "Return the"]
#: Documents of the built-in corpus used by ``--quick`` (the full corpus takes seconds to tokenize).
QUICK_DOCS = 300


@dataclass
class Result:
    """What one configuration (mode, draft, k) gathered over the measured repeats."""

    tokens_per_s: list[float] = field(default_factory=list)
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    tokens: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.tokens_per_s)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny models and few prompts: checks the script runs")
    parser.add_argument("--out", default="runs/speculative", help="folder for the trained target and drafts")
    parser.add_argument("--target", default=None,
                        help="folder of a trained target (e.g. runs/demo); trained there with the demo "
                             "configuration when it holds no model (default: OUT/target)")
    parser.add_argument("--draft", action="append", default=None, metavar="LAYERSxD_MODEL",
                        help="draft shape, repeatable (default: 1x128 and 1x64); heads of 32 dimensions "
                             "(16 if d_model is not a multiple of 32)")
    parser.add_argument("--draft-steps", type=int, default=800, help="optimiser steps of each draft")
    parser.add_argument("--retrain-drafts", action="store_true", help="train the drafts even if saved under OUT")
    parser.add_argument("--distill", action="store_true",
                        help="also measure a distilled draft of each shape: the plain draft trained further to "
                             "imitate the target (KL to its distributions) on the target's own continuations of "
                             "training-split prompts, mixed with corpus rows")
    parser.add_argument("--distill-only", action="store_true",
                        help="with --distill: leave the plain drafts out of the table (they are still the start)")
    parser.add_argument("--distill-steps", type=int, default=3000, help="optimiser steps of each distilled draft")
    parser.add_argument("--distill-corpus", action=argparse.BooleanOptionalAction, default=False,
                        help="mix the packed corpus rows into the distillation data (default: only the target's "
                             "continuations, which gave the higher acceptance)")
    parser.add_argument("--distill-prompts", type=int, default=2048,
                        help="training-split prompts the target continues (greedy and sampled: twice as many rows)")
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4, 5], help="draft tokens per round")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="tokens per prompt (BOS included)")
    parser.add_argument("--new-tokens", type=int, default=64, help="max new tokens per prompt")
    parser.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampling rows")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved measured repeats (after one warm-up)")
    parser.add_argument("--no-compile", action="store_true",
                        help="leave out the compiled rows (plain generate(compile=True), compiled draft steps)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        args.draft_shapes = [parse_shape(s) for s in (args.draft or (["1x16"] if args.quick else ["1x128", "1x64"]))]
    except ValueError as err:
        parser.error(str(err))
    for name in ("draft_steps", "distill_steps", "distill_prompts", "prompts", "prompt_tokens", "new_tokens",
                 "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(k < 1 for k in args.ks):
        parser.error(f"--ks must all be >= 1, got {args.ks}")
    if not args.temperature > 0:
        parser.error(f"--temperature must be > 0, got {args.temperature}")
    if args.distill_only and not args.distill:
        parser.error("--distill-only needs --distill")
    if args.quick:
        args.draft_steps, args.prompts, args.new_tokens, args.repeats = 4, 2, 12, 1
        args.distill_steps, args.distill_prompts = 4, 8
        args.prompt_tokens, args.ks, args.no_compile = 6, args.ks[:2], True
    return args


def parse_shape(text: str) -> tuple[int, int]:
    """``"1x64"`` -> ``(1, 64)``: layers and d_model of a draft (d_model a multiple of 16).

    Raises:
        ValueError: not two positive integers joined by ``x``, or a d_model that is not a multiple of 16.
    """
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--draft must be LAYERSxD_MODEL with positive integers (e.g. 1x64), got {text!r}")
    layers, d_model = map(int, parts)
    if d_model % 16:
        raise ValueError(f"--draft d_model must be a multiple of 16 (heads of 16 or 32 dimensions), got {d_model}")
    return layers, d_model


# ----------------------------------------------------------------------------------------------- models


def corpus(quick: bool, workdir: Path) -> tuple[list[str], list[str], list[str]]:
    """The documents, ``examples/generate.py``'s train/validation split of them, and its ``--data`` arguments."""
    docs = load_corpus(None)
    data_args: list[str] = []
    if quick:
        docs = docs[:QUICK_DOCS]
        path = workdir / "quick_corpus.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        data_args = ["--data", str(path)]
    train_docs, val_docs = split_corpus(docs, val_fraction=0.05)  # the example's split: the same held-out docs
    return train_docs, val_docs, data_args


def target_model(folder: Path, quick: bool, data_args: list[str]) -> DecoderLM:
    """The trained demo-configuration target in ``folder``, trained there by ``examples/generate.py`` if absent."""
    if not (folder / "config.json").is_file():
        print(f"training the target with examples/generate.py --out {folder} ...", flush=True)
        extra = QUICK_TARGET if quick else []
        demo.main(["--out", str(folder), "--no-progress", *data_args, *extra])
    model = DecoderLM.from_pretrained(folder)
    if model.tokenizer is None:
        raise SystemExit(f"speculative.py: error: {folder} holds no tokenizer.json; the draft needs the target's")
    return model.eval()


def train_draft(
    tokenizer: Tokenizer, target: DecoderLM, train_docs: list[str], val_docs: list[str], shape: tuple[int, int],
    steps: int, seed: int,
) -> tuple[DecoderLM, float]:
    """Train a draft of ``shape`` (layers, d_model) as the example trains the target: same tokenizer, packed rows,
    AdamW + warmup-cosine, batch and sequence length; returns the model and its validation perplexity."""
    layers, d_model = shape
    heads = d_model // 32 if d_model % 32 == 0 else d_model // 16
    c = target.config
    seq_len = c.max_len
    torch.manual_seed(seed)
    train_rows = packed_examples(demo._encode(tokenizer, train_docs), seq_len)
    val_rows = packed_examples(demo._encode(tokenizer, val_docs), seq_len)
    defaults = demo.parse_args([])
    draft = DecoderLM.from_preset(
        "tiny", vocab_size=c.vocab_size, d_model=d_model, n_layers=layers, n_heads=heads,
        d_ff=4 * d_model, max_len=seq_len, dropout=0.0, pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
    )
    batch = min(defaults.batch_size, len(train_rows))
    trainer = Trainer(
        draft, lambda params: torch.optim.AdamW(decay_groups(params, 0.1), lr=defaults.lr, betas=(0.9, 0.95)),
        TrainerConfig(max_steps=steps, batch_size=batch, max_grad_norm=1.0, seed=seed, progress=False),
        train_rows, CausalLMCollator(pad_token_id=tokenizer.pad_token_id), eval_data=val_rows,
        scheduler=lambda opt: WarmupCosineLR(opt, warmup=min(defaults.warmup, steps), total=steps),
    )
    trainer.train()
    return draft.eval(), trainer.eval_history[-1]["perplexity"]


def draft_models(args: argparse.Namespace, tokenizer: Tokenizer, target: DecoderLM, train_docs: list[str],
                 val_docs: list[str], out: Path) -> dict[str, DecoderLM]:
    """Every ``--draft``: loaded from ``out/draft-LxD`` when saved there with the target's tokenizer, else trained."""
    drafts = {}
    for layers, d_model in args.draft_shapes:
        name = f"{layers}x{d_model}"
        folder = out / f"draft-{name}"
        if not args.retrain_drafts and (folder / "config.json").is_file():
            draft = DecoderLM.from_pretrained(folder).eval()
            if draft.tokenizer is not None and draft.tokenizer.to_str() == tokenizer.to_str():
                print(f"draft {name}: loaded from {folder} ({draft.num_parameters():,} parameters)")
                drafts[name] = draft
                continue
        start = time.perf_counter()
        draft, perplexity = train_draft(tokenizer, target, train_docs, val_docs, (layers, d_model),
                                        args.draft_steps, args.seed)
        draft.save_pretrained(folder, tokenizer=tokenizer)
        print(f"draft {name}: {draft.num_parameters():,} parameters, trained {args.draft_steps} steps in "
              f"{time.perf_counter() - start:.0f} s, validation perplexity {perplexity:.1f}; saved to {folder}")
        drafts[name] = draft
    return drafts


class DistillationLoss(TokenLoss):
    """Word-level distillation (Hinton et al. 2015; Kim & Rush 2016 §3.1): the summed KL divergence
    ``KL(p_target || q_draft)`` over every position that has a next-token label, with the target run on the same
    batch. ``count`` (inherited) is the number of those positions, so the Trainer averages per token.

    Args:
        teacher: the target model (kept in eval mode, no gradient).
    """

    def __init__(self, teacher: nn.Module) -> None:
        super().__init__(shift=True)
        self.teacher = teacher.eval()

    def __call__(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        """Summed KL of ``model``'s next-token distributions to the teacher's on ``batch`` (with gradient).

        Shapes: batch ``input_ids (B, L)`` -> a scalar.
        """
        keep = self._labels(batch) != -100  # (B, L): positions whose next token is a real label
        inputs = {k: v for k, v in batch.items() if k != self.label_key}
        with torch.no_grad():
            teacher_logp = F.log_softmax(self.teacher(**inputs).logits[keep].float(), dim=-1)  # (N, V)
        student_logp = F.log_softmax(model(**inputs).logits[keep], dim=-1)
        return F.kl_div(student_logp, teacher_logp, log_target=True, reduction="sum")


def target_continuations(
    target: DecoderLM, tokenizer: Tokenizer, train_docs: list[str], n: int, prompt_tokens: int,
    temperature: float, seed: int, batch: int = 64,
) -> list[list[int]]:
    """Sequence-level distillation data (Kim & Rush 2016 §3.2): the target's own continuations, up to its
    ``max_len``, of the first ``prompt_tokens`` ids of ``n`` TRAINING documents — each prompt once greedy and once
    sampled at ``temperature`` (the benchmark's two modes) — cut after EOS.

    Returns:
        ``2 * n'`` id lists (``n'`` = the training documents longer than ``prompt_tokens``, at most ``n``).
    """
    prompts = [ids[:prompt_tokens] for ids in demo._encode(tokenizer, train_docs) if len(ids) > prompt_tokens][:n]
    new_tokens = target.config.max_len - prompt_tokens
    eos = target.config.eos_token_id
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for params in (SamplingParams(), SamplingParams(True, temperature)):
        for start in range(0, len(prompts), batch):
            # Same-length prompts: one batch without padding; a row that stops early is padded after its EOS.
            out = target.generate(torch.tensor(prompts[start : start + batch]), max_new_tokens=new_tokens,
                                  sampling=params, generator=generator)
            for row in out.tolist():
                tail = row[prompt_tokens:]
                rows.append(row[: prompt_tokens + tail.index(eos) + 1] if eos in tail else row)
    return rows


def distill_draft(
    draft: DecoderLM, target: DecoderLM, rows: list[list[int]], corpus_rows: list[dict[str, list[int]]],
    val_rows: list[dict[str, list[int]]], steps: int, seed: int,
) -> tuple[DecoderLM, float]:
    """Train ``draft`` further to imitate ``target``: ``DistillationLoss`` on the target's continuations mixed with
    packed corpus rows (if any), with the optimiser, schedule and batch of the plain drafts; returns the draft and its
    validation perplexity on held-out corpus rows (plain cross-entropy)."""
    defaults = demo.parse_args([])
    data = [{"input_ids": r} for r in rows] + corpus_rows
    torch.manual_seed(seed)
    trainer = Trainer(
        draft, lambda params: torch.optim.AdamW(decay_groups(params, 0.1), lr=defaults.lr, betas=(0.9, 0.95)),
        TrainerConfig(max_steps=steps, batch_size=min(defaults.batch_size, len(data)), max_grad_norm=1.0, seed=seed,
                      progress=False),
        data, CausalLMCollator(pad_token_id=target.config.pad_token_id), eval_data=val_rows,
        scheduler=lambda opt: WarmupCosineLR(opt, warmup=min(defaults.warmup, steps), total=steps),
        loss_fn=DistillationLoss(target), eval_loss_fn=TokenLoss(shift=True),
    )
    trainer.train()
    return draft.eval(), trainer.eval_history[-1]["perplexity"]


def saved_continuations(args: argparse.Namespace, tokenizer: Tokenizer, target: DecoderLM, train_docs: list[str],
                        out: Path) -> list[list[int]]:
    """``target_continuations`` for these arguments, read from ``out`` when an earlier run saved them for the same
    target weights and tokenizer (generating them is most of a distillation's cost on a CPU), else made and saved."""
    digest = hashlib.sha256(tokenizer.to_str().encode())
    for t in target.state_dict().values():
        digest.update(t.detach().contiguous().numpy().tobytes())
    key = {"target": digest.hexdigest()[:16], "prompts": args.distill_prompts, "prompt_tokens": args.prompt_tokens,
           "temperature": args.temperature, "seed": args.seed}
    path = out / "distill-continuations.json"
    if not args.retrain_drafts and path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            print(f"distillation data: {len(saved['rows'])} target continuations loaded from {path}")
            return saved["rows"]
    start = time.perf_counter()
    rows = target_continuations(target, tokenizer, train_docs, args.distill_prompts, args.prompt_tokens,
                                args.temperature, args.seed)
    print(f"distillation data: {len(rows)} target continuations of training-split prompts "
          f"({sum(map(len, rows)):,} tokens) in {time.perf_counter() - start:.0f} s", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "rows": rows}))
    return rows


def distilled_models(args: argparse.Namespace, tokenizer: Tokenizer, target: DecoderLM, train_docs: list[str],
                     val_docs: list[str], plain: dict[str, DecoderLM], out: Path) -> dict[str, DecoderLM]:
    """A distilled draft per plain draft (``NAME-distilled``), started from a copy of it: loaded from
    ``out/draft-NAME-distilled`` when saved there with the target's tokenizer (unless ``--retrain-drafts``), else
    trained (the target's continuations are generated once, for all shapes)."""
    drafts: dict[str, DecoderLM] = {}
    rows: list[list[int]] | None = None
    for name, plain_draft in plain.items():
        folder = out / f"draft-{name}-distilled"
        # What the saved draft was distilled with: a run with other settings trains (and saves) it again.
        settings = {"steps": args.distill_steps, "prompts": args.distill_prompts, "corpus": args.distill_corpus,
                    "prompt_tokens": args.prompt_tokens, "temperature": args.temperature, "seed": args.seed}
        saved = folder / "distill.json"
        if (not args.retrain_drafts and (folder / "config.json").is_file() and saved.is_file()
                and json.loads(saved.read_text()) == settings):
            draft = DecoderLM.from_pretrained(folder).eval()
            if draft.tokenizer is not None and draft.tokenizer.to_str() == tokenizer.to_str():
                print(f"draft {name}-distilled: loaded from {folder}")
                drafts[f"{name}-distilled"] = draft
                continue
        if rows is None:
            rows = saved_continuations(args, tokenizer, target, train_docs, out)
            corpus_rows = packed_examples(demo._encode(tokenizer, train_docs), target.config.max_len)
            val_rows = packed_examples(demo._encode(tokenizer, val_docs), target.config.max_len)
        start = time.perf_counter()
        draft = DecoderLM(plain_draft.config)
        draft.load_state_dict(plain_draft.state_dict())
        draft, perplexity = distill_draft(draft, target, rows, corpus_rows if args.distill_corpus else [], val_rows,
                                          args.distill_steps, args.seed)
        draft.save_pretrained(folder, tokenizer=tokenizer)
        saved.write_text(json.dumps(settings))
        print(f"draft {name}-distilled: {args.distill_steps} distillation steps in {time.perf_counter() - start:.0f} s"
              f", validation perplexity {perplexity:.1f}; saved to {folder}", flush=True)
        drafts[f"{name}-distilled"] = draft
    return drafts


def held_out_prompts(tokenizer: Tokenizer, val_docs: list[str], n: int, length: int) -> list[torch.Tensor]:
    """The first ``length`` ids (BOS included) of the first ``n`` held-out documents that are long enough.

    Raises:
        ValueError: fewer than ``n`` held-out documents of ``length`` tokens.
    """
    prompts = []
    for ids in demo._encode(tokenizer, val_docs):
        if len(ids) > length:  # a prompt is a document's beginning, never a whole document with its EOS
            prompts.append(torch.tensor([ids[:length]]))
        if len(prompts) == n:
            return prompts
    raise ValueError(f"only {len(prompts)} held-out documents have more than {length} tokens, {n} prompts asked")


# ----------------------------------------------------------------------------------------------- measuring


def measure(target: DecoderLM, drafts: dict[str, DecoderLM], prompts: list[torch.Tensor], ks: list[int],
            new_tokens: int, temperature: float, repeats: int, seed: int,
            compiled: bool = False) -> dict[tuple[str, str, int, bool], Result]:
    """Interleave every configuration over the prompts for one warm-up and ``repeats`` measured rounds.

    With ``compiled``, each mode also gets plain decoding with ``generate(compile=True)`` and speculative decoding
    with the draft's compiled step (``compile=True``); the warm-up round pays the compiles.

    Returns:
        ``{(mode, draft name or "-", k or 0, compiled): Result}``, in table order.

    Raises:
        SystemExit: speculative greedy output differs from plain greedy output on some prompt.
    """
    modes = {"greedy": SamplingParams(), f"sample T={temperature}": SamplingParams(True, temperature)}
    flags = [False, True] if compiled else [False]
    configs = [c for mode in modes for c in [
        *((mode, "-", 0, f) for f in flags), *((mode, name, k, f) for f in flags for name in drafts for k in ks)]]
    plain_greedy = [target.generate(p, max_new_tokens=new_tokens) for p in prompts]
    compiled_plain_differs: set[int] = set()

    def run(config: tuple[str, str, int, bool], rep: int) -> tuple[int, float, int, int, int]:
        mode, name, k, compile_ = config
        params = modes[mode]
        generator = torch.Generator().manual_seed(seed + rep)
        tokens = proposed = accepted = rounds = 0
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            if name == "-":
                out = target.generate(prompt, max_new_tokens=new_tokens, sampling=params, generator=generator,
                                      compile=compile_)
            else:
                spec = speculative_decode(target, drafts[name], prompt, new_tokens, k, sampling=params,
                                          generator=generator, compile=compile_)
                out = spec.sequences
                proposed, accepted, rounds = proposed + spec.proposed, accepted + spec.accepted, rounds + spec.rounds
            if name == "-" and compile_:
                # Inductor may reorder float reductions: compiled plain greedy is the lead's contract, not ours.
                if not params.do_sample and not torch.equal(out, plain_greedy[i]):
                    compiled_plain_differs.add(i)
            elif not params.do_sample and not torch.equal(out, plain_greedy[i]):
                raise SystemExit(f"greedy output of draft {name}, k={k}, compiled={compile_} differs from plain "
                                 f"greedy output on prompt {i}: {out.tolist()} != {plain_greedy[i].tolist()}")
            tokens += out.shape[1] - prompt.shape[1]
        return tokens, time.perf_counter() - start, proposed, accepted, rounds

    results = {c: Result() for c in configs}
    for rep in range(-1, repeats):  # rep -1: warm-up (compiles, and the identity check), not recorded
        for config in configs:
            tokens, seconds, proposed, accepted, rounds = run(config, rep)
            if rep >= 0:
                r = results[config]
                r.tokens_per_s.append(tokens / seconds)
                r.tokens, r.proposed, r.accepted, r.rounds = (r.tokens + tokens, r.proposed + proposed,
                                                              r.accepted + accepted, r.rounds + rounds)
    if compiled_plain_differs:
        print(f"note: plain generate(compile=True) greedy output differs from eager on prompts "
              f"{sorted(compiled_plain_differs)} (float rounding in the compiled graph)")
    return results


def table(results: dict[tuple[str, str, int, bool], Result], title: str, notes: list[str]) -> Table:
    """The results as a ``benchmarks.compare.Table``: one row per configuration."""
    columns = ["mode", "draft", "k", "compiled", "acceptance", "tokens / target pass", "tokens/s", "speed-up"]
    if any(key[3] for key in results):
        columns.append("vs compiled plain")
    out = Table(title, columns, notes=notes)
    for (mode, name, k, compiled), r in results.items():
        speculative = name != "-"
        row = [
            mode, name, str(k) if speculative else "-", "draft" if compiled and speculative else
            "yes" if compiled else "no",
            f"{r.accepted / r.proposed:.1%}" if speculative and r.proposed else "-",
            f"{r.tokens / r.rounds:.2f}" if speculative and r.rounds else "1.00",
            f"{r.median:.0f}", f"{r.median / results[(mode, '-', 0, False)].median:.2f}x",
        ]
        if len(columns) > len(row):
            row.append(f"{r.median / results[(mode, '-', 0, True)].median:.2f}x")
        out.rows.append(row)
    return out


def main(argv: list[str] | None = None) -> Table:
    """Run the benchmark; returns the printed table."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) if args.quick else Path(args.out)
        train_docs, val_docs, data_args = corpus(args.quick, Path(tmp))
        target_dir = Path(args.target) if args.target and not args.quick else out / "target"
        target = target_model(target_dir, args.quick, data_args)
        tokenizer = target.tokenizer
        drafts = draft_models(args, tokenizer, target, train_docs, val_docs, out)
        if args.distill:
            distilled = distilled_models(args, tokenizer, target, train_docs, val_docs, drafts, out)
            drafts = distilled if args.distill_only else {**drafts, **distilled}
        prompts = held_out_prompts(tokenizer, val_docs, args.prompts, args.prompt_tokens)
        print(f"measuring: {len(prompts)} held-out prompts of {args.prompt_tokens} tokens, up to {args.new_tokens} "
              f"new tokens, 1 warm-up + {args.repeats} interleaved repeats ...", flush=True)
        results = measure(target, drafts, prompts, args.ks, args.new_tokens, args.temperature, args.repeats,
                          args.seed, compiled=not args.no_compile)
    sizes = ", ".join(f"{n} {m.num_parameters():,}" for n, m in {"target": target, **drafts}.items())
    notes = [
        f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, fp32, batch 1",
        f"parameters: {sizes} (target: {target.config.n_layers} layers x d_model {target.config.d_model})",
        "tokens/s: median over interleaved repeats of new tokens / seconds summed over the prompts; "
        "speed-up: that median / the plain eager row's median of the same mode; vs compiled plain: / the "
        "plain generate(compile=True) row's; compiled 'draft': the draft's one-token step compiled, target eager",
        "acceptance: accepted / proposed draft tokens; tokens / target pass: new tokens per target forward",
        "greedy speculative output was checked equal to plain (eager) greedy output on every prompt",
    ]
    result = table(results, "Speculative decoding on the demo model (DecoderLM.generate(draft_model=...))", notes)
    print()
    print(result.render())
    if args.json:
        Path(args.json).write_text(json.dumps({"columns": result.columns, "rows": result.rows, "notes": notes},
                                              indent=2))
    return result


if __name__ == "__main__":
    if not main(sys.argv[1:]).rows:
        raise SystemExit(1)
