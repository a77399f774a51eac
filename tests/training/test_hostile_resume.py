"""Hostile trainer checkpoints, built the way an attacker builds them: a real checkpoint written by the Trainer,
then one field corrupted through the format's own writer (``torch.save`` for the trainer state, DCP's own
metadata classes and writer for ``sharded/``) and the manifest rewritten to vouch for it. Each load must raise
``ValueError`` or ``OSError`` naming the field, read nothing outside the folder, and change nothing: weights,
optimiser, scheduler, step, epoch, history and random state are compared with a snapshot."""

from __future__ import annotations

import copy
import errno
import functools
import json
import math
import os
import pickle
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch

from models import DecoderLM
from training import CausalLMCollator, NoamLR, Trainer, TrainerConfig, WarmupCosineLR
from training import checkpoint as ckpt

TINY = dict(vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_layers=1, max_len=32, dropout=0.0)
OPENED: list[str] | None = None  # while a load runs: every path it opens (Python's "open" audit event)
FAILING: dict | None = None  # {"path", "after", "seen"}: opens of "path" past the first "after" raise EIO


def _record_opens(event: str, args: tuple) -> None:
    if event != "open" or not isinstance(args[0], (str, os.PathLike)):
        return
    path = os.path.realpath(args[0])
    if OPENED is not None:
        OPENED.append(path)
    if FAILING is not None and path == FAILING["path"]:
        FAILING["seen"] += 1
        if FAILING["seen"] > FAILING["after"]:  # raised by every open (builtins, io, pathlib, os.open)
            raise OSError(errno.EIO, "Input/output error", path)


sys.addaudithook(_record_opens)


def _rows(n: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[2] + torch.randint(5, 40, (int(k),), generator=g).tolist() + [3]
            for k in torch.randint(3, 14, (n,), generator=g)]


def _trainer(root: Path, init: int = 0, scheduler=None, **overrides) -> Trainer:
    torch.manual_seed(init)
    model = DecoderLM.from_preset("tiny", **TINY)
    config = TrainerConfig(**{"max_steps": 6, "batch_size": 4, "progress": False, "checkpoint_dir": str(root),
                              **overrides})
    return Trainer(model, functools.partial(torch.optim.AdamW, lr=1e-2), config, _rows(),
                   CausalLMCollator(pad_token_id=0),
                   scheduler=scheduler or (lambda opt: WarmupCosineLR(opt, warmup=2, total=6)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A checkpoint after 2 steps (copied per test before it is corrupted)."""
    trainer = _trainer(tmp_path_factory.mktemp("saved"))
    trainer.train(until=2)
    return trainer.save_checkpoint()


@pytest.fixture
def folder(saved: Path, tmp_path: Path) -> Path:
    copy_ = tmp_path / "run" / saved.name
    shutil.copytree(saved, copy_)
    return copy_


def _step(trainer: Trainer) -> None:
    """An optimiser and scheduler step with made-up gradients (no forward pass: fast), recorded as the Trainer
    records one, so the trainer has state of its own to lose."""
    for p in trainer.model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    trainer.optimizer.step()
    trainer.scheduler.step()
    trainer.step, trainer.batch_in_epoch = 1, 1
    trainer.history.append({"step": 1, "loss": 3.0, "lr": 1e-2, "tokens": 40.0})
    random.random()


def _snapshot(trainer: Trainer) -> list:
    return copy.deepcopy([[p.detach() for p in trainer.model.parameters()], trainer.optimizer.state_dict(),
                          trainer.scheduler.state_dict(), trainer.step, trainer.epoch, trainer.batch_in_epoch,
                          trainer.history, trainer.eval_history, torch.get_rng_state(), random.getstate()])


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


def _refused(folder: Path, error: type[Exception], match: str, **overrides) -> list[str]:
    """Load ``folder`` into a trainer that has taken a step of its own; assert the refusal changed nothing and
    return the paths the load opened."""
    global OPENED
    trainer = _trainer(folder.parent.parent / "other", init=1, **overrides)
    _step(trainer)
    before = _snapshot(trainer)
    OPENED = []
    try:
        with pytest.raises(error, match=match):
            trainer.load_checkpoint(folder)
        opened = OPENED
    finally:
        OPENED = None
    assert _same(before, _snapshot(trainer)), "a refused checkpoint changed the trainer"
    return opened


def _rewrite_state(folder: Path, edit) -> None:
    state = torch.load(folder / ckpt.STATE_NAME, weights_only=True)
    edit(state)
    ckpt.save_torch(state, folder / ckpt.STATE_NAME)
    ckpt.write_manifest(folder)


def _set(*keys, value):
    def edit(state):
        target = state
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return edit


@pytest.mark.parametrize(("edit", "message"), [
    (_set("step", value=-5), r"step must be an integer >= 0, got -5"),
    (_set("step", value="abc"), r"step must be an integer >= 0, got 'abc'"),
    (_set("epoch", value=1.5), r"epoch must be an integer >= 0, got 1.5"),
    (_set("batch_in_epoch", value=10**6), r"batch_in_epoch must be <= 6 \(batches per epoch\)"),
    (_set("run", "shuffle", value="yes"), r"run.shuffle must be True or False, got 'yes'"),
    (_set("run", "dataset_size", value=True), r"run.dataset_size must be an integer >= 1"),
    (_set("optimizer", "param_groups", 0, "lr", value=float("nan")),
     r"optimizer.param_groups\[0\].lr must be a finite number .*got nan"),
    (_set("optimizer", "param_groups", 0, "lr", value=-1.0), r"optimizer.param_groups\[0\].lr must be >= 0"),
    (_set("optimizer", "param_groups", 0, "betas", value="x"), r"optimizer.param_groups\[0\].betas must be a list"),
    (_set("optimizer", "extra", value={"lm_head.weight": {"k": [1]}}), r"optimizer.extra\['lm_head.weight'\].k"),
    (_set("scheduler", value={"junk": 1}), r"scheduler must be a dict of the keys"),
    (_set("scheduler", "last_epoch", value="1"), r"scheduler.last_epoch must be a finite number"),
    (_set("scheduler", "_last_lr", value=[float("nan")]), r"scheduler._last_lr\[0\] must be a finite number"),
    (_set("history", value=5), r"history must be a list of 2 records"),
    (_set("history", 1, "loss", value="low"), r"history\[1\].loss is not a number"),
    (_set("eval_history", value=[{"step": 9, "loss": 1.0, "perplexity": 2.7}]), r"eval_history\[0\].step"),
    (_set("trainable", value={"w": "big"}), r"trainable must map parameter names to shapes"),
    (_set("extra_field", value=1), r"the trainer state must hold exactly .*unknown \['extra_field'\]"),
])
def test_a_bad_field_of_the_trainer_state_is_named_and_changes_nothing(folder, edit, message) -> None:
    _rewrite_state(folder, edit)
    _refused(folder, ValueError, rf"trainer_state.pt: {message}")


def test_a_bad_random_state_is_named_and_changes_nothing(folder) -> None:
    ckpt.save_torch({"torch": torch.zeros(3, dtype=torch.uint8), "python": random.getstate()},
                    folder / "rng-rank0.pt")
    ckpt.write_manifest(folder)
    _refused(folder, ValueError, r"rng-rank0.pt: torch must be of type Tensor")


def test_a_storage_path_out_of_the_folder_is_refused_before_it_is_read(folder, tmp_path) -> None:
    victim = _trainer(tmp_path / "victim", init=2)  # another run's checkpoint, of the same shapes
    other = victim.save_checkpoint() / "sharded" / "__0_0.distcp"
    metadata = ckpt.read_metadata(folder / "sharded")
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index].relative_path = os.path.relpath(other, folder / "sharded")
    with open(folder / "sharded" / ".metadata", "wb") as f:
        pickle.dump(metadata, f)  # DCP's own classes, written as DCP writes them
    ckpt.write_manifest(folder)
    opened = _refused(folder, ValueError, rf"relative_path of the storage entry for '{index.fqn}'.* leads outside")
    assert not [p for p in opened if p.startswith(str(tmp_path / "victim"))]


def test_a_storage_range_beyond_its_file_is_refused(folder) -> None:
    metadata = ckpt.read_metadata(folder / "sharded")
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index].length = 10**12
    with open(folder / "sharded" / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    ckpt.write_manifest(folder)
    _refused(folder, ValueError, rf"offset and length of the storage entry for '{index.fqn}'")


def test_a_manifest_name_out_of_the_folder_is_refused_before_it_is_read(folder, tmp_path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    manifest = json.loads((folder / ckpt.MANIFEST_NAME).read_text())
    name = os.path.relpath(secret, folder)  # ../../secret.txt, as ../../etc/hostname would be
    manifest["files"][name] = {"bytes": secret.stat().st_size, "sha256": "0" * 64}
    (folder / ckpt.MANIFEST_NAME).write_text(json.dumps(manifest))
    opened = _refused(folder, ValueError, rf"files entry names '{name}', which leads outside")
    assert str(secret.resolve()) not in opened


@pytest.mark.parametrize("how", ["dropped", "added"])
def test_a_file_the_manifest_does_not_list_is_refused(folder, how: str) -> None:
    shard = folder / "sharded" / "__0_0.distcp"
    if how == "dropped":  # a flipped bit in a shard the manifest leaves out
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
        manifest = json.loads((folder / ckpt.MANIFEST_NAME).read_text())
        del manifest["files"]["sharded/__0_0.distcp"]
        (folder / ckpt.MANIFEST_NAME).write_text(json.dumps(manifest))
    else:
        shard = folder / "sharded" / "__1_0.distcp"
        shard.write_bytes(b"planted")
    _refused(folder, ValueError, rf"{shard} is not listed in {folder / ckpt.MANIFEST_NAME}")


def test_a_link_in_the_folder_is_refused(folder, tmp_path) -> None:
    (tmp_path / "elsewhere").write_bytes(b"x")
    (folder / "link.pt").symlink_to(tmp_path / "elsewhere")
    _refused(folder, ValueError, r"link.pt is a link or a special file")


def test_damaged_shard_contents_raise_value_error_not_dcp_base_exception(folder) -> None:
    shard = folder / "sharded" / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))  # same size, zeros: the index fits, the data does not load
    ckpt.write_manifest(folder)
    _refused(folder, ValueError, rf"cannot read the sharded checkpoint {folder / 'sharded'}")


def test_non_finite_weights_written_by_dcp_are_refused(folder) -> None:
    import torch.distributed.checkpoint as dcp

    targets = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in
               ckpt.read_metadata(folder / "sharded").state_dict_metadata.items()}
    dcp.load(targets, checkpoint_id=str(folder / "sharded"), no_dist=True)
    targets["model/embed_tokens.weight"][0, 0] = float("nan")
    shutil.rmtree(folder / "sharded")
    ckpt.write_sharded(targets, folder / "sharded")
    ckpt.write_manifest(folder)
    _refused(folder, ValueError, r"non-finite values in model/embed_tokens.weight")


def test_a_failed_sharded_write_is_an_os_error_naming_the_folder(tmp_path) -> None:
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(OSError, match=f"cannot write the sharded checkpoint {tmp_path / 'a_file'}"):
        ckpt.write_sharded({"x": torch.zeros(2)}, tmp_path / "a_file")


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(shuffle=False), r"shuffle changed from True to False"),
    (dict(scheduler=lambda opt: NoamLR(opt, d_model=16, warmup=2)),
     r"scheduler was training.schedules.WarmupCosineLR, now training.schedules.NoamLR"),
    (dict(scheduler=lambda opt: WarmupCosineLR(opt, warmup=3, total=6)), r"scheduler's warmup changed from 2 to 3"),
    (dict(scheduler=lambda opt: WarmupCosineLR(opt, warmup=2, total=6, min_ratio=0.5)),
     r"scheduler's min_ratio changed from 0.1 to 0.5"),
])
def test_resume_refuses_a_changed_order_or_scheduler(folder, overrides, message) -> None:
    _refused(folder, ValueError, message, **overrides)


def test_a_manifest_nested_too_deeply_is_refused_before_parsing(folder) -> None:
    (folder / ckpt.MANIFEST_NAME).write_text('{"files": ' + "[" * 100_000 + "]" * 100_000 + "}")
    _refused(folder, ValueError, r"manifest.json nests JSON objects and arrays 100001 levels deep; expected at most 64")


@pytest.mark.parametrize("victim", ["sharded/__0_0.distcp", ckpt.STATE_NAME])
def test_an_io_error_while_restoring_is_an_oserror_and_changes_nothing(folder, victim: str) -> None:
    # The manifest check reads every file first (and passes); the read that restores the file then fails (a bad
    # sector, a network disk gone), after other parts of the checkpoint may have been read.
    global FAILING
    FAILING = {"path": os.path.realpath(folder / victim), "after": 1, "seen": 0}
    try:
        _refused(folder, OSError, "Input/output error")
    finally:
        seen, FAILING = FAILING["seen"], None
    assert seen == 2  # hashed once, then the restoring read failed
