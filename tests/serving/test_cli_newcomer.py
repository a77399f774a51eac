"""The ``zoo`` command as a new user meets it: real files, real processes, a pseudo-terminal for ``chat``.

Each everyday mistake ends with exactly one line on stderr (``zoo: error: ...``) and no traceback; the lines are
asserted whole. The mistakes run in one Python process (a driver calling ``cli.main.main`` per command line, its
stderr and exit status captured; its standard input is a prompt), ``chat`` as a ``python -m cli.main`` process on a
terminal: importing torch costs seconds per process.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import re
import select
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from models import DecoderLM
from serving import cli
from serving.cli_options import LLAMA_CPP_SAMPLING, model_sampling_defaults, sampling_params
from tokenization import Tokenizer, train_byte_level_bpe

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}"
PROMPT = "the quick brown"
TIMING = re.compile(r"zoo: prompt: \d+ tokens? in \d+\.\d\d s \((\d+\.\d|-) tokens/s\) \| generation: \d+ tokens? "
                    r"in \d+\.\d\d s \((\d+\.\d|-) tokens/s\)( \[cut at the 4-token limit; raise it with "
                    r"--max-tokens\])?")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny chat model, the same weights without a tokenizer (and with broken weights: they must never be read),
    a truncated GGUF file and a prompt file."""
    root = tmp_path_factory.mktemp("newcomer")
    corpus = ["the quick brown fox jumps over the lazy dog", "hello there, how are you today?"] * 4
    tok = Tokenizer(train_byte_level_bpe(corpus, vocab_size=300, min_frequency=1).backend, chat_template=TEMPLATE)
    torch.manual_seed(0)
    model = DecoderLM.from_preset("tiny", vocab_size=300, dropout=0.0).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # text that varies
    model.save_pretrained(root / "my-model", tokenizer=tok)
    model.save_pretrained(root / "no-tokenizer")
    (root / "no-tokenizer" / "model.safetensors").write_bytes(b"not read")
    model.save_gguf(root / "whole.gguf")
    data = (root / "whole.gguf").read_bytes()
    (root / "cut.gguf").write_bytes(data[: len(data) // 2])
    (root / "prompt.txt").write_text(PROMPT, encoding="utf-8")
    return {"root": root, "model": root / "my-model", "model_obj": model, "tok": tok}  # type: ignore[dict-item]


def environment(root: Path, hub_port: int) -> dict[str, str]:
    """This checkout first on the path, a Hub that refuses connections, an empty cache, no debug."""
    env = {k: v for k, v in os.environ.items() if k not in ("ZOO_DEBUG", "HF_HUB_OFFLINE")}
    env.update(PYTHONPATH=str(ROOT), HF_ENDPOINT=f"http://127.0.0.1:{hub_port}", HF_HOME=str(root / "hf-home"),
               PYTHONWARNINGS="default", OMP_NUM_THREADS="1")
    return env


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DRIVER = textwrap.dedent("""
    import contextlib, io, json, sys, time
    from cli.main import main
    results = []
    for argv in json.loads(sys.argv[1]):
        err, out, start = io.StringIO(), io.StringIO(), time.perf_counter()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                main(argv)
                code = 0
            except SystemExit as stop:  # a message is what Python prints on stderr, with status 1
                code = stop.code if not isinstance(stop.code, str) else err.write(stop.code + "\\n") and 1
            except BaseException as raised:  # --debug: the exception itself
                code = "raised " + type(raised).__name__
        results.append({"code": code, "stderr": err.getvalue(), "stdout": out.getvalue(),
                        "seconds": round(time.perf_counter() - start, 2)})
    print(json.dumps(results))
""")


def test_everyday_mistakes_print_one_line_and_no_traceback(files) -> None:
    root, model = files["root"], str(files["model"])
    hub_port = closed_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cases = {  # argv -> the exact line on stderr
            ("generate", "my-modle", "hi"):
                f"zoo: error: no checkpoint folder or file named 'my-modle' in {root}, and 'my-modle' is not a Hub id "
                "(OWNER/NAME, e.g. HuggingFaceTB/SmolLM2-135M); check the path",
            ("chat", "./my-modle"): "zoo: error: no checkpoint folder or file at ./my-modle; check the path",
            ("generate", "someone/my-model", "hi"):
                "zoo: error: no local folder 'someone/my-model', and the Hub cannot be reached to download it "
                f"(127.0.0.1:{hub_port}: Connection refused); check the path (./someone/my-model for a folder here) "
                "or the network (HF_ENDPOINT, HF_HUB_OFFLINE=1 for the cache alone)",
            ("generate", "whole.ggfu", "hi"):
                f"zoo: error: no checkpoint folder or file named 'whole.ggfu' in {root}, and 'whole.ggfu' is not a Hub "
                "id (OWNER/NAME, e.g. HuggingFaceTB/SmolLM2-135M); check the path",
            ("generate", "hole.gguf", "hi"):
                "zoo: error: no GGUF file at hole.gguf; GGUF checkpoints are loaded from a local file path",
            ("generate", "cut.gguf", "hi"): re.compile(  # the first tensor past the cut, wherever it falls
                r"zoo: error: GGUF tensor '[\w.]+': offset=\d+ \+ \d+ bytes \(F32 \[\d+(, \d+)?\]\) runs past the "
                r"data section, which holds \d+ bytes of 'cut.gguf'"),
            ("chat", "no-tokenizer"):
                "zoo: error: no-tokenizer has no tokenizer.json, so it cannot read or write text; save the model "
                "with its tokenizer (model.save_pretrained(folder, tokenizer=tok))",
            ("serve", "./my-modle", "--port", str(port)):  # the port is checked before the model is looked for
                f"zoo: error: cannot listen on 127.0.0.1:{port}: Address already in use; is another server running "
                "there? Choose another port with --port",
            ("generate", model, "-f", "absent.txt"):
                "zoo: error: cannot read the prompt file absent.txt: No such file or directory",
            ("generate", model, "hi", "-f", "prompt.txt"):
                "zoo: error: give the prompt as an argument or with -f FILE, not both",
            ("generate", model, "hi", "--temp", "-1"): "zoo: error: --temperature must be >= 0, got -1.0",
            ("generate", model, "hi", "-c", "4096"):
                "zoo: error: --ctx-size 4096 is more than the model's context of 256 tokens (config max_len); give "
                "at most that",
            ("embed", model, "text"):
                f"zoo: error: {model} has no embedding head; zoo embed needs an embedding model (a "
                "sentence-transformers folder, or a checkpoint saved with head='embedding')",
        }
        argvs = [list(argv) for argv in cases]
        argvs += [["--debug", "chat", "./my-modle"], ["--version"],
                  ["generate", model, "-f", "prompt.txt", "-n", "4", "--temp", "0", "--no-timings"],
                  ["generate", model, "-n", "4", "--temp", "0", "-t", "1"]]  # the prompt from stdin
        run = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argvs)], cwd=root, capture_output=True,
                             text=True, env=environment(root, hub_port), timeout=300, input=PROMPT)
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout)
    print({tuple(argv): r.pop("seconds") for argv, r in zip(argvs, results, strict=True)})
    for (argv, line), got in zip(cases.items(), results, strict=False):
        if isinstance(line, re.Pattern):
            assert line.fullmatch(got["stderr"].removesuffix("\n")) and got["stderr"].count("\n") == 1, got
        else:
            assert got["stderr"] == line + "\n", argv
        assert got["code"] == 1, argv
    debug, version, from_file, from_stdin = results[len(cases):]
    assert debug["code"] == "raised FileNotFoundError"  # --debug: the exception goes on (with its traceback)
    assert version["code"] == 0 and version["stdout"] == "zoo (transformer-zoo) 0.1.0\n"
    tok, reference = files["tok"], files["model_obj"]
    ids = tok.encode(PROMPT)
    want = reference.generate(torch.tensor([ids]), max_new_tokens=4, eos_token_id=reference.config.eos_token_id)
    assert from_file == {"code": 0, "stderr": "", "stdout": tok.decode(want[0, len(ids):].tolist()) + "\n"}
    # Standard input, and the speed as one line on stderr (nothing else: no warnings).
    assert from_stdin["code"] == 0 and from_stdin["stdout"] == from_file["stdout"]
    assert TIMING.fullmatch(from_stdin["stderr"].removesuffix("\n")), from_stdin["stderr"]
    assert "Traceback" not in run.stderr and "Warning" not in run.stderr, run.stderr


def _read_until(fd: int, wanted: str, seen: list[str], timeout: float = 60.0) -> str:
    """Read the terminal until ``wanted`` appears after what was read before; return the new text."""
    start, deadline = len("".join(seen)), time.monotonic() + timeout
    while wanted not in "".join(seen)[start:]:
        assert time.monotonic() < deadline, f"no {wanted!r} in {''.join(seen)[start:]!r}"
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            try:
                seen.append(os.read(fd, 4096).decode(errors="replace"))
            except OSError:  # the child closed the terminal
                break
    return "".join(seen)[start:]


def test_chat_in_a_terminal_commands_cut_marker_and_timings(files) -> None:
    root = files["root"]
    pid, fd = pty.fork()
    if pid == 0:  # the child: zoo chat on the terminal
        os.chdir(root)
        env = environment(root, closed_port())
        os.execve(sys.executable, [sys.executable, "-m", "cli.main", "chat", str(files["model"]), "-n", "3",
                                   "--system", "Be terse."], env)
    seen: list[str] = []
    try:
        assert _read_until(fd, "> ", seen).startswith("[/help lists the commands; Ctrl-C stops an answer, Ctrl-D "
                                                      "ends]")
        os.write(fd, b"/help\n")
        shown = _read_until(fd, "\n> ", seen)
        assert "/reset" in shown and "/system TEXT" in shown and "/timings" in shown and "/exit" in shown
        os.write(fd, b"/summarize this\n")
        assert ("[unknown command '/summarize this': /help lists the commands; //TEXT sends /TEXT]"
                in _read_until(fd, "\n> ", seen))
        os.write(fd, b"/timings\n")
        assert "[timings on]" in _read_until(fd, "\n> ", seen)
        os.write(fd, b"hello there\n")
        answer = _read_until(fd, "\n> ", seen)
        # The answer is cut at 3 tokens (or ends earlier), then the speed line.
        assert re.search(r"(\[cut at the 3-token limit; raise it with --max-tokens\]\r\n)?\[prompt: \d+ tokens in "
                         r"\d+\.\d\d s \(.*\) \| generation: \d+ tokens? in", answer), answer
        os.write(fd, b"/reset\n")
        assert "[history cleared; the system message is kept (/system alone removes it)]" in _read_until(
            fd, "\n> ", seen)
        os.write(fd, b"\x04")  # Ctrl-D
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
    assert "Traceback" not in "".join(seen) and "Warning" not in "".join(seen)


def parse(*argv: str) -> argparse.Namespace:
    return cli.parser().parse_args(list(argv))


def test_chat_samples_by_the_model_defaults_and_generate_is_greedy(tmp_path: Path) -> None:
    chat = parse("chat", str(tmp_path))
    defaults = {**LLAMA_CPP_SAMPLING, **model_sampling_defaults(str(tmp_path))}
    llama = sampling_params(chat, defaults)  # no generation_config.json: llama-cli's sampling
    assert (llama.do_sample, llama.temperature, llama.top_k, llama.top_p, llama.min_p) == (True, 0.8, 40, 0.95, 0.05)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1, "eos_token_id": 2}))
    own = sampling_params(chat, {**LLAMA_CPP_SAMPLING, **model_sampling_defaults(str(tmp_path))})
    assert (own.temperature, own.top_p, own.top_k, own.repetition_penalty) == (0.6, 0.9, 40, 1.1)
    # What the user gives wins; --temp 0 is greedy.
    mine = sampling_params(parse("chat", "m", "--temp", "1.2", "--top-k", "0", "--min-p", "0"), defaults)
    assert (mine.do_sample, mine.temperature, mine.top_k, mine.min_p) == (True, 1.2, None, None)
    assert not sampling_params(parse("chat", "m", "--temp", "0"), defaults).do_sample
    assert not sampling_params(parse("generate", "m", "p", "--top-p", "0.5"), {}).do_sample
    vllm = parse("generate", "m", "p", "--temperature", "0.5", "--repetition-penalty", "1.3", "--max-model-len", "64",
                 "--n-predict", "7", "--presence-penalty", "0.5", "--frequency-penalty", "-0.5", "-s", "3")
    params = sampling_params(vllm, {})
    assert (params.temperature, params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (
        0.5, 1.3, 0.5, -0.5)
    assert (vllm.ctx_size, vllm.max_tokens, vllm.seed) == (64, 7, 3)


def test_help_pages_show_the_defaults(capsys) -> None:
    for command, shown in (("generate", "tokens to generate at most (default: 256)"),
                           ("chat", "--temp 0.8 --top-k 40 --top-p 0.95 --min-p 0.05"),
                           ("serve", "the port to listen on (default: 8000)")):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        assert shown in " ".join(capsys.readouterr().out.split())
