"""``models.from_pretrained("org/repo", gguf_file=...)``: a GGUF file (and a split set) from the in-process Hub."""

from __future__ import annotations

import pytest
import torch

import models
from tests.hub.hub_server import Repo
from tests.models.test_gguf_families import IDS, Q, tiny, write


def test_gguf_file_from_the_hub_and_a_local_folder(hub, tmp_path):
    original = tiny("qwen2")
    single = write(tmp_path / "tiny.Q8_0.gguf", "qwen2", original, Q.Q8_0)
    (tmp_path / "split").mkdir()
    first = write(tmp_path / "split" / "tiny.gguf", "qwen2", original, Q.Q8_0, parts=2)
    files = {single.name: single.read_bytes(),
             **{p.name: p.read_bytes() for p in sorted(first.parent.glob("*.gguf"))}}
    repo = hub.repos[("model", "tester/tiny-gguf")] = Repo("model", "tester/tiny-gguf", private=False)
    repo.add_commit("main", files, "add GGUF files")

    local = models.from_pretrained(single)
    with torch.no_grad():
        expected = local(IDS).logits
        for gguf_file in (single.name, first.name):
            model = models.from_pretrained("tester/tiny-gguf", gguf_file=gguf_file)
            assert torch.equal(model(IDS).logits, expected), gguf_file
        in_folder = models.from_pretrained(tmp_path, gguf_file=single.name)
        assert torch.equal(in_folder(IDS).logits, expected)
    assert model.tokenizer is not None


@pytest.mark.parametrize("bad", ["../x.gguf", "/etc/x.gguf", "model.bin"])
def test_gguf_file_must_be_a_relative_gguf_path(bad):
    with pytest.raises(ValueError, match="gguf_file="):
        models.from_pretrained("tester/tiny-gguf", gguf_file=bad)
