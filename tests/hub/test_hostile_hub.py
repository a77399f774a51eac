"""A Hub that answers hostile metadata: ``huggingface_hub`` names cache files after the ETag and the commit id the
server sends, so values such as ``../../../../x`` must be refused (``ValueError`` naming the header) before anything
is written, and nothing may appear outside ``HF_HOME``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from models import DecoderLM

from .hub_server import HubServer

ESCAPE = "../../../../escaped"  # from HF_HOME/hub/models--tester--x/blobs: lands in the test's tmp_path


def tiny() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM.from_preset("tiny", vocab_size=50, d_model=16, n_layers=1, n_heads=2).eval()


def everything(root: Path) -> set[str]:
    return {os.path.relpath(os.path.join(d, n), root) for d, dirs, names in os.walk(root) for n in dirs + names}


def outside_hf_home(tmp_path: Path) -> set[str]:
    return {p for p in everything(tmp_path) if not p.startswith("hf_home")}


@pytest.mark.parametrize(("path_part", "header", "value"), [
    ("/model.safetensors", "ETag", f'"{ESCAPE}"'),
    ("/model.safetensors", "X-Linked-Etag", f'"{ESCAPE}"'),
    ("/config.json", "ETag", f'W/"{ESCAPE}"'),
    ("/model.safetensors", "X-Repo-Commit", ESCAPE),
    ("/tokenizer.json", "X-Repo-Commit", ESCAPE),  # on the 404 of a missing file: cached as .no_exist/<commit>/
])
def test_hostile_hub_metadata_is_refused_before_anything_is_written(
    path_part: str, header: str, value: str, hub: HubServer, tmp_path: Path
) -> None:
    tiny().push_to_hub("tester/x")  # no tokenizer: tokenizer.json is answered 404
    before = outside_hf_home(tmp_path)
    hub.forge(path_part, {header: value})
    kind = "commit id" if header == "X-Repo-Commit" else "ETag"
    with pytest.raises(ValueError, match=f"the server sent the {kind} '.*escaped\"?'") as err:
        DecoderLM.from_pretrained("tester/x")
    assert path_part.strip("/") in str(err.value) and "tester/x" in str(err.value)
    assert outside_hf_home(tmp_path) == before
    assert not list((tmp_path / "hf_home").rglob(path_part.strip("/")))  # the refused file never landed


def test_a_server_honest_to_the_first_request_and_hostile_after_cannot_write_outside(
    hub: HubServer, tmp_path: Path
) -> None:
    # A separate check request would pass and leave huggingface_hub's own metadata request to carry the hostile
    # ETag: the answer huggingface_hub names the blob after must be the one checked.
    model = tiny()
    model.push_to_hub("tester/x")
    before = outside_hf_home(tmp_path)
    hub.forge("/model.safetensors", {"ETag": f'"{ESCAPE}"'}, after=1)
    loaded = DecoderLM.from_pretrained("tester/x")  # the one metadata answer was honest; the GET's ETag is unused
    assert all(torch.equal(t, loaded.state_dict()[name]) for name, t in model.state_dict().items())
    assert outside_hf_home(tmp_path) == before
    assert (hub.count("HEAD", "/model.safetensors"), hub.count("GET", "/model.safetensors")) == (1, 1)


def test_a_revision_leading_out_of_the_cache_is_refused(hub: HubServer, tmp_path: Path) -> None:
    tiny().push_to_hub("tester/x")
    before = everything(tmp_path)
    with pytest.raises(ValueError, match=r"the revision names '\.\./\.\./\.\./\.\./r', which leads outside"):
        DecoderLM.from_pretrained("tester/x", revision="../../../../r")
    assert everything(tmp_path) == before
    assert hub.requests[-1][0] == "POST" or not any("resolve/../" in p for _, p in hub.requests)


def test_honest_metadata_still_loads_and_cached_files_are_not_asked_for_again(hub: HubServer) -> None:
    model = tiny()
    model.push_to_hub("tester/x")
    loaded = DecoderLM.from_pretrained("tester/x")
    assert all(torch.equal(t, loaded.state_dict()[name]) for name, t in model.state_dict().items())
    asked = hub.count("HEAD", "/model.safetensors"), hub.count("GET", "/model.safetensors")
    assert asked == (1, 1)  # one metadata request, checked as it arrives, and the download
    DecoderLM.from_pretrained("tester/x")  # config.json at main is asked for again; the weights come from the cache
    assert (hub.count("HEAD", "/model.safetensors"), hub.count("GET", "/model.safetensors")) == asked
