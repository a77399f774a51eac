"""The hidden setup of the docs' Python blocks (``tests/test_docs.py``): what a block names but does not create,
provided offline before it runs, so that the blocks read as a user writes them.

A block runs in a fresh temporary working directory. ``prepared(block source, folder, monkeypatch, assets)`` gives it,
for each thing its source names:

- ``LOCAL_FILES``: a file or folder it reads by name (a tiny GGUF file, a checkpoint folder), written into the
  working directory;
- ``HUB_REPOS``: a Hub repository it downloads from, uploaded to an in-process Hub (``tests/hub/hub_server.py``) that
  ``huggingface_hub`` is pointed at for the block (a block that only pushes gets the Hub too: ``PUSHES``);
- a server when it talks to ``LOCAL_SERVER``: ``serving.openai_api.create_app`` of a tiny chat model on a free port
  of 127.0.0.1, under the model name its requests use (``ADAPTERS`` are served as LoRA adapters of that model) and
  with the API key its client sends; ``LOCAL_SERVER`` in the source is replaced by the server's address.

The stand-ins are tiny models with random weights (``tests.tiny_checkpoint``): the blocks show how things are called
and that they run, not what a trained model answers.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shutil
import socket
import threading
import time
import tokenize
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

#: The address the docs' client blocks use for ``zoo serve``'s default port.
LOCAL_SERVER = "http://127.0.0.1:8000"
#: Model names the docs' requests use for LoRA adapters (docs/multi-lora.md: ``--lora sql=./sql-lora``).
ADAPTERS = ("sql",)
#: Hub repositories the docs push to: a block naming one of these gets the in-process Hub.
PUSHES = ("me/my-model", "me/my-adapter")


class Assets:
    """Stand-ins built once per test session (in ``root``) and copied or uploaded where a block needs them.

    Args:
        root: a folder that lives for the session.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def _once(self, name: str, write: Callable[[Path], Any]) -> Path:
        path = self.root / name
        if not path.exists():
            torch.manual_seed(0)
            staging = self.root / f".{name}.tmp"
            staging.mkdir()
            write(staging)
            staging.rename(path)
        return path

    def chat_checkpoint(self) -> Path:
        """A tiny ``transformers`` Llama folder with a chat template (the stand-in for SmolLM2-135M-Instruct).

        Returns:
            The folder.
        """
        from tests.tiny_checkpoint import write_tiny_llama

        return self._once("chat-llama", write_tiny_llama)

    def zoo_checkpoint(self) -> Path:
        """A tiny float ``llama-tiny`` zoo checkpoint folder (d_model 64: int4 groups of 64 fit).

        Returns:
            The folder.
        """
        def write(folder: Path) -> None:
            from models import DecoderLM

            DecoderLM.from_preset("llama-tiny").save_pretrained(folder)

        return self._once("zoo-llama", write)

    def gguf_file(self, dtype: str) -> Path:
        """A tiny ``llama-tiny`` GGUF file with its tokenizer, weights in ``dtype``.

        Args:
            dtype: a ``save_gguf`` type (``"Q4_0"``).

        Returns:
            The file.
        """
        def write(folder: Path) -> None:
            from models import DecoderLM
            from tokenization import train_byte_level_bpe

            tok = train_byte_level_bpe(["the cat sat on the mat", "a bird sang in the tree"] * 10, vocab_size=280)
            model = DecoderLM.from_preset("llama-tiny", vocab_size=len(tok)).eval()
            model.save_gguf(folder / "model.gguf", dtype=dtype, tokenizer=tok)

        return self._once(f"gguf-{dtype}", write) / "model.gguf"

    def peft_adapter(self) -> Path:
        """A LoRA adapter folder (peft's layout) for ``DecoderLM.from_preset("tiny")``.

        Returns:
            The folder.
        """
        def write(folder: Path) -> None:
            from models import DecoderLM

            model = DecoderLM.from_preset("tiny")
            model.add_adapter("lora", r=4, alpha=8, target_modules=["q_proj", "v_proj"])
            model.save_adapter(folder)

        return self._once("peft-adapter", write)

    def chat_adapter(self) -> Path:
        """A LoRA adapter of the chat stand-in, its B matrices non-zero (so it changes the answers).

        Returns:
            The folder.
        """
        def write(folder: Path) -> None:
            import models

            model = models.from_pretrained(self.chat_checkpoint())
            model.add_adapter("lora", r=4, alpha=8, target_modules=["q_proj", "v_proj"])
            with torch.no_grad():
                for p in model.parameters():
                    if p.requires_grad:
                        p.normal_(0.0, 0.5)
            model.save_adapter(folder)

        return self._once("chat-adapter", write)


#: name a block's source uses -> writes the file or folder at the path it is given.
LOCAL_FILES: dict[str, Callable[[Assets, Path], None]] = {
    "SmolLM2-135M-Instruct.Q4_0.gguf": lambda assets, path: shutil.copy(assets.gguf_file("Q4_0"), path),
    "SmolLM2-135M-Instruct": lambda assets, path: shutil.copytree(assets.zoo_checkpoint(), path),
}
#: Hub repo id a block's source uses -> the folder uploaded as that repo.
HUB_REPOS: dict[str, Callable[[Assets, Path], None]] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": lambda assets, path: shutil.copytree(assets.chat_checkpoint(), path),
    # A Q4_0 file under the name the docs show: the loader reads each tensor's type from the file.
    "org/repo": lambda assets, path: (path.mkdir(parents=True),
                                      shutil.copy(assets.gguf_file("Q4_0"), path / "model.Q4_K_M.gguf")),
    "someone/their-peft-adapter": lambda assets, path: shutil.copytree(assets.peft_adapter(), path),
}


def names(source: str) -> set[str]:
    """The string literals of ``source`` (what a block names: files, repo ids, model names; comments left out).

    Args:
        source: Python source.

    Returns:
        The literals' values.
    """
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    found = set()
    for token in tokens:
        if token.type == tokenize.STRING:
            with contextlib.suppress(ValueError, SyntaxError):
                value = ast.literal_eval(token.string)
                if isinstance(value, str):
                    found.add(value)
    return found


@contextlib.contextmanager
def prepared(source: str, folder: Path, monkeypatch: Any, assets: Assets) -> Iterator[str]:
    """Provide what ``source`` names (see the module docstring) while the block runs.

    Args:
        source: the block's source.
        folder: its working directory.
        monkeypatch: the test's ``pytest.MonkeyPatch`` (the Hub settings are undone with it).
        assets: the session's stand-ins.

    Yields:
        The source to run: ``LOCAL_SERVER`` replaced by the address of the server started for it.
    """
    named = names(source)
    for name, write in LOCAL_FILES.items():
        if name in named:
            write(assets, folder / name)
    with contextlib.ExitStack() as stack:
        repos = [repo for repo in HUB_REPOS if repo in named]
        if repos or named & set(PUSHES):
            stack.enter_context(local_hub(folder / ".hub", monkeypatch, {r: HUB_REPOS[r] for r in repos}, assets))
        if LOCAL_SERVER in source:
            url = stack.enter_context(local_server(source, assets))
            source = source.replace(LOCAL_SERVER, url)
        yield source


@contextlib.contextmanager
def local_hub(home: Path, monkeypatch: Any, repos: dict[str, Callable[[Assets, Path], None]],
              assets: Assets) -> Iterator[None]:
    """An in-process Hub holding ``repos``, with ``huggingface_hub`` pointed at it.

    Args:
        home: the temporary ``HF_HOME``.
        monkeypatch: undoes the settings after the test.
        repos: repo id -> writes the repo's files into the folder it is given.
        assets: the stand-ins.

    Yields:
        Nothing: the Hub serves while the block runs.
    """
    import huggingface_hub

    from tests.hub.hub_server import HubServer, point_huggingface_hub_at

    server = HubServer(token="hf_transformerzoo_dummy_token_0123456789").start()
    try:
        point_huggingface_hub_at(server, home, monkeypatch)
        api = huggingface_hub.HfApi(endpoint=server.url)
        for repo_id, write in repos.items():
            files = home.parent / ".hub-upload" / repo_id
            write(assets, files)
            api.create_repo(repo_id)
            api.upload_folder(repo_id=repo_id, folder_path=files)
        yield
    finally:
        huggingface_hub.close_session()
        server.stop()


@contextlib.contextmanager
def local_server(source: str, assets: Assets) -> Iterator[str]:
    """The OpenAI-compatible server a client block talks to, on a free port of 127.0.0.1.

    The first ``model="..."`` of ``source`` that is not in ``ADAPTERS`` names the served model (default ``"model"``);
    the adapters it names are served as LoRA adapters; ``api_key="..."`` is the key required.

    Args:
        source: the block's source.
        assets: the stand-ins.

    Yields:
        The server's address, ``http://127.0.0.1:<port>``.
    """
    import uvicorn

    import models
    from serving.openai_api import create_app

    requested = re.findall(r"""model=(["'])([^"']+)\1""", source)
    adapters = {name: str(assets.chat_adapter()) for _, name in requested if name in ADAPTERS}
    served = next((name for _, name in requested if name not in ADAPTERS), "model")
    key = re.search(r"""api_key=(["'])([^"']+)\1""", source)
    model = models.from_pretrained(assets.chat_checkpoint()).eval()
    app = create_app(model, model.tokenizer, model_name=served, api_key=key[2] if key else None, max_num_seqs=4,
                     loras=adapters, max_loras=len(adapters))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the docs' server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
