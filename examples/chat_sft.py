"""Chat SFT, then DPO, on an instruction set built offline from the Python standard library, scored with lm-eval.

The instruction set: for every public top-level function with a docstring in a fixed list of standard-library
modules, the question "What does `module.function` do?" and, as the answer, the first sentence of its docstring.
Whole modules are held out (every fifth, by name). The run:

1. trains a byte-level BPE tokenizer on the built-in corpus, gives it a ChatML template and builds a small
   ``DecoderLM`` (random weights: nothing is downloaded), saved as ``OUT/base``;
2. ``zoo finetune --method sft`` on the training functions' conversations (loss on the answers only, packed);
3. ``zoo finetune --method dpo`` from the SFT model, the rejected answer being another function's summary;
4. scores base, SFT and DPO models with lm-eval (the ``zoo`` backend) on two local multiple-choice tasks written
   here — the training functions and the held-out modules' functions, each question with its true summary and three
   other functions' summaries as choices, each scored right after the assistant's header as the template writes
   it (``target_delimiter: ""``) — beside the chance baseline (1/4).

    python examples/chat_sft.py                              # a few minutes on one CPU core
    python examples/chat_sft.py --sft-steps 600 --dpo-steps 200 --out runs/chat_sft
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import random
import re
import time
from pathlib import Path
from typing import Any

import torch

from cli.main import main as zoo
from models import DecoderLM
from tokenization import Tokenizer, train_byte_level_bpe
from training import stdlib_docstrings

MODULES = ["argparse", "base64", "bisect", "calendar", "colorsys", "copy", "csv", "difflib", "fnmatch", "fractions",
           "functools", "genericpath", "glob", "gzip", "heapq", "html", "inspect", "ipaddress", "json.decoder",
           "json.encoder", "keyword", "linecache", "locale", "ntpath", "operator", "os", "pathlib", "pickle",
           "platform", "posixpath", "pprint", "quopri", "random", "re", "shlex", "shutil", "statistics", "string",
           "tarfile", "tempfile", "textwrap", "tokenize", "traceback", "typing", "urllib.parse", "uuid", "warnings",
           "zipfile"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", default="runs/chat_sft", help="folder for the models, data and results")
    parser.add_argument("--sft-steps", type=int, default=400, help="about 19 passes over the training set")
    parser.add_argument("--dpo-steps", type=int, default=100)
    parser.add_argument("--sft-lr", type=float, default=3e-3, help="peak learning rate (warmup, then cosine)")
    parser.add_argument("--dpo-lr", type=float, default=1e-4, help="peak learning rate (warmup, then cosine)")
    parser.add_argument("--batch-size", type=int, default=16, help="conversations (or pairs) per step")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads: the model is too small for a second one to pay, and on a shared "
                             "machine each op would wait for it")
    return parser.parse_args(argv)


def functions(modules: list[str]) -> list[dict[str, str]]:
    """``{"module", "name", "summary"}`` for every public top-level function with a docstring in ``modules``."""
    out = []
    for module in modules:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if not doc:
                    continue
                first = re.split(r"(?<=\.)\s|\n\s*\n", " ".join(doc.split("\n\n")[0].split()))[0].strip()
                if 3 <= len(first.split()) <= 30:
                    out.append({"module": module, "name": node.name, "summary": first})
    return out


def question(f: dict[str, str]) -> str:
    return f"What does `{f['module']}.{f['name']}` do?"


def write_data(out: Path, train: list[dict], held_out: list[dict], rng: random.Random) -> None:
    """The SFT and DPO files, and the two lm-eval tasks (YAML + JSONL)."""
    with (out / "sft.jsonl").open("w") as f:
        for fn in train:
            f.write(json.dumps({"messages": [{"role": "user", "content": question(fn)},
                                             {"role": "assistant", "content": fn["summary"]}]}) + "\n")
    with (out / "prefs.jsonl").open("w") as f:
        for fn in train:
            other = rng.choice([g for g in train if g["summary"] != fn["summary"]])
            prompt = [{"role": "user", "content": question(fn)}]
            f.write(json.dumps({"prompt": prompt, "chosen": [{"role": "assistant", "content": fn["summary"]}],
                                "rejected": [{"role": "assistant", "content": other["summary"]}]}) + "\n")
    for task, pool in (("stdlib_seen", train), ("stdlib_held_out", held_out)):
        docs = []
        for fn in pool:
            others = rng.sample([g["summary"] for g in pool if g["summary"] != fn["summary"]], 3)
            choices = [fn["summary"], *others]
            rng.shuffle(choices)
            prompt = CHATML_PROMPT.format(question=question(fn))
            docs.append({"prompt": prompt, "choices": choices, "answer": choices.index(fn["summary"])})
        (out / f"{task}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        (out / f"{task}.yaml").write_text(json.dumps({
            "task": task, "dataset_path": "json", "output_type": "multiple_choice", "test_split": "test",
            "dataset_kwargs": {"data_files": {"test": str((out / f"{task}.jsonl").resolve())},
                               "cache_dir": str((out / "datasets-cache").resolve())},
            "doc_to_text": "{{prompt}}", "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
            "target_delimiter": "",
            "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}, indent=1) + "\n")


CHATML_PROMPT = "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def base_model(out: Path, facts: list[dict], args: argparse.Namespace) -> Path:
    """A tokenizer trained on the corpus (with a ChatML template) and a small DecoderLM with random weights."""
    texts = stdlib_docstrings()[:3000] + [f"{question(f)} {f['summary']}" for f in facts]
    roles = {"pad": "<|endoftext|>", "unk": None, "bos": None, "eos": "<|im_end|>", "mask": None}
    # No BOS anywhere: the template writes none, so lm-eval's requests (encoded with the tokenizer's special
    # tokens) start like the training rows.
    base = train_byte_level_bpe(texts, vocab_size=args.vocab_size, special_tokens=roles,
                                extra_special_tokens=["<|im_start|>"], template="none")
    tok = Tokenizer(base.backend, roles, chat_template=CHATML)
    torch.manual_seed(args.seed)
    model = DecoderLM.from_preset("tiny", vocab_size=len(tok), d_model=args.d_model, n_layers=args.layers,
                                  n_heads=4, d_ff=4 * args.d_model, max_len=256, dropout=0.0,
                                  pad_token_id=tok.pad_token_id, bos_token_id=None, eos_token_id=tok.eos_token_id)
    return model.save_pretrained(out / "base", tokenizer=tok)


def score(model: str, out: Path) -> dict[str, dict[str, float]]:
    """lm-eval accuracies of ``model`` on the two local tasks."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from serving.lm_eval_model import ZooLM

    results = lm_eval.simple_evaluate(model=ZooLM(model, batch_size=32), tasks=["stdlib_seen", "stdlib_held_out"],
                                      task_manager=TaskManager(include_path=str(out), include_defaults=False),
                                      random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                      fewshot_random_seed=0, bootstrap_iters=0)
    return {task: {m: results["results"][task][f"{m},none"] for m in ("acc", "acc_norm")}
            for task in ("stdlib_seen", "stdlib_held_out")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return pipeline(args)
    finally:
        torch.set_num_threads(threads)


def pipeline(args: argparse.Namespace) -> dict[str, Any]:
    """The run (see the module docstring); returns the table of accuracies, also written to ``OUT/results.json``."""
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    facts = functions(MODULES)
    held_modules = sorted({f["module"] for f in facts})[::5]
    train = [f for f in facts if f["module"] not in held_modules]
    held_out = [f for f in facts if f["module"] in held_modules]
    write_data(out, train, held_out, rng)
    print(f"{len(train)} training functions, {len(held_out)} held out in {len(held_modules)} modules "
          f"({', '.join(held_modules)})")
    base = base_model(out, facts, args)
    common = ["--batch-size", str(args.batch_size), "--max-length", "256", "--seed", str(args.seed),
              "--checkpoint-every", str(max(args.sft_steps, args.dpo_steps)), "--restart", "--schedule", "cosine"]
    zoo(["finetune", str(base), "--data", str(out / "sft.jsonl"), "--method", "sft", "--out", str(out / "sft"),
         "--steps", str(args.sft_steps), "--lr", str(args.sft_lr), "--warmup", str(max(1, args.sft_steps // 20)),
         *common])
    zoo(["finetune", str(out / "sft" / "model"), "--data", str(out / "prefs.jsonl"), "--method", "dpo", "--beta",
         "0.1", "--out", str(out / "dpo"), "--steps", str(args.dpo_steps), "--lr", str(args.dpo_lr),
         "--warmup", str(max(1, args.dpo_steps // 20)), *common])
    table: dict[str, Any] = {"chance": {t: {"acc": 0.25, "acc_norm": 0.25} for t in ("stdlib_seen", "stdlib_held_out")}}
    for name, path in (("base", base), ("sft", out / "sft" / "model"), ("sft+dpo", out / "dpo" / "model")):
        table[name] = score(str(path), out)
    print("\n| model | seen acc | seen acc_norm | held-out acc | held-out acc_norm |\n|---|---|---|---|---|")
    for name, row in table.items():
        seen, held = row["stdlib_seen"], row["stdlib_held_out"]
        print(f"| {name} | {seen['acc']:.3f} | {seen['acc_norm']:.3f} | {held['acc']:.3f} | {held['acc_norm']:.3f} |")
    seconds = time.perf_counter() - start
    print(f"\n{len(train)} seen and {len(held_out)} held-out questions; {seconds:.0f} s in all")
    (out / "results.json").write_text(json.dumps({**table, "seconds": round(seconds, 1)}, indent=2) + "\n")
    return table


if __name__ == "__main__":
    run(parse_args())
