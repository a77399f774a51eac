"""Checkpoint folders built the way an attacker builds them: a valid folder written by ``save_pretrained`` (or the
safetensors writer), then one field corrupted. Each load must fail with the documented exception naming the field,
before reading anything outside the folder; each failed save must leave the old checkpoint as it was.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import struct
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from models import DecoderLM
from models.checkpoints import atomic, files
from models.checkpoints.files import MAX_JSON_DEPTH, json_depth


def tiny(seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM.from_preset("tiny", vocab_size=50, d_model=16, n_layers=1, n_heads=2).eval()


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def shard(folder: Path, weight_map_value: str) -> list[str]:
    """Turn a saved folder into a one-shard checkpoint whose index names ``weight_map_value`` for every tensor."""
    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    save_file(state, str(folder / "model-00001-of-00001.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(state, weight_map_value)}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return sorted(state)


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every safetensors file the loader opens."""
    seen: list[Path] = []
    real = files.load_file

    def load(path, *args, **kwargs):
        seen.append(Path(path).resolve())
        return real(path, *args, **kwargs)

    monkeypatch.setattr(files, "load_file", load)
    return seen


# ------------------------------------------------------------------------------------------ shard index names
@pytest.mark.parametrize("entry", [
    "../outside/model.safetensors",  # a valid checkpoint of someone else, beside the folder
    "sub/../../outside/model.safetensors",
    "linked/model.safetensors",  # through a sub-folder that links out
    "ABSOLUTE",
])
def test_shard_index_entry_leading_out_of_the_folder_is_refused_before_reading(
    entry: str, tmp_path: Path, opened: list[Path]
) -> None:
    outside = tmp_path / "outside"
    tiny(1).save_pretrained(outside)
    ckpt = tmp_path / "ckpt"
    tiny().save_pretrained(ckpt)
    (ckpt / "linked").symlink_to(outside, target_is_directory=True)
    entry = str(outside / "model.safetensors") if entry == "ABSOLUTE" else entry
    shard(ckpt, entry)
    with pytest.raises(ValueError, match=r"weight_map of .*model\.safetensors\.index\.json") as err:
        DecoderLM.from_pretrained(ckpt)
    assert repr(entry) in str(err.value)
    assert opened == []  # refused before any shard was read


def test_shards_that_are_links_held_by_the_folder_load(tmp_path: Path) -> None:
    """A Hugging Face cache snapshot links every file into ``../../blobs``: such a folder still loads."""
    model = tiny()
    ckpt = tmp_path / "snapshots" / "abc"
    model.save_pretrained(ckpt)
    shard(ckpt, "model-00001-of-00001.safetensors")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (ckpt / "model-00001-of-00001.safetensors").rename(blobs / "0123")
    (ckpt / "model-00001-of-00001.safetensors").symlink_to("../../blobs/0123")
    loaded = DecoderLM.from_pretrained(ckpt)
    assert all(torch.equal(t, loaded.state_dict()[name]) for name, t in model.state_dict().items())


# ------------------------------------------------------------------------------------------ JSON nesting
def nest(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("which", ["config.json", "model.safetensors.index.json"])
def test_deeply_nested_json_is_refused_naming_the_file(which: str, tmp_path: Path) -> None:
    tiny().save_pretrained(tmp_path)
    if which == "config.json":
        text = (tmp_path / which).read_text()
        (tmp_path / which).write_text(text.replace('"config": {', f'"junk": {nest(100_000)}, "config": {{', 1))
    else:
        shard(tmp_path, "model-00001-of-00001.safetensors")
        index = json.loads((tmp_path / which).read_text())
        (tmp_path / which).write_text(json.dumps(index)[:-1] + f', "junk": {nest(100_000)}}}')
    expected = rf"{which} nests JSON .* 100001 levels deep; expected at most {MAX_JSON_DEPTH}"
    with pytest.raises(ValueError, match=expected):
        DecoderLM.from_pretrained(tmp_path)


def test_json_depth_counts_brackets_outside_strings_only() -> None:
    assert json_depth('{"a": [1, {"b": []}]}') == 4
    assert json_depth(r'{"a": "[[[[\" {{{{ \\", "b": [["]"]]}') == 3
    assert json_depth("[" * 65) == 65  # unclosed: still measured, without recursing
    assert json_depth(nest(MAX_JSON_DEPTH)) == MAX_JSON_DEPTH


def test_json_at_the_stated_depth_still_parses(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"a": ' + nest(MAX_JSON_DEPTH - 1) + "}")
    assert files.read_json(path)["a"] is not None
    path.write_text('{"a": ' + nest(MAX_JSON_DEPTH) + "}")
    with pytest.raises(ValueError, match=f"{MAX_JSON_DEPTH + 1} levels deep"):
        files.read_json(path)


# ------------------------------------------------------------------------------------------ corrupt weights
def corrupt_header(path: Path, change) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    header = change(header, body) or header
    if isinstance(header, bytes):
        path.write_bytes(header)
        return
    data = json.dumps(header).encode()
    data += b" " * (-len(data) % 8)
    path.write_bytes(struct.pack("<Q", len(data)) + data + body)


def first_tensor(header: dict) -> dict:
    return header[next(k for k in header if k != "__metadata__")]


CORRUPTIONS = {
    "dtype": lambda h, b: first_tensor(h).update(dtype="Q9"),
    "shape": lambda h, b: first_tensor(h).update(shape=[10**6, 10**6]),
    "data_offsets": lambda h, b: first_tensor(h).update(data_offsets=[0, 10**12]),
    "header length": lambda h, b: struct.pack("<Q", 2**60) + json.dumps(h).encode() + b,
    "truncated body": lambda h, b: (lambda d: struct.pack("<Q", len(d)) + d + b[:-7])(json.dumps(h).encode()),
    "nested header": lambda h, b: (lambda d: struct.pack("<Q", len(d)) + d + b)(nest(50_000).encode()),
}


@pytest.mark.parametrize("field", list(CORRUPTIONS))
def test_corrupt_safetensors_field_is_a_value_error_naming_the_file(field: str, tmp_path: Path) -> None:
    tiny().save_pretrained(tmp_path)
    corrupt_header(tmp_path / "model.safetensors", CORRUPTIONS[field])
    with pytest.raises(ValueError, match=r"model\.safetensors is not a valid safetensors file") as err:
        DecoderLM.from_pretrained(tmp_path)
    assert isinstance(err.value.__cause__, SafetensorError)


def test_weights_that_are_a_folder_are_an_os_error_naming_the_path(tmp_path: Path) -> None:
    tiny().save_pretrained(tmp_path)
    shard(tmp_path, "model-00001-of-00001.safetensors")
    (tmp_path / "model-00001-of-00001.safetensors").unlink()
    (tmp_path / "model-00001-of-00001.safetensors").mkdir()
    with pytest.raises(OSError, match=r"model-00001-of-00001\.safetensors"):
        DecoderLM.from_pretrained(tmp_path)


# ------------------------------------------------------------------------------------------ failing writes
def test_full_disk_while_writing_the_weights_is_an_os_error_and_keeps_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "ckpt"
    tiny(0).save_pretrained(ckpt)
    before = folder_bytes(ckpt)

    def full(*args, **kwargs):  # what safetensors raises when the disk is full
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(files, "save_file", full)
    with pytest.raises(OSError) as err:
        tiny(1).save_pretrained(ckpt)
    assert err.value.errno == errno.ENOSPC
    assert str(ckpt.resolve()) in str(err.value) and "model.safetensors" in str(err.value)
    assert "is unchanged" in str(err.value)
    assert folder_bytes(ckpt) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging folder left behind


def test_failing_flush_is_an_os_error_and_keeps_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "ckpt"
    tiny(0).save_pretrained(ckpt)
    before = folder_bytes(ckpt)
    real = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("config.json"):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError) as err:
        tiny(1).save_pretrained(ckpt)
    assert err.value.errno == errno.EIO and "config.json" in str(err.value) and "is unchanged" in str(err.value)
    monkeypatch.undo()
    assert folder_bytes(ckpt) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="uses fork and RLIMIT_FSIZE (POSIX)")
def test_a_real_write_failure_of_the_real_writer_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    """The real safetensors writer hits a file size limit (EFBIG, as a full disk gives ENOSPC) in a forked child:
    an OSError naming the folder, and the old checkpoint byte for byte."""
    ckpt = tmp_path / "ckpt"
    tiny(0).save_pretrained(ckpt)
    before = folder_bytes(ckpt)
    limit = max(len(data) for name, data in before.items() if name != "model.safetensors") + 1
    assert len(before["model.safetensors"]) > limit
    model = tiny(1)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: limit its file size, save, report what was raised
        code = 1
        try:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            try:
                model.save_pretrained(ckpt)
                report = "saved past the limit"
            except Exception as e:  # noqa: BLE001 - reported to the parent, which asserts on it
                report = f"{type(e).__name__} {getattr(e, 'errno', None)} {e}"
            os.write(write, report.encode()[:60_000])
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        report = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert report.startswith(f"OSError {errno.EFBIG} "), report
    assert str(ckpt.resolve()) in report and "is unchanged" in report
    assert folder_bytes(ckpt) == before
    atomic.recover(ckpt)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
