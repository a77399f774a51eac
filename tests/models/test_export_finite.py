"""Every exporter refuses non-finite weights, naming the tensor, before anything is written; and a GGUF export
killed mid-save leaves a staging file that the next save of the same path removes.

The exports: GGUF (``save_gguf``; also values its type turns into inf: 1e6 as F16, 1e7 as Q8_0 whose F16 block scale
would be 78740), ``transformers`` (``save_transformers``), sentence-transformers (``save_sentence_transformers``) and
``peft`` adapters (``save_adapter``). The kill test forks a child whose save is stopped while it writes its tensors
and is SIGKILLed there, as tests/models/test_save_kill.py does for checkpoint folders.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from models import DecoderLM, EncoderLM
from models.checkpoints.file_staging import fcntl, remove_abandoned, staging_file
from models.convert import save_transformers
from models.gguf import read_gguf

NAME = "layers.1.self_attn.k_proj.weight"
HF_NAME = "model.layers.1.self_attn.k_proj.weight"


def llama(value: float | None = None, at: tuple[int, int] = (3, 5)) -> DecoderLM:
    torch.manual_seed(0)
    model = DecoderLM.from_preset("llama-tiny", vocab_size=64).eval()
    if value is not None:
        with torch.no_grad():
            model.state_dict()[NAME][at] = value
    return model


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize(("value", "dtype", "match"), [
    (float("nan"), "Q8_0", f"'{HF_NAME}' holds 1 non-finite values"),
    (float("inf"), "F32", f"'{HF_NAME}' holds 1 non-finite values"),
    (1e6, "F16", "'blk.1.attn_k.weight' holds 1e\\+06, beyond the largest F16 value"),
    (1e7, "Q8_0", "'blk.1.attn_k.weight' holds 1e\\+07, beyond the largest Q8_0 \\(F16 scales\\) value"),
])
def test_gguf_export_refuses_what_it_cannot_write_finitely(tmp_path: Path, value: float, dtype: str,
                                                           match: str) -> None:
    with pytest.raises(ValueError, match=f"GGUF export: tensor {match}"):
        llama(value).save_gguf(tmp_path / "m.gguf", dtype)
    assert leftovers(tmp_path) == []  # no file, no staging file


def test_gguf_export_keeps_values_its_type_holds(tmp_path: Path) -> None:
    path = llama(1e6).save_gguf(tmp_path / "m.gguf", "Q8_0")  # 1e6 / 127 fits an F16 scale
    assert read_gguf(path)[1]  # it reads back
    assert leftovers(tmp_path) == ["m.gguf"]


@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
def test_transformers_export_refuses_non_finite_weights(tmp_path: Path, value: float) -> None:
    with pytest.raises(ValueError, match=f"export to transformers: tensor '{HF_NAME}' holds 1 non-finite"):
        save_transformers(llama(value), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_sentence_transformers_export_refuses_non_finite_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = EncoderLM.from_preset("tiny", vocab_size=50)
    with torch.no_grad():
        model.layers[0].ffn.up_proj.weight[0, 0] = float("nan")  # a (BERT-named) FFN weight
    model.tokenizer = object()  # refused before the tokenizer is written
    with pytest.raises(ValueError, match=r"sentence-transformers export: tensor '.*' holds 1 non-finite"):
        model.save_sentence_transformers(tmp_path / "st")
    assert not (tmp_path / "st").exists()


def test_adapter_export_refuses_non_finite_weights(tmp_path: Path) -> None:
    model = llama()
    model.add_adapter(r=2, target_modules=["q_proj"])
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n or n.endswith(".B"))[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"save_adapter: tensor '.*q_proj.*' holds 1 non-finite"):
        model.save_adapter(tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


# ---------------------------------------------------------------------------------------------- killed exports
pytestmark_kill = pytest.mark.skipif(not hasattr(os, "fork") or fcntl is None, reason="needs os.fork and flock")


@pytestmark_kill
def test_a_killed_gguf_export_leaves_a_staging_file_the_next_save_removes(tmp_path: Path) -> None:
    import gguf  # noqa: PLC0415 (the writer the child is stopped in)

    model, target = llama(), tmp_path / "m.gguf"
    model.save_gguf(target, "Q8_0")
    before = target.read_bytes()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its save stops while it writes its tensors, and waits to be killed
        try:
            os.close(ready_r)

            def stop(self, *args, **kwargs) -> None:
                os.write(ready_w, b"x")
                signal.pause()

            gguf.GGUFWriter.write_tensors_to_file = stop
            model.save_gguf(target, "Q8_0")
        finally:
            os._exit(1)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"x"
    staged = [name for name in leftovers(tmp_path) if name.endswith(".saving")]
    assert len(staged) == 1 and remove_abandoned(target) == []  # a live save's staging file is never touched
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(ready_r)
    assert target.read_bytes() == before and staged[0] in leftovers(tmp_path)  # the old file; the staging file left
    llama(0.5).save_gguf(target, "Q8_0")  # the next save of the same path
    assert leftovers(tmp_path) == ["m.gguf"] and target.read_bytes() != before


@pytestmark_kill
def test_a_staging_file_held_by_a_live_writer_is_kept(tmp_path: Path) -> None:
    target = tmp_path / "m.gguf"
    with staging_file(target) as staging:
        staging.write_bytes(b"partial")
        llama().save_gguf(target, "F32")  # another save of the same path meanwhile
        assert staging.exists()
    assert leftovers(tmp_path) == ["m.gguf"]
