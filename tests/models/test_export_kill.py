"""The exporters write atomically, as ``save_pretrained`` does (``tests/models/test_save_kill.py``): killed by
SIGKILL after every durable step, ``save_transformers`` and ``save_sentence_transformers`` leave the old export or
the new one, complete, which an independent reader (``transformers``; safetensors and JSON) loads; and every file
and folder is flushed (``os.fsync``) before the commit.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer as Backend
from tokenizers import models as tok_models
from tokenizers import pre_tokenizers

import models
from models.checkpoints import atomic
from models.checkpoints.sentence_folder import save_sentence_transformers
from models.convert import save_transformers
from tests.models.test_save_kill import hidden, run_killed_at, steps_of, tiny
from tokenization import Tokenizer

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or not os.path.isdir("/proc/self/fd"),
                                reason="needs os.fork, flock and /proc/self/fd (Linux)")

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "zoo", "cat"]


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative name -> bytes), and every folder (name -> b"<dir>")."""
    return {str(p.relative_to(folder)): b"<dir>" if p.is_dir() else p.read_bytes() for p in folder.rglob("*")}


def fsynced(action: Callable[[], object], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths ``action`` flushed with ``os.fsync``, in order."""
    paths: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    try:
        action()
    finally:
        monkeypatch.undo()
    return paths


def staged(paths: list[str], target: Path) -> dict[str, str]:
    """The fsynced paths inside the staging folder of ``target``, by their name relative to it."""
    out = {}
    for path in paths:
        parts = Path(path).relative_to(target.parent).parts
        if parts and parts[0].startswith(f".{target.name}.") and parts[0].endswith(".saving"):
            out[str(Path(*parts[1:]))] = path
    return out


# ------------------------------------------------------------------------------------------ save_transformers
@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two gpt2-like models of different shapes, and their exports (bytes)."""
    old, new = tiny(1), tiny(2, d_ff=48)
    root = tmp_path_factory.mktemp("exports")
    save_transformers(old, root / "old")
    save_transformers(new, root / "new")
    return {"old": old, "new": new, "old_tree": tree(root / "old"), "new_tree": tree(root / "new"),
            "old_hf": hf_weight(root / "old"), "new_hf": hf_weight(root / "new")}


def hf_weight(folder: Path) -> tuple[int, torch.Tensor]:
    """``transformers``' own reading of the folder: the FFN width and the first layer's FFN weight."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    return hf.config.n_inner, hf.transformer.h[0].mlp.c_fc.weight.detach()


def test_save_transformers_killed_after_every_step(exports: dict, tmp_path: Path) -> None:
    old, new = exports["old"], exports["new"]
    probe = tmp_path / "probe" / "export"
    save_transformers(old, probe)
    labels = steps_of(lambda: save_transformers(new, probe))
    commit = labels.index("commit")
    assert labels[:commit] == ["fsync config.json", "fsync model.safetensors", "fsync staging folder"]
    assert labels[-1] == "remove commit folder"
    assert exports["old_hf"][0] != exports["new_hf"][0]

    for k in range(len(labels)):
        folder = tmp_path / f"k{k}" / "export"
        save_transformers(old, folder)
        (folder / "notes.txt").write_text("kept")  # not part of the export
        run_killed_at(k, lambda: save_transformers(new, folder))  # noqa: B023 - run at once
        if k < commit:  # before the commit point the folder itself is untouched, for any reader
            assert {n: b for n, b in tree(folder).items() if n != "notes.txt"} == exports["old_tree"]
        # what the next save or load of the zoo does first: a dead writer's committed save is finished
        atomic.recover(folder)
        state = "old" if k < commit else "new"
        assert {n: b for n, b in tree(folder).items() if n != "notes.txt"} == exports[f"{state}_tree"], labels[k]
        width, weight = hf_weight(folder)
        assert width == exports[f"{state}_hf"][0], f"step {k} ({labels[k]})"
        assert torch.equal(weight, exports[f"{state}_hf"][1]), f"step {k} ({labels[k]})"
        assert (folder / "notes.txt").read_text() == "kept"
        assert hidden(folder.parent) == []


def test_save_transformers_first_save_is_one_rename(exports: dict, tmp_path: Path) -> None:
    new = exports["new"]
    labels = steps_of(lambda: save_transformers(new, tmp_path / "probe" / "export"))
    assert labels[-2:] == ["rename staging folder to target", "fsync parent folder"]
    published = labels.index("rename staging folder to target")
    for k in range(len(labels)):
        folder = tmp_path / f"k{k}" / "export"
        run_killed_at(k, lambda: save_transformers(new, folder))  # noqa: B023 - run at once
        if k < published:
            assert not folder.exists()
        else:
            assert tree(folder) == exports["new_tree"]
        atomic.recover(folder)
        assert hidden(folder.parent) == []


def test_save_transformers_flushes_every_file_and_folder(
    exports: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = (tmp_path / "export").resolve()
    for _ in ("first save", "save over it"):
        paths = fsynced(lambda: save_transformers(exports["new"], target), monkeypatch)
        assert set(staged(paths, target)) >= {"config.json", "model.safetensors", "."}, paths
        assert str(target.parent) in paths
    assert str(target) in paths  # the files switched into an existing folder, then the folder flushed


def test_save_transformers_writes_the_tokenizer_in_the_same_save(exports: dict, tmp_path: Path) -> None:
    """``zoo convert --to transformers`` passes the tokenizer: its files are staged and flushed with the weights,
    before the one commit, and ``transformers`` reads them."""
    folder = tmp_path / "export"
    save_transformers(exports["old"], folder)
    tokenizer = sentence_model(0, normalize=False).tokenizer
    labels = steps_of(lambda: save_transformers(exports["new"], folder, tokenizer=tokenizer))
    assert labels[:labels.index("commit")] == [
        f"fsync {name}" for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    ] + ["fsync staging folder"]
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    assert hf.convert_tokens_to_ids("cat") == WORDS.index("cat")


def test_save_transformers_refuses_a_file_before_writing(exports: dict, tmp_path: Path) -> None:
    (tmp_path / "export").write_text("not a folder")
    with pytest.raises(NotADirectoryError, match="export"):
        save_transformers(exports["new"], tmp_path / "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


# ------------------------------------------------------------------------------------- sentence-transformers
def sentence_model(seed: int, normalize: bool) -> models.EncoderLM:
    backend = Backend(tok_models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    torch.manual_seed(seed)
    model = models.EncoderLM.from_preset("tiny", vocab_size=len(WORDS), max_len=32, head="embedding",
                                         options={"head": {"pooling": "mean", "normalize": normalize}})
    model.tokenizer = Tokenizer(backend)
    return model


def read_sentence(folder: Path) -> dict:
    """An independent reading of a sentence-transformers folder: its modules, pooling and weights."""
    modules = json.loads((folder / "modules.json").read_text())
    for module in modules:
        assert (folder / module["path"]).is_dir()
    return {"modules": [m["type"].rsplit(".", 1)[-1] for m in modules],
            "pooling": json.loads((folder / "1_Pooling" / "config.json").read_text()),
            "weights": load_file(folder / "model.safetensors")}


@pytest.fixture(scope="module")
def sentence_exports(tmp_path_factory: pytest.TempPathFactory) -> dict:
    old, new = sentence_model(1, normalize=False), sentence_model(2, normalize=True)
    root = tmp_path_factory.mktemp("sentence")
    save_sentence_transformers(old, root / "old")
    save_sentence_transformers(new, root / "new")
    return {"old": old, "new": new, "old_tree": tree(root / "old"), "new_tree": tree(root / "new")}


def test_save_sentence_transformers_killed_after_every_step(sentence_exports: dict, tmp_path: Path) -> None:
    old, new = sentence_exports["old"], sentence_exports["new"]
    probe = tmp_path / "probe" / "st"
    save_sentence_transformers(old, probe)
    labels = steps_of(lambda: save_sentence_transformers(new, probe))
    assert labels == ["fsync staging folder", "rename target aside", "rename staging folder to target",
                      "fsync parent folder", "remove replaced folder"]
    replaced = labels.index("rename staging folder to target")
    for k in range(len(labels)):
        folder = tmp_path / f"k{k}" / "st"
        save_sentence_transformers(old, folder)
        (folder / "notes.txt").write_text("kept")
        run_killed_at(k, lambda: save_sentence_transformers(new, folder))  # noqa: B023 - run at once
        state = "old" if k < replaced else "new"
        if labels[k] == "rename target aside":  # between the two renames: no folder (never a partial one)
            assert not folder.exists()
        else:
            assert {n: b for n, b in tree(folder).items() if n != "notes.txt"} == sentence_exports[f"{state}_tree"]
        atomic.recover(folder)  # what the next save does first: the old folder is put back
        assert {n: b for n, b in tree(folder).items() if n != "notes.txt"} == sentence_exports[f"{state}_tree"]
        read = read_sentence(folder)
        assert read["modules"] == (["Transformer", "Pooling"] + (["Normalize"] if state == "new" else []))
        assert read["weights"].keys() == read_sentence(probe)["weights"].keys()
        assert (folder / "notes.txt").read_text() == "kept", f"step {k} ({labels[k]})"
        assert hidden(folder.parent) == []


def test_save_sentence_transformers_flushes_every_file_and_folder(
    sentence_exports: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = (tmp_path / "st").resolve()
    for _ in ("first save", "save over it"):
        paths = fsynced(lambda: save_sentence_transformers(sentence_exports["new"], target), monkeypatch)
        written = {n for n in sentence_exports["new_tree"]} | {"."}
        assert set(staged(paths, target)) >= written, sorted(written - set(staged(paths, target)))
        assert str(target.parent) in paths
    assert tree(target) == sentence_exports["new_tree"]


def test_save_sentence_transformers_refuses_before_writing(sentence_exports: dict, tmp_path: Path) -> None:
    (tmp_path / "st").write_text("not a folder")
    with pytest.raises(NotADirectoryError, match="st"):
        save_sentence_transformers(sentence_exports["new"], tmp_path / "st")
    model = sentence_model(3, normalize=False)
    model.tokenizer = None
    with pytest.raises(ValueError, match="needs the tokenizer"):
        save_sentence_transformers(model, tmp_path / "other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["st"]


# ------------------------------------------------------------------------------------------------------ GGUF
def run_killed_after_call(k: int, action: Callable[[], object]) -> None:
    """Run ``action`` in a forked child SIGKILLed right after its k-th (0-based) ``os.fsync`` or ``os.replace``:
    the durable steps of a single-file save, which has no ``atomic.step_hook`` labels."""
    pid = os.fork()
    if pid == 0:
        try:
            count = iter(range(k + 1))
            real_fsync, real_replace = os.fsync, os.replace

            def after(call: Callable) -> Callable:
                def step(*args: object, **kwargs: object) -> None:
                    call(*args, **kwargs)
                    if next(count) == k:
                        os.kill(os.getpid(), signal.SIGKILL)
                return step

            os.fsync, os.replace = after(real_fsync), after(real_replace)
            action()
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"child was not killed at step {k}"


def test_save_gguf_flushes_then_replaces_and_survives_a_kill_after_every_step(
    exports: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gguf import GGUFReader  # noqa: PLC0415 (an optional dependency, as in models.gguf)

    old, new = exports["old"], exports["new"]
    target = (tmp_path / "model.gguf").resolve()
    old.save_gguf(target)
    old_bytes = target.read_bytes()
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", os.fspath(b))), real_replace(a, b))[1])
    new.save_gguf(target)
    monkeypatch.undo()
    new_bytes = target.read_bytes()
    staging = events[0][1]
    assert Path(staging).name.startswith(".model.gguf.") and staging.endswith(".saving")
    assert events == [("fsync", staging), ("replace", str(target)), ("fsync", str(tmp_path.resolve()))]

    for k in range(len(events)):
        path = tmp_path / f"k{k}" / "model.gguf"
        old.save_gguf(path)
        run_killed_after_call(k, lambda: new.save_gguf(path))  # noqa: B023 - run at once
        state = old_bytes if k < 1 else new_bytes  # the replace (step 1) is the commit
        assert path.read_bytes() == state, f"step {k} ({events[k][0]})"
        reader = GGUFReader(path)
        width = reader.fields["gpt2.feed_forward_length"]
        assert int(width.parts[width.data[0]][0]) == (old if k < 1 else new).config.d_ff


# ------------------------------------------------------------ one small file (zoo eval --output, zoo finetune)
def test_write_file_flushes_and_survives_a_kill_after_every_step(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    target = (tmp_path / "probe" / "results.json").resolve()
    atomic.write_file(target, '{"old": 1}\n')
    paths = fsynced(lambda: atomic.write_file(target, '{"new": 2}\n'), monkeypatch)
    assert len(paths) == 2 and Path(paths[0]).name.startswith(".results.json.") and paths[1] == str(target.parent)
    labels = steps_of(lambda: atomic.write_file(target, '{"new": 2}\n'))
    assert labels == ["fsync results.json", "replace results.json", "fsync parent folder"]
    for k in range(len(labels)):
        path = tmp_path / f"k{k}" / "results.json"
        atomic.write_file(path, '{"old": 1}\n')
        run_killed_at(k, lambda: atomic.write_file(path, '{"new": 2}\n'))  # noqa: B023 - run at once
        assert json.loads(path.read_text()) == ({"old": 1} if k < 1 else {"new": 2}), labels[k]
        atomic.write_file(path, "{}")  # the next save removes what a killed one left
        assert sorted(p.name for p in path.parent.iterdir()) == ["results.json"]
    with pytest.raises(IsADirectoryError, match="probe"):
        atomic.write_file(tmp_path / "probe", "x")
