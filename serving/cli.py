"""The ``zoo`` command. ``MODEL`` is a checkpoint folder, a Hub repo id or a ``.gguf`` file
(``models.from_pretrained``).

    zoo serve ./my-model --port 8000 --api-key sk-local --served-model-name mine   # the OpenAI API
    zoo serve ./my-model --no-engine-process      # the engine in a thread of the server's process, not its own
    zoo serve ./my-model --lora sql=./sql-lora --lora chat=user/chat-lora   # adapters chosen by the request's model
    zoo chat ./my-model --temperature 0.7        # a terminal chat: /reset, /system TEXT, /exit; Ctrl-C stops a reply
    zoo generate ./my-model "Once upon a time" --max-tokens 64                     # one completion, streamed
    zoo generate ./my-model "Once upon a time" --quantize int8    # a float checkpoint's weights quantized on load
    zoo chat ./model.gguf --dequantize                            # a quantized checkpoint's weights as float32
    zoo embed ./my-embedder "first text" "second text"                             # one JSON vector per line
    zoo generate ./my-model "A date: " --regex '[0-9]{4}-[0-9]{2}-[0-9]{2}'     # output constrained (or --json-schema)
    zoo chat ./my-model --json-schema person.json                  # every answer valid JSON under the schema
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any


def _load(path: str, quantize: str | None = None, dequantize: bool = False, *, prepare: bool = True,
          **options: Any) -> Any:
    """``models.from_pretrained(path, **options)`` in eval mode, with ``--quantize`` / ``--dequantize`` checked and,
    with ``prepare``, applied (``serving.loading``); a refused request or a model without a tokenizer exits with a
    one-line message."""
    import models

    from .loading import apply_quantization, check_quantization, load_options

    model = models.from_pretrained(path, **load_options(dequantize, options)).eval()
    if getattr(model, "tokenizer", None) is None:
        raise SystemExit(f"zoo: {path} has no tokenizer (tokenizer.json or a GGUF vocabulary); cannot serve text")
    try:
        check_quantization(model, path, quantize, dequantize)
    except ValueError as err:
        raise SystemExit(f"zoo: {err}") from None
    return apply_quantization(model, quantize, dequantize) if prepare else model


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def memory_size(text: str) -> int:
    """``"512MiB"``, ``"2GiB"``, ``"1.5G"``, ``"4096"`` (bytes) as a number of bytes; a trailing ``B`` is optional."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 512MiB, 2GiB or 1000000 (bytes), got {text!r}")
    value = int(float(match.group(1)) * _UNITS[match.group(2) or ""])
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a size of at least 1 byte, got {text!r}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _quantization_options(command: argparse.ArgumentParser) -> None:
    """``--quantize SCHEME`` and ``--dequantize`` (one of them at most), shared by the commands that run a model."""
    from blocks.quantized import packable_schemes

    schemes = packable_schemes()
    group = command.add_mutually_exclusive_group()
    group.add_argument("--quantize", choices=schemes, default=None, metavar="SCHEME",
                       help=f"quantize a float checkpoint's weights after loading, one of: {', '.join(schemes)} "
                            "(refused for a checkpoint that is already quantized, e.g. a GGUF file)")
    group.add_argument("--dequantize", action="store_true",
                       help="load a quantized checkpoint (a GGUF file, a model saved quantized) as float32 weights")


def add_commands(sub: Any) -> dict[str, Callable[[argparse.Namespace], None]]:
    """Add ``serve``, ``chat``, ``generate`` and ``embed`` to the subparsers ``sub`` of the ``zoo`` command.

    Args:
        sub: what ``ArgumentParser.add_subparsers`` returned.

    Returns:
        Each added command's name and the function that runs it on the parsed arguments.
    """
    serve_parser = sub.add_parser("serve", help="serve a model over the OpenAI API")
    serve_parser.add_argument("model")
    serve_parser.add_argument("--host", default="127.0.0.1")
    serve_parser.add_argument("--port", type=int, default=8000)
    serve_parser.add_argument("--max-batch", type=_positive, default=16, help="sequences decoded together at most")
    kv = serve_parser.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-memory", type=memory_size, default=None, metavar="SIZE",
                    help="KV cache memory, e.g. 512MiB or 2GiB (default: --max-batch full contexts, at most half "
                         "the memory available; the cache grows with the tokens in use up to it)")
    kv.add_argument("--kv-blocks", type=_positive, default=None,
                    help="KV cache size in blocks of --block-size positions instead of --kv-cache-memory")
    serve_parser.add_argument("--block-size", type=_positive, default=16)
    serve_parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    serve_parser.add_argument("--served-model-name", default=None, help="the model's name in the API (default: MODEL)")
    compiled = serve_parser.add_mutually_exclusive_group()
    compiled.add_argument("--compile", action="store_true",
                          help="run decode-only steps through compiled graphs with dynamic shapes (one for a lone "
                               "request, as generate(compile=True); one for several) and the other steps' decoding "
                               "rows through a compiled attention (Engine(compile=True): each graph compiles once, "
                               "at its first step)")
    compiled.add_argument("--compile-attention", action="store_true",
                          help="attend the decoding rows through one compiled graph (Engine(compile=\"attention\"): "
                               "a few seconds to compile at the first step)")
    serve_parser.add_argument("--lora", type=_lora, action="append", default=[], metavar="NAME=PATH",
                              help="serve a peft LoRA adapter (folder or Hub repo) as model NAME (repeatable)")
    serve_parser.add_argument("--max-loras", type=_positive, default=None,
                              help="adapters resident at once (default with --lora: one each, at least 4; "
                                   "without: none, and /v1/load_lora_adapter is refused)")
    serve_parser.add_argument("--max-lora-rank", type=_positive, default=None,
                              help="the largest adapter rank (default: that of --lora, at least 16)")
    serve_parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                       help="run the engine in its own process, which loads the model, so that HTTP never competes "
                            "with it for the GIL (default); --no-engine-process steps it in a thread of the server")
    from .tool_parsers import PARSERS
    serve_parser.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                              help="how tool calls are read from answers (default: chosen from the chat template)")
    chat_parser = sub.add_parser("chat", help="chat with a model in the terminal (/reset, /system TEXT, /exit)")
    chat_parser.add_argument("model")
    chat_parser.add_argument("--system", default=None, help="a system message")
    generate_parser = sub.add_parser("generate", help="complete one prompt, streamed to stdout")
    generate_parser.add_argument("model")
    generate_parser.add_argument("prompt")
    for command in (serve_parser, chat_parser, generate_parser):
        _quantization_options(command)
    for command in (chat_parser, generate_parser):
        command.add_argument("--max-tokens", type=_positive, default=256)
        command.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
        command.add_argument("--seed", type=int, default=None)
        constrained = command.add_mutually_exclusive_group()
        constrained.add_argument("--json-schema", default=None, metavar="FILE",
                                 help="constrain the output to JSON valid under the JSON schema in FILE")
        constrained.add_argument("--regex", default=None, help="constrain the output to match this regex")
    embed_parser = sub.add_parser("embed", help="embed texts (a model with an embedding head): one JSON list per line")
    embed_parser.add_argument("model")
    embed_parser.add_argument("texts", nargs="+")
    return {"serve": serve, "chat": chat, "generate": generate, "embed": embed}


def parser() -> argparse.ArgumentParser:
    """The parser of these commands alone (``cli.main.parser`` is the whole ``zoo`` command)."""
    p = argparse.ArgumentParser(prog="zoo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_commands(p.add_subparsers(dest="command", required=True))
    return p


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from .engine_process import ModelSource
    from .openai_api import create_app

    source: Any = False
    quantization = dict(quantize=args.quantize, dequantize=args.dequantize)
    # The server process keeps the config and tokenizer only (the weights it reads go to the meta device); a
    # refused --quantize is found there, before the engine process starts.
    model = _load(args.model, device="meta", prepare=False, **quantization) if args.engine_process else None
    if model is not None and getattr(model.config, "head", None) != "embedding":
        source = ModelSource(path=args.model, **quantization)  # the engine process loads the weights
    else:
        model = _load(args.model, **quantization)  # in-process: the thread engine or an embedding model
    app = create_app(model, model.tokenizer, model_name=args.served_model_name or args.model, api_key=args.api_key,
                     engine_process=source, max_num_seqs=args.max_batch, num_blocks=args.kv_blocks,
                     block_size=args.block_size, kv_cache_bytes=args.kv_cache_memory,
                     compile="attention" if args.compile_attention else args.compile,
                     tool_call_parser=args.tool_call_parser,
                     loras=dict(args.lora), max_loras=args.max_loras or (max(4, len(args.lora)) if args.lora else 0),
                     max_lora_rank=args.max_lora_rank)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


def _lora(text: str) -> tuple[str, str]:
    """``--lora NAME=PATH``."""
    name, sep, path = text.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a peft adapter folder or Hub repo), got {text!r}")
    return name, path


def _sampling(args: argparse.Namespace) -> Any:
    from models.generation.sampling import SamplingParams

    if args.temperature < 0:
        raise SystemExit(f"zoo: --temperature must be >= 0, got {args.temperature}")
    return SamplingParams() if args.temperature == 0 else SamplingParams(do_sample=True, temperature=args.temperature)


def _constraint(args: argparse.Namespace) -> Any:
    """The ``Constraint`` of ``--json-schema FILE`` / ``--regex`` (None without them); a bad one exits."""
    from models.generation.constraints import Constraint
    try:
        if getattr(args, "json_schema", None) is not None:
            with open(args.json_schema, encoding="utf-8") as f:
                constraint = Constraint.json_schema(f.read())
        elif getattr(args, "regex", None) is not None:
            constraint = Constraint.regex(args.regex)
        else:
            return None
        constraint.check()
    except (OSError, ValueError) as err:
        raise SystemExit(f"zoo: {err}") from None
    return constraint


def _stream(engine: Any, ids: list[int], args: argparse.Namespace, stdout: Any) -> str:
    """Generate from ``ids``, writing the text as it comes; Ctrl-C stops (aborts) this reply only."""
    room = engine.context - len(ids)
    if room < 1:
        raise ValueError(f"the prompt fills the model's context of {engine.context} tokens")
    request = engine.add_request(ids, _sampling(args), max_tokens=min(args.max_tokens, room), seed=args.seed,
                                 constraint=_constraint(args))
    text = []
    try:
        while engine.has_unfinished():
            for delta in engine.step():
                stdout.write(delta.text)
                stdout.flush()
                text.append(delta.text)
    except KeyboardInterrupt:
        engine.abort(request)
        stdout.write(" [stopped]")
    finally:
        engine.requests.pop(request, None)
    stdout.write("\n")
    return "".join(text)


def chat(args: argparse.Namespace, stdin: Any = None, stdout: Any = None) -> None:
    """A chat through the model's template: each answer streams as it is generated and joins the history.
    ``/reset`` clears the history, ``/system TEXT`` sets the system message (and clears), ``/exit`` or EOF ends;
    Ctrl-C during an answer stops that answer."""
    from .engine import Engine

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    model = _load(args.model, args.quantize, args.dequantize)
    tok = model.tokenizer
    if getattr(tok, "chat_template", None) is None:
        raise SystemExit(f"zoo: {args.model} has no chat template (chat_template.jinja or tokenizer_config.json)")
    engine = Engine(model, tok, max_num_seqs=1)
    system = args.system
    messages: list[dict[str, str]] = []
    while True:
        stdout.write("> ")
        stdout.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            stdout.write("\n")
            continue
        if not line or line.strip() == "/exit":
            return
        line = line.rstrip("\n")
        if line.strip() in ("/reset", "/system") or line.startswith("/system "):
            messages = []
            if line.startswith("/system"):
                system = line.removeprefix("/system").strip() or None
            stdout.write("[history cleared]\n")
            continue
        if not line.strip():
            continue
        turn = [*([{"role": "system", "content": system}] if system else []), *messages,
                {"role": "user", "content": line}]
        try:
            answer = _stream(engine, tok.apply_chat_template(turn, add_generation_prompt=True), args, stdout)
        except ValueError as err:
            stdout.write(f"[{err}; /reset to start again]\n")
            continue
        messages += [{"role": "user", "content": line}, {"role": "assistant", "content": answer}]


def generate(args: argparse.Namespace, stdout: Any = None) -> None:
    from .engine import Engine

    model = _load(args.model, args.quantize, args.dequantize)
    engine = Engine(model, model.tokenizer, max_num_seqs=1)
    _stream(engine, model.tokenizer.encode(args.prompt), args, stdout or sys.stdout)


def embed(args: argparse.Namespace, stdout: Any = None) -> None:
    model = _load(args.model)
    if getattr(model.config, "head", None) != "embedding":
        raise SystemExit(f"zoo: {args.model} has no embedding head")
    stdout = stdout or sys.stdout
    for vector in model.embed(args.texts).tolist():
        stdout.write(json.dumps(vector) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    """Run one of these commands (as ``python -m serving.cli``); ``zoo`` itself is ``cli.main.main``."""
    p = argparse.ArgumentParser(prog="zoo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    handlers = add_commands(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    handlers[args.command](args)


if __name__ == "__main__":
    main()
