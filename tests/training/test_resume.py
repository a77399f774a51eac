"""Resume checks before it trusts (all or nothing, every damaged file named), strict TrainerConfig types,
trainable-only optimisers and checkpoints, and saves that survive a kill at any instant."""

from __future__ import annotations

import functools
import os
import pickle
import shutil
import signal
from pathlib import Path

import pytest
import torch

from models import DecoderLM
from training import CausalLMCollator, Trainer, TrainerConfig, WarmupCosineLR
from training import checkpoint as ckpt

TINY = dict(vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_layers=1, max_len=32, dropout=0.0)


def _rows(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 14, (n,), generator=g).tolist()
    return [[2] + torch.randint(5, 40, (k,), generator=g).tolist() + [3] for k in lengths]


def _trainer(tmp_path: Path, init: int = 0, rows: int = 24, optimizer=None, freeze: tuple[str, ...] = (),
             **overrides) -> Trainer:
    torch.manual_seed(0)  # the frozen weights are the same in every build: they come from the user's model
    model = DecoderLM.from_preset("tiny", **TINY)
    torch.manual_seed(init)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not any(name.startswith(f) for f in freeze):
                p.normal_(0, 0.1)  # another initialisation of everything trainable
    for name, p in model.named_parameters():
        p.requires_grad_(not any(name.startswith(f) for f in freeze))
    config = TrainerConfig(**{"max_steps": 6, "batch_size": 4, "progress": False, "checkpoint_dir": str(tmp_path),
                              **overrides})
    return Trainer(model, optimizer or functools.partial(torch.optim.AdamW, lr=1e-2), config, _rows(rows),
                   CausalLMCollator(pad_token_id=0),
                   scheduler=lambda opt: WarmupCosineLR(opt, warmup=2, total=6))


def _snapshot(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def _unchanged(trainer: Trainer, before: list[torch.Tensor]) -> bool:
    untouched = all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    return untouched and trainer.step == 0 and not trainer.optimizer.state and trainer.history == []


@pytest.mark.parametrize(("field", "value", "message"), [
    ("max_grad_norm", float("nan"), "max_grad_norm must be a finite number"),
    ("max_grad_norm", float("inf"), "max_grad_norm must be a finite number"),
    ("max_grad_norm", True, "max_grad_norm"),
    ("seed", "0", "seed must be an integer"),
    ("seed", True, "seed must be an integer"),
    ("seed", -1, "seed must be an integer >= 0"),
    ("shuffle", "no", "shuffle must be True or False"),
    ("shuffle", 0, "shuffle must be True or False"),
    ("progress", "yes", "progress must be True or False"),
    ("batch_size", 2.0, "batch_size must be an integer"),
    ("checkpoint_dir", 5, "checkpoint_dir must be a folder path"),
    ("device", 0, "device must be a string"),
    ("parallel", "zero", "parallel must be one of"),
    ("mixed_precision", "fp8", "mixed_precision must be one of"),
    ("tp_size", 2, "tp_size=2 needs parallel='tp' or 'fsdp\\+tp'"),
])
def test_config_types_are_strict(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainerConfig(max_steps=1, **{field: value})


def test_config_accepts_paths_and_needs_tp_size_for_2d() -> None:
    assert TrainerConfig(max_steps=1, checkpoint_dir=Path("runs")).checkpoint_dir == "runs"
    with pytest.raises(ValueError, match="needs tp_size"):
        TrainerConfig(max_steps=1, parallel="fsdp+tp")


@pytest.mark.parametrize(("change", "message"), [
    (dict(batch_size=2), "global batch changed from 4 .batch_size 4 x 1 data-parallel replicas. to 2"),
    (dict(rows=30), "training set had 24 examples, now 30"),
    (dict(optimizer=functools.partial(torch.optim.SGD, lr=0.1)), "optimizer was torch.optim.adamw.AdamW, now "
                                                                  "torch.optim.sgd.SGD"),
    (dict(grad_accum_steps=2), "grad_accum_steps changed from 1 to 2"),
    (dict(seed=3), "seed changed from 0 to 3"),
    (dict(freeze=("embed_tokens",)), "trainable parameters differ"),
])
def test_resume_refuses_a_changed_run_and_restores_nothing(tmp_path, change: dict, message: str) -> None:
    first = _trainer(tmp_path)
    first.train(until=2)
    first.save_checkpoint()
    other = _trainer(tmp_path, init=1, **change)
    before = _snapshot(other)
    with pytest.raises(ValueError, match=message):
        other.load_checkpoint("latest")
    assert _unchanged(other, before)


def test_another_world_size_needs_the_explicit_option(tmp_path) -> None:
    first = _trainer(tmp_path)
    first.train(until=2)
    saved = first.save_checkpoint()
    state = torch.load(saved / ckpt.STATE_NAME, weights_only=True)
    state["run"].update(world_size=2, dp_size=2, batch_size=2)  # as if 2 processes x 2 examples had written it
    ckpt.save_torch(state, saved / ckpt.STATE_NAME)
    ckpt.write_manifest(saved)
    other = _trainer(tmp_path, init=1)
    before = _snapshot(other)
    with pytest.raises(ValueError, match="written by 2 process.es., this run has 1: pass allow_world_size_change"):
        other.load_checkpoint(saved)
    assert _unchanged(other, before)
    other.load_checkpoint(saved, allow_world_size_change=True)
    assert other.step == 2
    for a, b in zip(first.model.parameters(), other.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_every_damaged_file_is_named_and_nothing_is_restored(tmp_path) -> None:
    first = _trainer(tmp_path)
    first.train(until=2)
    saved = first.save_checkpoint()
    shard = saved / "sharded" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (saved / ckpt.STATE_NAME).write_bytes((saved / ckpt.STATE_NAME).read_bytes()[:100])
    (saved / "rng-rank0.pt").unlink()
    other = _trainer(tmp_path, init=1)
    before = _snapshot(other)
    with pytest.raises(ValueError) as info:
        other.load_checkpoint(saved)
    message = str(info.value)
    assert f"{shard} is damaged" in message
    assert f"{saved / ckpt.STATE_NAME} is damaged" in message
    assert f"{saved / 'rng-rank0.pt'} is missing" in message
    assert _unchanged(other, before)


def test_unreadable_files_behind_a_matching_manifest_are_named(tmp_path) -> None:
    first = _trainer(tmp_path)
    first.train(until=1)
    saved = first.save_checkpoint()
    (saved / "rng-rank0.pt").write_bytes(b"not a torch file")
    ckpt.write_manifest(saved)  # the manifest vouches for the bad file: loading itself must name it
    other = _trainer(tmp_path, init=1)
    with pytest.raises(ValueError, match=r"rng-rank0.pt \(random state of process 0\) is damaged"):
        other.load_checkpoint(saved)
    (saved / "rng-rank0.pt").unlink()
    ckpt.write_manifest(saved)
    with pytest.raises(ValueError, match=r"rng-rank0.pt \(random state of process 0\) is missing"):
        other.load_checkpoint(saved)


def test_the_checkpoint_index_is_never_unpickled_freely(tmp_path) -> None:
    first = _trainer(tmp_path)
    saved = first.save_checkpoint()

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    (saved / "sharded" / ".metadata").write_bytes(pickle.dumps(Evil()))
    ckpt.write_manifest(saved)
    with pytest.raises(ValueError, match="refusing to load posix.system|refusing to load os.system"):
        _trainer(tmp_path, init=1).load_checkpoint(saved)
    assert not (tmp_path / "pwned").exists()


def test_a_checkpoint_of_another_model_is_refused(tmp_path) -> None:
    first = _trainer(tmp_path)
    first.save_checkpoint()
    torch.manual_seed(0)
    wider = DecoderLM.from_preset("tiny", **{**TINY, "d_ff": 64})
    other = Trainer(wider, functools.partial(torch.optim.AdamW, lr=1e-2),
                    TrainerConfig(max_steps=6, batch_size=4, progress=False, checkpoint_dir=str(tmp_path)), _rows(24),
                    CausalLMCollator(pad_token_id=0), scheduler=lambda opt: WarmupCosineLR(opt, warmup=2, total=6))
    with pytest.raises(ValueError, match=r"parameters of another shape .another model.: layers.0.ffn"):
        other.load_checkpoint("latest")


def test_optimizer_sees_only_trainable_parameters_and_checkpoints_hold_only_them(tmp_path) -> None:
    seen: list[list[torch.nn.Parameter]] = []

    def factory(params):
        seen.append(params)
        return torch.optim.AdamW(params, lr=1e-2)

    frozen = ("embed_tokens", "layers.0.self_attn")
    straight = _trainer(tmp_path / "a", optimizer=factory, freeze=frozen)
    trainable = [p for p in straight.model.parameters() if p.requires_grad]
    assert [id(p) for p in seen[0]] == [id(p) for p in trainable] and len(trainable) < len(
        list(straight.model.parameters()))
    frozen_before = {n: p.detach().clone() for n, p in straight.model.named_parameters() if not p.requires_grad}
    expected = [r["loss"] for r in straight.train()]
    for n, p in straight.model.named_parameters():
        if n in frozen_before:
            assert torch.equal(p, frozen_before[n]), n  # frozen weights do not move

    first = _trainer(tmp_path / "b", freeze=frozen)
    first.train(until=3)
    saved = first.save_checkpoint()
    keys = set(ckpt.tensor_shapes(ckpt.read_metadata(saved / "sharded")))
    assert {k.split("/")[1] for k in keys} == {n for n, p in first.model.named_parameters() if p.requires_grad}
    assert not any(k.split("/")[1].startswith(frozen) for k in keys)
    resumed = _trainer(tmp_path / "b", init=5, freeze=frozen)  # frozen weights: the user's model (the same seed)
    resumed.load_checkpoint("latest")
    assert [r["loss"] for r in resumed.train()] == expected

    model = DecoderLM.from_preset("tiny", **TINY)
    model.embed_tokens.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="1 frozen one"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerConfig(max_steps=1, batch_size=4),
                _rows(8), CausalLMCollator(pad_token_id=0))


def test_save_pretrained_writes_the_plain_checkpoint(tmp_path) -> None:
    trainer = _trainer(tmp_path)
    trainer.train(until=1)
    out = trainer.save_pretrained(tmp_path / "export")
    reloaded = DecoderLM.from_pretrained(out)
    for (name, a), b in zip(trainer.model.state_dict().items(), reloaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def _die_at(event: int) -> None:
    """Make this process SIGKILL itself just before (even ``event``) or just after (odd) file operation number
    ``event // 2`` (renames, replaces and folder removals)."""
    count = [0]

    def deadly(real):
        def call(*args, **kwargs):
            i = count[0]
            count[0] += 1
            if 2 * i == event:
                os.kill(os.getpid(), signal.SIGKILL)
            result = real(*args, **kwargs)
            if 2 * i + 1 == event:
                os.kill(os.getpid(), signal.SIGKILL)
            return result
        return call

    os.rename, os.replace, shutil.rmtree = deadly(os.rename), deadly(os.replace), deadly(shutil.rmtree)


def test_a_save_killed_at_any_instant_leaves_the_old_or_the_new_checkpoint(tmp_path) -> None:
    """Kill the saving process just before and just after every rename and removal it makes: the newest
    checkpoint is then whole (the previous or the new one), and the next load cleans the leftovers."""
    template = tmp_path / "template"
    old = _trainer(template, keep_checkpoints=2)
    old.train(until=1)
    old.save_checkpoint()  # step 1: pruned by the save under test
    old.train(until=2)
    old.save_checkpoint()  # step 2: replaced by the save under test
    new = _trainer(template, init=3, keep_checkpoints=1)
    new.train(until=2)  # another run reaching step 2
    old_weights = {n: p.detach().clone() for n, p in old.model.named_parameters()}
    new_weights = {n: p.detach().clone() for n, p in new.model.named_parameters()}
    event = 0
    while True:
        root = tmp_path / f"kill{event}"
        shutil.copytree(template, root)
        pid = os.fork()
        if pid == 0:  # the child saves and is killed at `event`
            _die_at(event)
            try:
                new.save_checkpoint(root)
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status)
        resumed = _trainer(root, init=9)
        assert resumed.load_checkpoint("latest").name == "step-00000002", event
        loaded = {n: p.detach() for n, p in resumed.model.named_parameters()}
        is_old = all(torch.equal(loaded[n], old_weights[n]) for n in loaded)
        is_new = all(torch.equal(loaded[n], new_weights[n]) for n in loaded)
        assert is_old or is_new, f"kill at event {event}: neither the old nor the new checkpoint"
        assert sorted(p.name for p in root.iterdir()) in (["step-00000001", "step-00000002"], ["step-00000002"]), event
        if not killed:
            assert is_new and [p.name for p in root.iterdir()] == ["step-00000002"]
            break
        event += 1
    assert event >= 8  # staging, DCP's own renames, the aside rename, the publish and both removals were hit
