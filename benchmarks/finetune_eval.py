"""Fine-tuning and evaluation throughput against the libraries people use for them, on one model in one run.

    python -m benchmarks.finetune_eval            # both rows; --quick for a smoke run; --rows sft or loglikelihood

1. Chat SFT with packing: the zoo (``ChatSFTDataset`` + ``ChatSFTCollator`` + ``Trainer``) against TRL's
   ``SFTTrainer(packing=True)``, same Llama-shaped model (saved by ``transformers``, loaded by both), same
   conversations (questions about standard-library docstrings and their first sentence as the answer), rows of
   ``--max-length`` tokens, AdamW, fp32. Tokens/s = real tokens in the packed rows ÷ wall time of the steps after the
   first (warm-up).
2. lm-eval ``loglikelihood``: the ``zoo`` backend against lm-eval's ``hf`` backend on the same checkpoint and the
   same multiple-choice requests (4 choices per question), requests/s over all of them, same batch size; each
   backend runs ``--repeat`` times, alternating, and its fastest run counts.
"""

from __future__ import annotations

import argparse
import copy
import functools
import platform
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def conversations(n: int) -> list[list[dict[str, str]]]:
    """``n`` chats from the built-in corpus: a docstring's opening as the question, its first sentence as the answer."""
    from training import stdlib_docstrings

    docs = stdlib_docstrings()
    chats = []
    for doc in docs[:n]:
        words = doc.split()
        answer = doc.split(". ")[0][:400] + "."
        chats.append([{"role": "user", "content": "What does this describe? " + " ".join(words[:40])},
                      {"role": "assistant", "content": answer}])
    return chats


def checkpoint(folder: Path, quick: bool) -> Path:
    """A Llama-shaped model and a byte-level BPE tokenizer with a ChatML template, saved by ``transformers``."""
    import tokenizers
    import tokenizers.processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from tokenization import train_byte_level_bpe
    from training import stdlib_docstrings

    base = train_byte_level_bpe(stdlib_docstrings()[:2000], vocab_size=4096 if not quick else 512)
    base.backend.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"])
    base.backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", base.backend.token_to_id("<s>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(base.to_str()), bos_token="<s>",
                                  eos_token="</s>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    torch.manual_seed(0)
    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2) if quick else dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=4)
    config = LlamaConfig(vocab_size=len(tok), num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=False, **size)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def sft_zoo(folder: Path, chats: list, max_length: int, batch: int, steps: int) -> float:
    import models
    from training import Trainer, TrainerConfig
    from training.chat_sft import ChatSFTCollator, ChatSFTDataset

    model = models.from_pretrained(folder)
    data = ChatSFTDataset([{"messages": c} for c in chats], model.tokenizer, max_length=max_length)
    # Rows per step as TRL packs them: ``batch`` rows of max_length tokens (conversations per micro-batch chosen so).
    per_row = max_length / (sum(len(d["input_ids"]) for d in data) / len(data))
    config = TrainerConfig(max_steps=steps, batch_size=max(1, int(batch * per_row)), progress=False, shuffle=False,
                           max_grad_norm=1.0, device="cpu")
    trainer = Trainer(model, functools.partial(torch.optim.AdamW, lr=1e-4), config, data,
                      ChatSFTCollator(model.tokenizer.pad_token_id, max_length=max_length))
    trainer.train(until=1)
    start = time.perf_counter()
    history = trainer.train()
    return sum(h["tokens"] for h in history[1:]) / (time.perf_counter() - start)


def sft_trl(folder: Path, chats: list, max_length: int, batch: int, steps: int, out: Path) -> float:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    marks: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            marks.append((time.perf_counter(), float(state.num_input_tokens_seen)))

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    args = SFTConfig(output_dir=str(out), report_to=[], max_steps=steps, per_device_train_batch_size=batch,
                     learning_rate=1e-4, packing=True, max_length=max_length, use_cpu=True, bf16=False,
                     logging_steps=10**6, save_strategy="no", include_num_input_tokens_seen="non_padding",
                     dataloader_num_workers=0, max_grad_norm=1.0, lr_scheduler_type="constant",
                     gradient_checkpointing=False)  # TRL turns it on by default; the zoo run does not checkpoint
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list([{"messages": c} for c in chats]),
                         processing_class=AutoTokenizer.from_pretrained(folder), callbacks=[Clock()])
    trainer.train()
    (t0, n0), (t1, n1) = marks[0], marks[-1]
    return (n1 - n0) / (t1 - t0)


def loglikelihood_rows(folder: Path, n_questions: int, batch: int, repeat: int = 3) -> tuple[float, float]:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from serving.lm_eval_model import ZooLM

    chats = conversations(n_questions)
    requests = []
    for i, chat in enumerate(chats):
        for j in range(4):  # the right answer and three others
            answer = chats[(i + 7 * j) % len(chats)][1]["content"]
            requests.append(Instance(request_type="loglikelihood", doc={}, idx=j,
                                     arguments=(chat[0]["content"] + "\nAnswer:", " " + answer)))
    backends = (ZooLM(str(folder), batch_size=batch),
                HFLM(pretrained=str(folder), batch_size=batch, device="cpu", dtype="float32"))
    for model in backends:
        model.loglikelihood(copy.copy(requests[: batch * 2]), disable_tqdm=True)  # warm-up
    best = [float("inf")] * len(backends)
    for _ in range(repeat):  # alternating, the fastest of each: a busy machine slows one run, not the best of several
        for b, model in enumerate(backends):
            start = time.perf_counter()
            model.loglikelihood(copy.copy(requests), disable_tqdm=True)
            best[b] = min(best[b], time.perf_counter() - start)
    return len(requests) / best[0], len(requests) / best[1]


def main(argv: Sequence[str] | None = None) -> None:
    """Run the rows and print a Markdown table."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.finetune_eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", choices=["sft", "loglikelihood"], default=["sft", "loglikelihood"])
    p.add_argument("--quick", action="store_true", help="a tiny model and few steps (a smoke run)")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch", type=int, default=4, help="packed rows per step / requests per forward pass")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3,
                   help="loglikelihood: runs of each backend, alternating (the fastest counts)")
    args = p.parse_args(argv)
    if args.steps < 2 or args.batch < 1 or args.max_length < 16 or args.repeat < 1:
        p.error("--steps must be >= 2, --batch >= 1, --max-length >= 16 and --repeat >= 1")
    steps = 3 if args.quick else args.steps
    max_length = 64 if args.quick else args.max_length
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, fp32")
    with tempfile.TemporaryDirectory() as tmp:
        folder = checkpoint(Path(tmp) / "model", args.quick)
        if "sft" in args.rows:
            chats = conversations(400 if not args.quick else 40)
            zoo = sft_zoo(folder, chats, max_length, args.batch, steps)
            trl = sft_trl(folder, chats, max_length, args.batch, steps, Path(tmp) / "trl")
            print(f"\n| SFT, packed rows of {max_length} | tokens/s |\n|---|---|\n| zoo | {zoo:,.0f} |\n"
                  f"| TRL SFTTrainer | {trl:,.0f} |\n| ratio zoo/TRL | {zoo / trl:.2f}x |")
        if "loglikelihood" in args.rows:
            zoo, hf = loglikelihood_rows(folder, 50 if not args.quick else 8, args.batch * 4, args.repeat)
            print(f"\n| lm-eval loglikelihood | requests/s |\n|---|---|\n| zoo backend | {zoo:,.1f} |\n"
                  f"| hf backend | {hf:,.1f} |\n| ratio zoo/hf | {zoo / hf:.2f}x |")


if __name__ == "__main__":
    main()
