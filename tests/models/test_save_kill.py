"""``save_pretrained`` killed by SIGKILL after every durable step it performs (each fsync, rename, replace and
rmdir): the folder then loads as exactly the old or exactly the new checkpoint, byte for byte, and the next load
or save removes every hidden folder the killed save left.

The save is run in a forked child whose ``models.checkpoints.atomic.step_hook`` kills it after step k, for every k.
"""

from __future__ import annotations

import os
import select
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from models import DecoderLM
from models.checkpoints import atomic, folder_locks
from models.checkpoints.locate import locate

pytestmark = pytest.mark.skipif(
    not hasattr(os, "fork") or folder_locks.fcntl is None, reason="needs os.fork and flock (POSIX)"
)

CHECKPOINT_FILES = ("config.json", "model.safetensors")


def tiny(seed: int, **overrides) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM.from_preset("tiny", vocab_size=50, d_model=16, n_layers=1, n_heads=2, **overrides).eval()


def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "[PAD]": 1, "zoo": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def snapshot(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in CHECKPOINT_FILES}


def hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def steps_of(action: Callable[[], object]) -> list[str]:
    """The labels of the durable steps ``action`` performs (run in this process)."""
    labels: list[str] = []
    atomic.step_hook = labels.append
    try:
        action()
    finally:
        atomic.step_hook = None
    return labels


def run_killed_at(k: int, action: Callable[[], object]) -> None:
    """Run ``action`` in a forked child that SIGKILLs itself right after its k-th durable step (0-based)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            count = iter(range(k + 1))

            def hook(label: str) -> None:
                if next(count) == k:
                    os.kill(os.getpid(), signal.SIGKILL)

            atomic.step_hook = hook
            action()
        finally:
            os._exit(3)  # reached only if step k never came
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"child was not killed at step {k}"


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    """An old checkpoint (no tokenizer) and a new one of another shape (with a tokenizer), saved once each."""
    old, new, third = tiny(1), tiny(2, d_ff=48), tiny(3, d_ff=40)
    root = tmp_path_factory.mktemp("reference")
    old.save_pretrained(root / "old")
    new.save_pretrained(root / "new", tokenizer=tokenizer())
    return {"old": old, "new": new, "third": third,
            "old_bytes": snapshot(root / "old"), "new_bytes": snapshot(root / "new")}


@pytest.mark.parametrize("then", ["load", "save"])
def test_resave_killed_after_every_step(then: str, pair: dict, tmp_path: Path) -> None:
    old, new, third = pair["old"], pair["new"], pair["third"]
    folder = tmp_path / "probe" / "ckpt"
    old.save_pretrained(folder)
    labels = steps_of(lambda: new.save_pretrained(folder, tokenizer=tokenizer()))
    commit = labels.index("commit")
    files = ["README.md", "config.json", "model.safetensors", "tokenizer.json"]
    assert labels[:commit] == [f"fsync {name}" for name in files] + ["fsync staging folder"]
    assert [lb for lb in labels if lb.startswith("replace ")][-1] == "replace config.json"  # config last
    assert labels[-1] == "remove commit folder"

    for k in range(len(labels)):
        ckpt = tmp_path / f"k{k}" / "ckpt"
        old.save_pretrained(ckpt)
        (ckpt / "training_log.txt").write_text("kept")  # a file that is not part of the checkpoint
        run_killed_at(k, lambda: new.save_pretrained(ckpt, tokenizer=tokenizer()))  # noqa: B023 - run at once
        if k < len(labels) - 1:  # killed after its last step, a save has nothing left to leave
            assert hidden(ckpt.parent), f"step {k} ({labels[k]}): a killed save leaves its folder behind"
        if k < commit:  # before the commit point the folder itself is untouched
            assert snapshot(ckpt) == pair["old_bytes"]
            assert not (ckpt / "tokenizer.json").exists()

        if then == "load":
            loaded = DecoderLM.from_pretrained(ckpt)
            expected = old if k < commit else new
            assert loaded.config == expected.config, f"step {k} ({labels[k]})"
            assert snapshot(ckpt) == pair["old_bytes" if k < commit else "new_bytes"], f"step {k} ({labels[k]})"
            assert (loaded.tokenizer is None) == (k < commit)
            for name, tensor in expected.state_dict().items():
                assert torch.equal(loaded.state_dict()[name], tensor), f"step {k}: {name}"
        else:
            third.save_pretrained(ckpt)
            loaded = DecoderLM.from_pretrained(ckpt)
            assert loaded.config == third.config
            assert torch.equal(loaded.lm_head.weight, third.lm_head.weight)
        assert hidden(ckpt.parent) == [], f"step {k} ({labels[k]}): leftovers not cleaned by the next {then}"
        assert (ckpt / "training_log.txt").read_text() == "kept"


def test_first_save_killed_after_every_step(pair: dict, tmp_path: Path) -> None:
    new = pair["new"]
    labels = steps_of(lambda: new.save_pretrained(tmp_path / "probe" / "ckpt"))
    assert labels[-2:] == ["rename staging folder to target", "fsync parent folder"]
    published = labels.index("rename staging folder to target")
    for k in range(len(labels)):
        ckpt = tmp_path / f"k{k}" / "ckpt"
        run_killed_at(k, lambda: new.save_pretrained(ckpt))  # noqa: B023 - run at once
        if k < published:
            assert not ckpt.exists() and hidden(ckpt.parent)
            with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
                DecoderLM.from_pretrained(ckpt)
        else:
            assert snapshot(ckpt) == pair["new_bytes"]
            assert DecoderLM.from_pretrained(ckpt).config == new.config
        assert hidden(ckpt.parent) == []


def test_recovery_killed_after_every_step(pair: dict, tmp_path: Path) -> None:
    """The load that finishes a killed save can itself be killed at any step: the next load still finishes it."""
    old, new = pair["old"], pair["new"]

    probe = tmp_path / "probe" / "ckpt"
    old.save_pretrained(probe)
    first_replace = steps_of(lambda: new.save_pretrained(probe)).index("commit") + 2  # commit, fsync, replace

    def killed_mid_switch(folder: Path) -> None:
        old.save_pretrained(folder)
        run_killed_at(first_replace, lambda: new.save_pretrained(folder))

    reference = tmp_path / "reference" / "ckpt"
    killed_mid_switch(reference)
    recovery = steps_of(lambda: atomic.recover(reference))
    assert recovery[-1] == "remove commit folder" and len(recovery) >= 3
    for k in range(len(recovery)):
        ckpt = tmp_path / f"k{k}" / "ckpt"
        killed_mid_switch(ckpt)
        run_killed_at(k, lambda: DecoderLM.from_pretrained(ckpt))  # noqa: B023 - run at once
        loaded = DecoderLM.from_pretrained(ckpt)
        assert loaded.config == new.config
        assert torch.equal(loaded.lm_head.weight, new.lm_head.weight)
        assert hidden(ckpt.parent) == []


def test_a_live_save_in_another_process_is_never_disturbed(pair: dict, tmp_path: Path) -> None:
    """While another process saves, a load reads the old checkpoint before the commit, holds the commit back
    while it reads, and waits during the switch (in its recovery, or reading a folder it located before the
    commit); the other process's folders are never removed."""
    old, new = pair["old"], pair["new"]
    ckpt = tmp_path / "ckpt"
    old.save_pretrained(ckpt)
    paused_r, paused_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            def hook(label: str) -> None:
                if label in ("fsync staging folder", "replace model.safetensors"):
                    os.write(paused_w, b"p")
                    os.read(go_r, 1)

            atomic.step_hook = hook
            new.save_pretrained(ckpt, tokenizer=tokenizer())
            os._exit(0)
        finally:
            os._exit(3)
    try:
        # Paused before the commit: the old checkpoint, and the writer's staging folder is left alone.
        assert os.read(paused_r, 1) == b"p"
        assert DecoderLM.from_pretrained(ckpt).config == old.config
        assert any(name.endswith(".saving") for name in hidden(tmp_path))
        located = locate(ckpt)
        with atomic.reading(located.folder):
            # A reader inside the folder holds the writer back from committing until it is done.
            os.write(go_w, b"g")
            assert select.select([paused_r], [], [], 1.0)[0] == [], "the writer switched under a reader"
            assert snapshot(ckpt) == pair["old_bytes"]
        # Paused in the middle of the switch: both kinds of reader wait for the writer.
        assert os.read(paused_r, 1) == b"p"
        result: dict = {}

        def read_located() -> None:
            with atomic.reading(located.folder):
                result["located"] = snapshot(ckpt)

        readers = [
            threading.Thread(target=lambda: result.update(model=DecoderLM.from_pretrained(ckpt))),
            threading.Thread(target=read_located),
        ]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout=1.0)
            assert reader.is_alive(), "a reader did not wait for the save in progress"
        os.write(go_w, b"g")
        for reader in readers:
            reader.join(timeout=30)
        _, status = os.waitpid(pid, 0)
        pid = 0
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert result["model"].config == new.config
        assert result["located"] == pair["new_bytes"]
        assert hidden(tmp_path) == []
    finally:
        if pid:  # a failed assertion must not leave the writer waiting forever
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        for fd in (paused_r, paused_w, go_r, go_w):
            os.close(fd)


# ------------------------------------------------------------------------------------------ what is flushed
def _durability_log(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """Record, in order, every ``os.fsync`` (as the path of the descriptor flushed), ``os.rename`` and
    ``os.replace`` of this process, and let each go on."""
    log: list[tuple[str, ...]] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd: int) -> None:
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst, **kw) -> None:
        log.append(("rename", os.fspath(src), os.fspath(dst)))
        real_rename(src, dst, **kw)

    def replace(src, dst, **kw) -> None:
        log.append(("replace", os.fspath(src), os.fspath(dst)))
        real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    return log


def _assert_flushed_before_commit(log: list[tuple[str, ...]], target: Path) -> None:
    """Every file of the save and its staging folder were fsynced before the rename that commits it (the staging
    folder renamed to the target, or to its ``.commit`` name), the parent after it, and, when files were switched
    into an existing target, the target after the last of them."""
    commits = [i for i, event in enumerate(log) if event[0] == "rename" and event[1].endswith(".saving")]
    assert len(commits) == 1, log
    at = commits[0]
    staging = Path(log[at][1])
    flushed_before = {event[1] for event in log[:at] if event[0] == "fsync"}
    written = {str(staging / name) for name in os.listdir(target)} | {str(staging)}
    assert written <= flushed_before, f"not flushed before the commit: {sorted(written - flushed_before)}"
    assert ("fsync", str(target.parent)) in log[at + 1:], "the parent folder is not flushed after the commit"
    replaced = [i for i, event in enumerate(log) if event[0] == "replace"]
    if replaced:  # a save over an existing checkpoint: its files are switched in, then the target is flushed
        assert ("fsync", str(target)) in log[replaced[-1] + 1:], "the target is not flushed after the switch"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="maps descriptors to paths through /proc")
@pytest.mark.parametrize("kind", ["model", "adapter"])
def test_every_file_and_the_folder_are_flushed_before_the_commit(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny(0)
    if kind == "adapter":
        model.add_adapter(r=2, alpha=4, target_modules=["q_proj", "v_proj"])
    target = (tmp_path / kind).resolve()

    def save() -> None:
        if kind == "adapter":
            model.save_adapter(target, base_model="tiny-base")
        else:
            model.save_pretrained(target, tokenizer=tokenizer())

    for _ in ("first save: one rename", "save over it: commit, then switch"):
        log = _durability_log(monkeypatch)
        save()
        monkeypatch.undo()
        _assert_flushed_before_commit(log, target)
    assert len(os.listdir(target)) >= 3  # the files checked: config, weights and the card at least
