"""A sentence-transformers folder from the in-process Hub: ``models.from_pretrained("org/repo")`` fetches
``modules.json``, the pooling and normalisation configs beside the transformer and encodes as
``SentenceTransformer`` does."""

from __future__ import annotations

import torch
from sentence_transformers import SentenceTransformer

import models
from tests.hub.hub_server import Repo
from tests.models.test_embed import bert_folder as st_base  # noqa: F401 (a fixture, used by name)
from tests.models.test_embed import build_st, encode, texts


@torch.no_grad()
def test_sentence_transformers_folder_from_the_hub(hub, tmp_path, request):
    build_st(request.getfixturevalue("st_base"), tmp_path / "st", "max", True)
    files = {str(p.relative_to(tmp_path / "st")): p.read_bytes() for p in (tmp_path / "st").rglob("*") if p.is_file()}
    repo = hub.repos[("model", "tester/tiny-st")] = Repo("model", "tester/tiny-st", private=False)
    repo.add_commit("main", files, "add a sentence-transformers folder")
    zoo = models.from_pretrained("tester/tiny-st")
    assert zoo.config.options["head"]["pooling"] == "max" and zoo.config.options["head"]["normalize"] is True
    sentences = texts(n=6, seed=4)
    expected = encode(SentenceTransformer(str(tmp_path / "st"), device="cpu"), sentences)
    torch.testing.assert_close(zoo.embed(sentences, batch_size=4), expected, atol=1e-5, rtol=0)
