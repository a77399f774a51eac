"""The ``zoo`` command. ``MODEL`` is a checkpoint folder, a ``.gguf`` file or a Hub id ``OWNER/NAME``
(``models.from_pretrained``); the options carry llama.cpp's and vLLM's names (``serving.cli_options``, docs/cli.md).

    zoo generate ./my-model "Once upon a time" -n 64           # greedy, streamed; the speed on stderr
    echo "Once upon a time" | zoo generate ./my-model --temp 0.8 -s 1    # the prompt from stdin (or -f FILE)
    zoo chat ./my-model --system "Be brief."     # samples as the model's generation_config.json says; /help
    zoo serve ./my-model --port 8000 -c 4096 -t 8 --api-key sk-local    # the OpenAI API, /tokenize, /metrics
    zoo serve ./my-model --lora sql=./sql-lora --lora chat=user/chat-lora   # adapters chosen by the request's model
    zoo generate ./my-model "A date: " --regex '[0-9]{4}-[0-9]{2}-[0-9]{2}'     # output constrained (or --json-schema)
    zoo generate ./my-model "Once upon a time" --quantize int8    # a float checkpoint's weights quantized on load
    zoo chat ./model.gguf --dequantize                            # a quantized checkpoint's weights as float32
    zoo embed ./my-embedder "first text" "second text"                             # one JSON vector per line

A mistake (a wrong path, a port in use, a bad value) prints one line, ``zoo: error: ...``; ``zoo --debug ...`` or
``ZOO_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .cache_size import KV_CACHE_DTYPES
from .cli_chat import ChatSession, run_chat
from .cli_options import (
    LLAMA_CPP_SAMPLING,
    HelpFormatter,
    add_compile_option,
    add_context_option,
    add_model_options,
    add_prepack_option,
    add_prompt_options,
    add_sampling_options,
    apply_threads,
    check_port,
    model_options,
    model_sampling_defaults,
    positive_int,
    prepack_choice,
    read_prompt,
    sampling_params,
)
from .cli_stream import cut_note, stream_reply
from .startup import startup_line

#: ``zoo serve``'s ``Engine(compile=...)`` without a flag: the compiled steps of ``True``, compiled ahead of time in a
#: child process. Measured (``python -m benchmarks.serve_peer --modes aot compile eager``, SmolLM2-135M's shape, one
#: run against llama-server): 17.6 tok/s alone and 98.4 with 16 in flight against 14.5 / 93.2 for ``True`` and
#: 10.8 / 70.9 for eager (an earlier run: 19.2 / 107.5 against 19.4 / 114.9), at the eager engine's memory plus 41
#: MiB against ``True``'s 258 (docs/engine-performance.md).
SERVE_COMPILE: bool | str = "aot"


def _load(path: str, quantize: str | None = None, dequantize: bool = False, *, prepare: bool = True,
          **options: Any) -> Any:
    """``models.from_pretrained(path, **options)`` in eval mode, with ``--quantize`` / ``--dequantize`` checked and,
    with ``prepare``, applied (``serving.loading``); a folder without a tokenizer is refused before its weights are
    read, a refused request or a model without a tokenizer exits with a one-line message."""
    import models

    from .loading import apply_quantization, check_quantization, check_request, load_options

    try:
        check_request(quantize, dequantize)
    except ValueError as err:
        raise SystemExit(f"zoo: error: {err}") from None
    folder = Path(path).expanduser()
    if folder.is_dir() and (folder / "config.json").is_file() and not (folder / "tokenizer.json").is_file():
        raise SystemExit(f"zoo: error: {path} has no tokenizer.json, so it cannot read or write text; save the model "
                         "with its tokenizer (model.save_pretrained(folder, tokenizer=tok))")
    model = models.from_pretrained(path, **load_options(dequantize, options)).eval()
    if getattr(model, "tokenizer", None) is None:
        raise SystemExit(f"zoo: error: {path} has no tokenizer (tokenizer.json or a GGUF vocabulary); cannot read or "
                         "write text")
    try:
        check_quantization(model, path, quantize, dequantize)
    except ValueError as err:
        raise SystemExit(f"zoo: error: {err}") from None
    return apply_quantization(model, quantize, dequantize) if prepare else model


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def memory_size(text: str) -> int:
    """``"512MiB"``, ``"2GiB"``, ``"1.5G"``, ``"4096"`` (bytes) as a number of bytes; a trailing ``B`` is optional.

    Args:
        text: the size as typed on the command line (decimal ``k``/``M``/``G``/``T`` or binary ``Ki``/``Mi``/...).

    Returns:
        The size in bytes.

    Raises:
        argparse.ArgumentTypeError: ``text`` is not such a size, or is under 1 byte.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 512MiB, 2GiB or 1000000 (bytes), got {text!r}")
    value = int(float(match.group(1)) * _UNITS[match.group(2) or ""])
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a size of at least 1 byte, got {text!r}")
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
    def command(name: str, text: str) -> argparse.ArgumentParser:
        made = sub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)
        made.add_argument("model", help="a checkpoint folder, a .gguf file or a Hub id (OWNER/NAME)")
        return made

    serve_parser = command("serve", "serve a model over the OpenAI API")
    serve_parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    serve_parser.add_argument("--port", type=int, default=8000, help="the port to listen on")
    serve_parser.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", type=positive_int, default=16,
                              help="sequences decoded together at most")
    kv = serve_parser.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-memory", type=memory_size, default=None, metavar="SIZE",
                    help="KV cache memory, e.g. 512MiB or 2GiB (default: --max-batch full contexts, at most half "
                         "the memory available; the cache grows with the tokens in use up to it)")
    kv.add_argument("--kv-blocks", type=positive_int, default=None,
                    help="KV cache size in blocks of --block-size positions instead of --kv-cache-memory")
    serve_parser.add_argument("--block-size", type=positive_int, default=16, help="positions per KV cache block")
    serve_parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                              help="the KV cache's dtype (default auto: the model's); float16 under a float32 model "
                                   "halves the cache, as llama.cpp's default (Engine(kv_cache_dtype=...))")
    add_prepack_option(serve_parser)
    serve_parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    serve_parser.add_argument("--served-model-name", "--alias", dest="served_model_name", default=None,
                              help="the model's name in the API (default: the folder's or file's name, or the Hub id)")
    compiled = serve_parser.add_mutually_exclusive_group()
    compiled.add_argument("--compile", action="store_true",
                          help="run decode-only steps through compiled graphs with dynamic shapes (one for a lone "
                               "request, as generate(compile=True); one for several) and the other steps' decoding "
                               "rows through a compiled attention (Engine(compile=True): each graph compiles once, "
                               "at its first step)")
    compiled.add_argument("--compile-attention", action="store_true",
                          help="attend the decoding rows through one compiled graph (Engine(compile=\"attention\"): "
                               "a few seconds to compile at the first step)")
    compiled.add_argument("--compile-single", action="store_true",
                          help="a lone decoding request through the single-row graph, as generate(compile=True), and "
                               "the other steps eager with a compiled attention (Engine(compile=\"single\"))")
    compiled.add_argument("--compile-aot", action="store_true",
                          help="the two graphs of --compile, and one for 4 or more rows whose products run through "
                               "oneDNN, compiled ahead of time by AOTInductor in a child process "
                               "(Engine(compile=\"aot\")): the engine's process holds no compiler (less memory); "
                               "the steps run eagerly until the packages are ready (minutes, once per model and "
                               "machine: kept in $ZOO_AOT_CACHE, default ~/.cache/transformer-zoo/aot)")
    compiled.add_argument("--eager", action="store_true",
                          help="compile nothing (Engine(compile=False)); the default is the mode measured fastest on "
                               f"CPU, with the least memory of the compiled ones: {SERVE_COMPILE!r} "
                               "(docs/engine-performance.md)")
    serve_parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                              help="run the engine in its own process, which loads the model, so that HTTP never "
                                   "competes with it for the GIL; --no-engine-process steps it in a thread")
    serve_parser.add_argument("--lora", type=_lora, action="append", default=[], metavar="NAME=PATH",
                              help="serve a peft LoRA adapter (folder or Hub repo) as model NAME (repeatable)")
    serve_parser.add_argument("--max-loras", type=positive_int, default=None,
                              help="adapters resident at once (default with --lora: one each, at least 4; "
                                   "without: none, and /v1/load_lora_adapter is refused)")
    serve_parser.add_argument("--max-lora-rank", type=positive_int, default=None,
                              help="the largest adapter rank (default: that of --lora, at least 16)")
    from .tool_parsers import PARSERS
    serve_parser.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                              help="how tool calls are read from answers (default: chosen from the chat template)")
    chat_parser = command("chat", "chat with a model in the terminal (/help lists the commands)")
    chat_parser.add_argument("--system", "-sys", dest="system", default=None, help="a system message")
    chat_parser.add_argument("--timings", action="store_true",
                             help="print the prompt and generation speed after each answer (/timings toggles)")
    generate_parser = command("generate", "complete one prompt, streamed to stdout (the speed on stderr)")
    add_prompt_options(generate_parser)
    generate_parser.add_argument("--timings", action=argparse.BooleanOptionalAction, default=True,
                                 help="print the prompt and generation speed on stderr at the end")
    for each in (serve_parser, chat_parser, generate_parser):
        add_model_options(each)
        add_context_option(each)
        _quantization_options(each)
    for each in (chat_parser, generate_parser):
        add_compile_option(each)
        add_sampling_options(each)
        constrained = each.add_mutually_exclusive_group()
        constrained.add_argument("--json-schema", default=None, metavar="FILE",
                                 help="constrain the output to JSON valid under the JSON schema in FILE")
        constrained.add_argument("--regex", default=None, help="constrain the output to match this regex")
    chat_parser.epilog = ("Sampling defaults: the model's generation_config.json, else llama.cpp's (--temp 0.8 "
                          "--top-k 40 --top-p 0.95 --min-p 0.05); --temp 0 is greedy.")
    generate_parser.epilog = ("Sampling defaults: greedy (--temp 0), the same text every time; give --temp (e.g. 0.8) "
                              "to sample.")
    embed_parser = command("embed", "embed texts (a model with an embedding head): one JSON list per line")
    embed_parser.add_argument("texts", nargs="+", help="the texts to embed")
    add_model_options(embed_parser)
    return {"serve": serve, "chat": chat, "generate": generate, "embed": embed}


def parser() -> argparse.ArgumentParser:
    """The parser of these commands alone (``cli.main.parser`` is the whole ``zoo`` command).

    Returns:
        A parser with the ``serve``, ``chat``, ``generate`` and ``embed`` subcommands.
    """
    p = argparse.ArgumentParser(prog="zoo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_commands(p.add_subparsers(dest="command", required=True))
    return p


def served_name(model: str) -> str:
    """The name a model is served under by default: a local folder's or file's name (without ``.gguf``), else the
    Hub id as given.

    Args:
        model: the ``MODEL`` argument.

    Returns:
        The name.
    """
    path = Path(model).expanduser()
    if path.exists():
        resolved = path.resolve()
        return resolved.stem if resolved.is_file() else resolved.name
    return model


def serve(args: argparse.Namespace) -> None:
    """``zoo serve``: load the model and serve the OpenAI API with uvicorn until stopped.

    Args:
        args: the parsed ``zoo serve`` options.

    Raises:
        OSError: the port cannot be bound (``check_port``, before anything is loaded).
        ValueError: a port outside 0..65535.
        SystemExit: the model, its tokenizer, ``--quantize``/``--dequantize`` or ``--ctx-size`` is refused (a
            one-line message).
    """
    import logging

    import uvicorn

    from .engine_process import ModelSource
    from .openai_api import create_app

    check_port(args.host, args.port)  # before anything is loaded
    apply_threads(args)
    source: Any = False
    quantization = dict(quantize=args.quantize, dequantize=args.dequantize)
    options = model_options(args)
    # The server process keeps the config and tokenizer only (the weights it reads go to the meta device); a
    # refused --quantize is found there, before the engine process starts.
    meta = {k: v for k, v in options.items() if k != "device"}
    model = _load(args.model, device="meta", prepare=False, **quantization, **meta) if args.engine_process else None
    if model is not None and getattr(model.config, "head", None) != "embedding":
        source = ModelSource(path=args.model, options=options, **quantization)  # the engine process loads the weights
    else:
        model = _load(args.model, **quantization, **options)  # in-process: the thread engine or an embedding model
    if getattr(model.config, "head", None) != "embedding":
        _check_context(args, model)
    name = args.served_model_name or served_name(args.model)
    limits = dict(max_num_seqs=args.max_batch, num_blocks=args.kv_blocks, block_size=args.block_size,
                  kv_cache_bytes=args.kv_cache_memory, max_model_len=args.ctx_size,
                  compile=serve_compile(args), kv_cache_dtype=args.kv_cache_dtype,
                  prepack_weights=prepack_choice(args))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    logging.getLogger("zoo").info(startup_line(name, model, args, limits))
    app = create_app(model, model.tokenizer, model_name=name, api_key=args.api_key, engine_process=source, **limits,
                     tool_call_parser=args.tool_call_parser, loras=dict(args.lora),
                     max_loras=args.max_loras or (max(4, len(args.lora)) if args.lora else 0),
                     max_lora_rank=args.max_lora_rank)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


def serve_compile(args: argparse.Namespace) -> bool | str:
    """``Engine(compile=...)`` for ``zoo serve``'s flags: the one given, else ``SERVE_COMPILE``.

    Args:
        args: the parsed ``zoo serve`` options.

    Returns:
        ``True``, ``"attention"``, ``"single"``, ``"aot"`` or ``False``.
    """
    flags = {"compile": True, "compile_attention": "attention", "compile_single": "single", "compile_aot": "aot",
             "eager": False}
    return next((mode for flag, mode in flags.items() if getattr(args, flag, False)), SERVE_COMPILE)


def _lora(text: str) -> tuple[str, str]:
    """``--lora NAME=PATH``."""
    name, sep, path = text.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a peft adapter folder or Hub repo), got {text!r}")
    return name, path


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
        raise SystemExit(f"zoo: error: {err}") from None
    return constraint


def _check_context(args: argparse.Namespace, model: Any) -> None:
    """Refuse a ``--ctx-size`` beyond the model's ``max_len`` (its positions end there)."""
    if args.ctx_size is not None and args.ctx_size > model.config.max_len:
        raise SystemExit(f"zoo: error: --ctx-size {args.ctx_size} is more than the model's context of "
                         f"{model.config.max_len} tokens (config max_len); give at most that")


def _engine(args: argparse.Namespace, model: Any) -> Any:
    from .engine import Engine

    _check_context(args, model)
    return Engine(model, model.tokenizer, max_num_seqs=1, max_model_len=args.ctx_size, compile=args.compile)


def chat(args: argparse.Namespace, stdin: Any = None, stdout: Any = None) -> None:
    """A chat through the model's template (``serving.cli_chat``): each answer streams as it is generated and joins
    the history; lines starting with ``/`` are commands (``/help``).

    Args:
        args: the parsed ``zoo chat`` options.
        stdin: where the user's lines are read (None: ``sys.stdin``).
        stdout: where the answers are written (None: ``sys.stdout``).

    Raises:
        SystemExit: the model has no chat template, or the model or an option is refused.
    """
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    apply_threads(args)
    defaults = {**LLAMA_CPP_SAMPLING, **model_sampling_defaults(args.model)}
    params = sampling_params(args, defaults)  # a bad option is refused before the model loads
    constraint = _constraint(args)
    model = _load(args.model, args.quantize, args.dequantize, **model_options(args))
    tok = model.tokenizer
    if getattr(tok, "chat_template", None) is None:
        raise SystemExit(f"zoo: error: {args.model} has no chat template (chat_template.jinja or "
                         "tokenizer_config.json); use zoo generate for plain completion")
    session = ChatSession(_engine(args, model), tok, params, max_tokens=args.max_tokens, seed=args.seed,
                          system=args.system, timings=args.timings, constraint=constraint)
    run_chat(session, stdin, stdout)


def generate(args: argparse.Namespace, stdout: Any = None, stdin: Any = None, stderr: Any = None) -> None:
    """Complete one prompt (the argument, ``-f FILE`` or standard input), streamed to ``stdout``; the speed goes to
    ``stderr``.

    Args:
        args: the parsed ``zoo generate`` options.
        stdout: where the completion is written (None: ``sys.stdout``).
        stdin: where the prompt is read when neither the argument nor ``-f`` gives it (None: ``sys.stdin``).
        stderr: where the speed is written with ``--timings`` (None: ``sys.stderr``).
    """
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    apply_threads(args)
    params = sampling_params(args, {})
    constraint = _constraint(args)
    prompt = read_prompt(args, stdin)
    model = _load(args.model, args.quantize, args.dequantize, **model_options(args))
    timing = stream_reply(_engine(args, model), model.tokenizer.encode(prompt), params, args.max_tokens, args.seed,
                          stdout, mark_cut=False, constraint=constraint)
    if args.timings:
        cut = f" [{cut_note(timing, args.max_tokens)}]" if timing.finish_reason == "length" else ""
        stderr.write(f"zoo: {timing.summary()}{cut}\n")


def embed(args: argparse.Namespace, stdout: Any = None) -> None:
    """``zoo embed``: write the embedding of each text as one JSON list per line.

    Args:
        args: the parsed ``zoo embed`` options.
        stdout: where the vectors are written (None: ``sys.stdout``).

    Raises:
        SystemExit: the model has no embedding head.
    """
    apply_threads(args)
    model = _load(args.model, **model_options(args))
    if getattr(model.config, "head", None) != "embedding":
        raise SystemExit(f"zoo: error: {args.model} has no embedding head; zoo embed needs an embedding model "
                         "(a sentence-transformers folder, or a checkpoint saved with head='embedding')")
    stdout = stdout or sys.stdout
    for vector in model.embed(args.texts).tolist():
        stdout.write(json.dumps(vector) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    """Run one of these commands (as ``python -m serving.cli``); ``zoo`` itself is ``cli.main.main``.

    Args:
        argv: the command-line arguments (None: ``sys.argv[1:]``).
    """
    p = argparse.ArgumentParser(prog="zoo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    handlers = add_commands(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    handlers[args.command](args)


if __name__ == "__main__":
    main()
