"""``zoo eval`` (lm-evaluation-harness tasks) and ``zoo perplexity`` (llama.cpp's method).

    zoo eval ./model --tasks hellaswag,arc_easy --batch-size 16 --limit 100
    zoo eval ./base --adapter runs/sft/adapter --tasks my_task --include-path ./tasks --output results.json
    zoo perplexity ./model.gguf wiki.test.raw --ctx 512

``zoo eval`` runs lm-eval with the zoo backend (``serving.lm_eval_model``, registered as ``zoo``); ``--include-path``
adds a folder of task YAML files (local tasks then load without lm-eval's catalogue of thousands, which takes tens of
seconds to index). ``zoo perplexity`` prints the running estimate after each chunk as ``llama-perplexity`` does
(``[1]12.3456,[2]11.9876,...``), then the final estimate with its uncertainty.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_commands(sub: Any) -> dict[str, Callable[[argparse.Namespace], None]]:
    """Add ``eval`` and ``perplexity`` to the subparsers ``sub`` of the ``zoo`` command.

    Args:
        sub: what ``ArgumentParser.add_subparsers`` returned.

    Returns:
        ``{"eval": handler, "perplexity": handler}``.
    """
    e = sub.add_parser("eval", help="score a model on lm-evaluation-harness tasks", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("model", help="a checkpoint folder, Hub repo id or .gguf file")
    e.add_argument("--tasks", required=True, help="comma-separated task names")
    e.add_argument("--include-path", default=None, help="a folder of task YAML files")
    e.add_argument("--adapter", default=None, help="a LoRA adapter folder to run on the model")
    e.add_argument("--batch-size", type=int, default=16)
    e.add_argument("--max-length", type=int, default=None, help="the context in tokens (default: the model's)")
    e.add_argument("--num-fewshot", type=int, default=None)
    e.add_argument("--limit", type=float, default=None, help="documents per task (or a fraction below 1)")
    e.add_argument("--apply-chat-template", action="store_true", help="render prompts with the chat template")
    e.add_argument("--output", default=None, help="write the results (and the samples) as JSON here")
    e.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("perplexity", help="perplexity of a text file (llama.cpp's method)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a checkpoint folder, Hub repo id or .gguf file")
    p.add_argument("file", help="a UTF-8 text file")
    p.add_argument("--ctx", type=int, default=512, help="the chunk length in tokens (llama.cpp's -c)")
    p.add_argument("--batch-size", type=int, default=1, help="chunks per forward pass")
    p.add_argument("--chunks", type=int, default=None, help="read at most this many chunks")
    p.add_argument("--no-progress", action="store_true")
    return {"eval": run_eval, "perplexity": run_perplexity}


def run_eval(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``zoo eval``: print lm-eval's table (and write ``--output``).

    Args:
        args: the parsed ``zoo eval`` options.

    Returns:
        lm-eval's results dict.

    Raises:
        SystemExit: the model or adapter is refused (``ValueError`` from ``ZooLM``).
    """
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    from models.checkpoints.atomic import write_file
    from serving.lm_eval_model import ZooLM

    tasks = [t for t in args.tasks.split(",") if t]
    try:
        model = ZooLM(args.model, batch_size=args.batch_size, max_length=args.max_length, adapter=args.adapter)
    except ValueError as err:
        raise SystemExit(f"zoo eval: {err}") from None
    manager = TaskManager(include_path=args.include_path, include_defaults=_needs_catalogue(tasks, args.include_path))
    results = lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=manager, num_fewshot=args.num_fewshot,
                                      limit=args.limit, apply_chat_template=args.apply_chat_template,
                                      log_samples=args.output is not None, random_seed=args.seed,
                                      numpy_random_seed=args.seed, torch_random_seed=args.seed,
                                      fewshot_random_seed=args.seed)
    print(make_table(results))
    if args.output:
        write_file(args.output, json.dumps(results, indent=2, default=str) + "\n")  # atomic: old or new file
    return results


def _needs_catalogue(tasks: list[str], include_path: str | None) -> bool:
    """Whether some task is not named by a ``task:`` line of a YAML file in ``include_path`` (then lm-eval's own
    catalogue is indexed too)."""
    if include_path is None:
        return True
    local = set()
    for path in Path(include_path).rglob("*.yaml"):
        local.update(re.findall(r"^task:\s*['\"]?([^'\"\s#]+)", path.read_text(encoding="utf-8", errors="replace"),
                                flags=re.MULTILINE))
    return not set(tasks) <= local


def run_perplexity(args: argparse.Namespace) -> Any:
    """Run ``zoo perplexity``.

    Args:
        args: the parsed ``zoo perplexity`` options.

    Returns:
        The ``training.perplexity.PerplexityResult``.

    Raises:
        SystemExit: the file is not readable UTF-8 text, the model has no tokenizer, or ``perplexity`` refuses
            the arguments.
    """
    import models
    from training.perplexity import perplexity

    path = Path(args.file)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SystemExit(f"zoo perplexity: cannot read {path} as UTF-8 text: {err}") from None
    model = models.from_pretrained(args.model).eval()
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise SystemExit(f"zoo perplexity: {args.model} has no tokenizer")
    tokens = tok.encode(text)

    def show(k: int, ppl: float) -> None:
        sys.stdout.write(f"[{k}]{ppl:.4f},")
        sys.stdout.flush()

    try:
        result = perplexity(model, tokens, args.ctx, bos_token_id=tok.bos_token_id, batch_size=args.batch_size,
                            max_chunks=args.chunks, progress=not args.no_progress, on_chunk=show)
    except ValueError as err:
        raise SystemExit(f"zoo perplexity: {err}") from None
    print(f"\nFinal estimate: PPL = {result.perplexity:.4f} +/- {result.uncertainty:.5f} "
          f"({result.n_chunks} chunks of {result.n_ctx} tokens, {result.n_scored} scored)")
    return result
