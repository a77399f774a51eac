"""The options of the ``zoo`` commands that run a model, under the names llama.cpp, vLLM and Ollama users know, each
added by one function so that a command takes a group with one line (``add_sampling_options(parser)``).

| what | zoo | llama.cpp | vLLM |
|---|---|---|---|
| device, dtype | ``--device``, ``--dtype`` | ``--device`` | ``--device``, ``--dtype`` |
| CPU threads | ``-t/--threads`` | ``-t/--threads`` | |
| context | ``-c/--ctx-size`` (``--max-model-len``) | ``-c/--ctx-size`` | ``--max-model-len`` |
| tokens to generate | ``-n/--max-tokens`` (``--n-predict``) | ``-n/--n-predict`` | ``max_tokens`` |
| sampling | ``--temp``, ``--top-p``, ``--top-k``, ``--min-p``, ``--repeat-penalty``, ``-s/--seed`` | same | |
| penalties | ``--presence-penalty``, ``--frequency-penalty`` | same | same |

(``--temperature`` and ``--repetition-penalty`` are aliases, as vLLM and ``transformers`` name them.)

``sampling_params(args, defaults)`` builds the ``SamplingParams`` of the parsed options, with the model's own
defaults (``generation_config.json``, ``model_sampling_defaults``) under the options the user gave.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
from pathlib import Path
from typing import Any

#: llama-cli's sampling defaults (llama.cpp ``common/common.h``), used by ``zoo chat`` when the model's
#: ``generation_config.json`` sets none: it samples, as chat front ends do, so an answer does not loop greedily.
LLAMA_CPP_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}

#: ``generation_config.json`` keys read as sampling defaults (``transformers``' names; ``min_p`` as it writes it).
_GENERATION_KEYS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` with every option's default (none shown for options without one) and descriptions kept as
    written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in text or not action.option_strings:
            return text
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1.

    Args:
        text: the option's value.

    Returns:
        The integer.

    Raises:
        argparse.ArgumentTypeError: not an integer, or below 1.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _fraction(text: str) -> float:
    value = _finite(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text}")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
    return value


def _penalty(text: str) -> float:
    value = _finite(text)
    if not -2.0 <= value <= 2.0:
        raise argparse.ArgumentTypeError(f"expected a number in [-2, 2] (OpenAI's range), got {text}")
    return value


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--device``, ``--dtype`` and ``-t/--threads``: where and how the weights are loaded and run.

    Args:
        parser: the command's parser (or an argument group of it).
    """
    parser.add_argument("--device", default="cpu", help="where the weights go: cpu, cuda, cuda:1, mps ...")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="the weights' floating type (auto: the checkpoint's own)")
    parser.add_argument("-t", "--threads", type=positive_int, default=None,
                        help="CPU threads for the model (default: PyTorch's, one per core)")


def add_context_option(parser: argparse.ArgumentParser) -> None:
    """``-c/--ctx-size`` (vLLM: ``--max-model-len``): the context the engine allows, prompt and answer together.

    Args:
        parser: the command's parser (or an argument group of it).
    """
    parser.add_argument("-c", "--ctx-size", "--max-model-len", dest="ctx_size", type=positive_int, default=None,
                        help="tokens of context, prompt and answer together (default: the model's max_len)")


#: ``zoo serve``'s and ``zoo bench``'s default for ``--prepack-weights`` (without adapters): off, as measured
#: (docs/engine-performance.md). On Qwen3-0.6B's shape, prepacking took 16 requests in flight from 0.93× llama-server
#: to 1.00–1.01× at 1 thread and 0.88–0.96× at 2, but a lone request from 1.18× ``generate(compile=True)`` to
#: 1.00–1.06× at 1 thread and 0.76–0.96× at 2 (one row reads the blocked layout 1.25–1.47× slower); a lone request
#: is the common case of a CPU server.
PREPACK_DEFAULT = False


def add_prepack_option(parser: argparse.ArgumentParser) -> None:
    """``--prepack-weights`` / ``--no-prepack-weights``: ``Engine(prepack_weights=...)``.

    Args:
        parser: the command's parser (or an argument group of it).
    """
    parser.add_argument("--prepack-weights", action=argparse.BooleanOptionalAction, default=None,
                        help="hold the float32 linear weights in oneDNN's blocked layout (Engine(prepack_weights=True)"
                             ": the same bytes; many decoding rows multiply faster, one row slower; tied heads and "
                             "weights under 2^20 elements stay plain); default: "
                             f"{'on' if PREPACK_DEFAULT else 'off'} without --lora or --max-loras")


def prepack_choice(args: argparse.Namespace) -> bool:
    """``Engine(prepack_weights=...)`` for the flags: the one given, else ``PREPACK_DEFAULT`` where torch has oneDNN
    and no adapters are asked for (LoRA slots wrap the plain layers).

    Args:
        args: the parsed options (``prepack_weights``; ``lora`` and ``max_loras`` where the command has them).

    Returns:
        Whether to prepack.

    Raises:
        SystemExit: ``--prepack-weights`` with ``--lora`` or ``--max-loras``.
    """
    from blocks.prepacked_linear import prepacking_available

    adapters = bool(getattr(args, "lora", None) or getattr(args, "max_loras", None))
    if args.prepack_weights and adapters:
        raise SystemExit("zoo: --prepack-weights cannot be combined with --lora or --max-loras (LoRA slots wrap the "
                         "plain linear layers); drop one of them")
    if args.prepack_weights is not None:
        return args.prepack_weights
    return PREPACK_DEFAULT and not adapters and prepacking_available()


def add_compile_option(parser: argparse.ArgumentParser) -> None:
    """``--compile``: decode through one compiled graph (``Engine(compile=True)``).

    Args:
        parser: the command's parser (or an argument group of it).
    """
    parser.add_argument("--compile", action="store_true",
                        help="run decode steps through one compiled graph (tens of seconds to compile first)")


def add_sampling_options(parser: argparse.ArgumentParser, *, max_tokens: int = 256) -> None:
    """The sampling options of ``generate`` and ``chat``; a value not given stays ``None`` so that the model's
    defaults apply (``sampling_params``).

    Args:
        parser: the command's parser.
        max_tokens: the default of ``-n/--max-tokens``.
    """
    group = parser.add_argument_group("sampling (defaults: see the end of --help)")
    group.add_argument("-n", "--max-tokens", "--n-predict", dest="max_tokens", type=positive_int, default=max_tokens,
                       help="tokens to generate at most")
    group.add_argument("--temp", "--temperature", dest="temperature", type=_finite, default=None,
                       help="sampling temperature; 0 picks the most likely token (greedy)")
    group.add_argument("--top-p", type=_fraction, default=None, help="nucleus sampling: keep this much probability")
    group.add_argument("--top-k", type=int, default=None, help="keep the K most likely tokens (0: all)")
    group.add_argument("--min-p", type=_fraction, default=None,
                       help="drop tokens less likely than this fraction of the most likely one (0: off)")
    group.add_argument("--repeat-penalty", "--repetition-penalty", dest="repeat_penalty", type=_finite, default=None,
                       help="divide the logits of tokens already seen by this (1: off)")
    group.add_argument("--presence-penalty", type=_penalty, default=None,
                       help="subtract this from the logits of tokens generated already (0: off)")
    group.add_argument("--frequency-penalty", type=_penalty, default=None,
                       help="subtract this per time a token was generated (0: off)")
    group.add_argument("-s", "--seed", type=int, default=None, help="random seed of the sampling")


def add_prompt_options(parser: argparse.ArgumentParser) -> None:
    """The prompt of ``generate``: an argument, ``-f/--file FILE``, or standard input (``-`` or piped).

    Args:
        parser: the command's parser (or an argument group of it).
    """
    parser.add_argument("prompt", nargs="?", default=None, help="the prompt; '-' or none: read standard input")
    parser.add_argument("-f", "--file", default=None, help="read the prompt from this file")


def read_prompt(args: argparse.Namespace, stdin: Any = None) -> str:
    """The prompt the options name: ``-f FILE``, the argument, or standard input.

    Args:
        args: the parsed options (``prompt``, ``file``).
        stdin: standard input (default ``sys.stdin``).

    Returns:
        The prompt's text.

    Raises:
        ValueError: both a prompt and ``-f``, an unreadable file, or no prompt at all (one line each).
    """
    if args.file is not None and args.prompt not in (None, "-"):
        raise ValueError("give the prompt as an argument or with -f FILE, not both")
    if args.file is not None:
        try:
            return Path(args.file).read_text(encoding="utf-8")
        except OSError as err:
            raise ValueError(f"cannot read the prompt file {args.file}: {err.strerror or err}") from None
        except UnicodeDecodeError:
            raise ValueError(f"the prompt file {args.file} is not UTF-8 text") from None
    if args.prompt is not None and args.prompt != "-":
        return args.prompt
    stdin = stdin or sys.stdin
    if args.prompt is None and stdin.isatty():
        raise ValueError("no prompt: give it as an argument, with -f FILE, or on standard input (echo hi | zoo ...)")
    return stdin.read()


def model_sampling_defaults(path: str) -> dict[str, Any]:
    """The sampling settings of a local checkpoint's ``generation_config.json`` (``transformers``' file), by
    ``SamplingParams`` field; empty when there is none (a Hub id, a GGUF file) or it sets none.

    Args:
        path: the ``MODEL`` argument.

    Returns:
        ``{option: value}`` (``repeat_penalty`` for ``repetition_penalty``).
    """
    file = Path(path).expanduser() / "generation_config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    found = {key: config[key] for key in _GENERATION_KEYS if isinstance(config.get(key), (int, float))}
    if "repetition_penalty" in found:
        found["repeat_penalty"] = found.pop("repetition_penalty")
    return found


def sampling_params(args: argparse.Namespace, defaults: dict[str, Any]) -> Any:
    """The ``SamplingParams`` of the parsed sampling options, each option not given taken from ``defaults``
    (``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repeat_penalty``, ``do_sample``; see
    ``model_sampling_defaults`` and ``LLAMA_CPP_SAMPLING``). A temperature of 0 is greedy.

    Args:
        args: the parsed sampling options.
        defaults: the values of the options not given.

    Returns:
        The ``SamplingParams``.

    Raises:
        ValueError: a negative temperature or top-k, or a value ``SamplingParams`` refuses.
    """
    from models.generation.sampling import SamplingParams

    def pick(name: str, fallback: Any = None) -> Any:
        value = getattr(args, name, None)
        return defaults.get(name, fallback) if value is None else value

    temperature = pick("temperature", 0.0)
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {temperature}")
    top_k = pick("top_k")
    if top_k is not None and top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0: all tokens), got {top_k}")
    sample = temperature > 0 and (getattr(args, "temperature", None) is not None or defaults.get("do_sample", True))
    repeat = pick("repeat_penalty")
    return SamplingParams(
        do_sample=bool(sample), temperature=temperature if sample else 1.0, top_k=top_k or None,
        top_p=pick("top_p") or None, min_p=pick("min_p") or None,
        repetition_penalty=None if repeat in (None, 1.0) else float(repeat),
        presence_penalty=float(pick("presence_penalty", 0.0)), frequency_penalty=float(pick("frequency_penalty", 0.0)),
    )


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """``models.from_pretrained`` options of ``--device`` and ``--dtype`` (``auto``: the checkpoint's own).

    Args:
        args: the parsed options.

    Returns:
        ``{"device": ..., "dtype": ...}`` where they differ from the defaults.
    """
    options: dict[str, Any] = {}
    if getattr(args, "device", "cpu") not in (None, "cpu"):
        options["device"] = args.device
    if getattr(args, "dtype", "auto") not in (None, "auto"):
        options["dtype"] = args.dtype
    return options


def apply_threads(args: argparse.Namespace) -> None:
    """``torch.set_num_threads(--threads)`` when given (an engine process takes the server's count).

    Args:
        args: the parsed options.
    """
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def check_port(host: str, port: int) -> None:
    """Refuse a port that another program holds, before a model is loaded for it.

    Args:
        host: the address to listen on.
        port: the port.

    Raises:
        ValueError: a port outside 0..65535.
        OSError: the port cannot be bound (in use, or not allowed), naming it and what to do.
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        if os.name != "nt":
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as err:
            raise OSError(f"cannot listen on {host}:{port}: {err.strerror or err}; is another server running "
                          "there? Choose another port with --port") from None
