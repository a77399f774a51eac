"""The ``zoo`` command: ``zoo serve MODEL`` (the OpenAI-compatible server) and ``zoo chat MODEL`` (a chat in the
terminal). ``MODEL`` is a checkpoint folder, a Hub repo id or a ``.gguf`` file (``models.from_pretrained``).

    zoo serve ./my-model --port 8000 --api-key sk-local --served-model-name mine
    zoo chat ./my-model --max-tokens 256 --temperature 0.7
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def _load(path: str) -> Any:
    import models

    model = models.from_pretrained(path).eval()
    if getattr(model, "tokenizer", None) is None:
        raise SystemExit(f"zoo: {path} has no tokenizer (tokenizer.json or a GGUF vocabulary); cannot serve text")
    return model


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zoo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API")
    serve.add_argument("model")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-batch", type=_positive, default=16, help="sequences decoded together at most")
    serve.add_argument("--kv-blocks", type=_positive, default=None,
                       help="KV cache blocks of --block-size positions (default: --max-batch full contexts)")
    serve.add_argument("--block-size", type=_positive, default=16)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    serve.add_argument("--served-model-name", default=None, help="the model's name in the API (default: MODEL)")
    chat = sub.add_parser("chat", help="chat with a model in the terminal")
    chat.add_argument("model")
    chat.add_argument("--system", default=None, help="a system message")
    chat.add_argument("--max-tokens", type=_positive, default=256)
    chat.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    chat.add_argument("--seed", type=int, default=None)
    return p


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from .openai_api import create_app

    model = _load(args.model)
    app = create_app(model, model.tokenizer, model_name=args.served_model_name or args.model, api_key=args.api_key,
                     max_num_seqs=args.max_batch, num_blocks=args.kv_blocks, block_size=args.block_size)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


def chat(args: argparse.Namespace, stdin: Any = None, stdout: Any = None) -> None:
    """Read user turns line by line; print each answer as it is generated. An empty line or EOF ends."""
    from models.generation.sampling import SamplingParams

    from .engine import Engine

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    model = _load(args.model)
    tok = model.tokenizer
    if getattr(tok, "chat_template", None) is None:
        raise SystemExit(f"zoo: {args.model} has no chat template (chat_template.jinja or tokenizer_config.json)")
    engine = Engine(model, tok, max_num_seqs=1)
    sampling = SamplingParams() if args.temperature == 0 else SamplingParams(do_sample=True,
                                                                             temperature=args.temperature)
    messages = [] if args.system is None else [{"role": "system", "content": args.system}]
    while True:
        stdout.write("> ")
        stdout.flush()
        line = stdin.readline()
        if not line.strip():
            return
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)
        room = engine.context - len(ids)
        if room < 1:
            stdout.write("[the conversation fills the model's context; start a new one]\n")
            return
        request = engine.add_request(ids, sampling, max_tokens=min(args.max_tokens, room), seed=args.seed)
        answer = []
        while engine.has_unfinished():
            for delta in engine.step():
                if delta.request_id == request:
                    stdout.write(delta.text)
                    stdout.flush()
                    answer.append(delta.text)
        engine.requests.pop(request, None)
        stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(answer)})


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    {"serve": serve, "chat": chat}[args.command](args)


if __name__ == "__main__":
    main()
