"""push_to_hub / from_pretrained end to end over HTTP, against the in-process Hub of ``hub_server.py``."""

from __future__ import annotations

import importlib.util
import json
import logging
import tempfile
import time
from pathlib import Path

import pytest
import torch
from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

import tokenization
from models import DecoderLM, EncoderLM, Seq2SeqTransformer, auto
from models.checkpoints import hub as checkpoint_hub

from .conftest import DUMMY_TOKEN
from .hub_server import HubServer

TINY = {
    "DecoderLM": (DecoderLM, dict(vocab_size=100, d_model=32, n_layers=1)),
    "EncoderLM": (EncoderLM, dict(vocab_size=100, d_model=32, n_layers=1)),
    "Seq2SeqTransformer": (
        Seq2SeqTransformer, dict(vocab_size=100, d_model=32, n_encoder_layers=1, n_decoder_layers=1)
    ),
}


def tiny(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    cls, fields = TINY[name]
    torch.manual_seed(seed)
    return cls.from_preset("tiny", **{**fields, **overrides}).eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(4, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        if isinstance(model, Seq2SeqTransformer):
            return model(ids, ids[:, :4]).logits
        return model(ids).logits


def tiny_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "[PAD]": 1, "hello": 2, "zoo": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


# ------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("name", list(TINY))
def test_push_then_pull_is_bit_identical(name: str, hub: HubServer) -> None:
    model = tiny(name)
    info = model.push_to_hub(f"tester/{name.lower()}")
    assert info.commit_url == f"{hub.url}/tester/{name.lower()}/commit/{info.oid}"
    assert hub.repo(f"tester/{name.lower()}").branches["main"] == info.oid
    assert hub.count("POST", "/commit/") == 1  # the whole folder in one commit
    pulled = type(model).from_pretrained(f"tester/{name.lower()}")
    assert type(pulled) is type(model)
    assert pulled.config == model.config
    assert torch.equal(logits(model), logits(pulled))
    assert torch.equal(logits(model), logits(auto.from_pretrained(f"tester/{name.lower()}")))


def test_pushed_files_and_model_card(hub: HubServer) -> None:
    model = tiny("EncoderLM")
    info = model.push_to_hub("tester/card")
    files = hub.repo("tester/card").commits[info.oid].files
    assert sorted(files) == [".gitattributes", "README.md", "config.json", "model.safetensors"]
    assert json.loads(files["config.json"])["architecture"] == "EncoderLM"
    card = ModelCard.load("tester/card")  # downloaded through huggingface_hub
    assert card.data.library_name == "transformer-zoo"
    assert "EncoderLM" in card.data.tags
    assert 'EncoderLM.from_pretrained("tester/card")' in card.text
    assert f"{model.num_parameters():,}" in card.text
    assert str(card) == model.model_card("tester/card")


def test_second_push_keeps_the_first_commit_reachable(hub: HubServer) -> None:
    first, second = tiny("DecoderLM", seed=1), tiny("DecoderLM", seed=2)
    one = first.push_to_hub("tester/history", commit_message="first weights")
    two = second.push_to_hub("tester/history", commit_message="second weights")
    assert one.oid != two.oid
    assert torch.equal(logits(DecoderLM.from_pretrained("tester/history", revision=one.oid)), logits(first))
    assert torch.equal(logits(DecoderLM.from_pretrained("tester/history")), logits(second))
    api = HfApi()
    commits = api.list_repo_commits("tester/history")
    assert [c.title for c in commits] == ["second weights", "first weights", "initial commit"]
    api.create_tag("tester/history", tag="v1", revision=one.oid)
    assert torch.equal(logits(DecoderLM.from_pretrained("tester/history", revision="v1")), logits(first))
    assert {t.name: t.target_commit for t in api.list_repo_refs("tester/history").tags} == {"v1": one.oid}


def test_unchanged_push_makes_no_commit(hub: HubServer) -> None:
    model = tiny("DecoderLM")
    one = model.push_to_hub("tester/same")
    two = model.push_to_hub("tester/same")
    assert two.oid == one.oid
    assert hub.count("POST", "/commit/") == 1


def test_a_killed_push_leaves_nothing_after_the_next_push(hub: HubServer, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where push_to_hub stages the folder it uploads
    leftover = tmp_path / ".transformer-zoo-push.0123456789ab.saving"  # what a push killed while staging leaves
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"x" * 64)
    tiny("DecoderLM").push_to_hub("tester/after-kill")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".transformer-zoo-push.")] == []


def test_push_to_a_branch(hub: HubServer) -> None:
    main, dev = tiny("DecoderLM", seed=1), tiny("DecoderLM", seed=2)
    main.push_to_hub("tester/branches")
    info = dev.push_to_hub("tester/branches", revision="dev")
    branches = {b.name: b.target_commit for b in HfApi().list_repo_refs("tester/branches").branches}
    assert branches["dev"] == info.oid != branches["main"]
    assert torch.equal(logits(DecoderLM.from_pretrained("tester/branches", revision="dev")), logits(dev))
    assert torch.equal(logits(DecoderLM.from_pretrained("tester/branches")), logits(main))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dtype_survives_the_hub(dtype: torch.dtype, hub: HubServer) -> None:
    model = tiny("Seq2SeqTransformer").to(dtype)
    model.push_to_hub("tester/half")
    pulled = Seq2SeqTransformer.from_pretrained("tester/half", device="cpu")
    assert {p.dtype for p in pulled.parameters()} == {dtype}
    assert torch.equal(logits(model), logits(pulled))


def test_load_options_apply_to_hub_checkpoints(hub: HubServer) -> None:
    tiny("DecoderLM").push_to_hub("tester/options")
    pulled = DecoderLM.from_pretrained("tester/options", dtype=torch.bfloat16, attention_backend="math")
    assert {p.dtype for p in pulled.parameters()} == {torch.bfloat16}
    assert pulled.config.attention_backend == "math"


def test_tokenizer_travels_with_the_model(hub: HubServer) -> None:
    tok = tokenization.Tokenizer(tiny_tokenizer(), special_tokens={"mask": "zoo"})
    tiny("EncoderLM").push_to_hub("tester/tok", tokenizer=tok)
    pulled = EncoderLM.from_pretrained("tester/tok")
    assert pulled.tokenizer.encode("hello zoo") == tok.encode("hello zoo") == [2, 3]
    assert pulled.tokenizer.mask_token_id == 3  # roles come with tokenizer_config.json
    # An attached tokenizer is pushed again without being passed.
    pulled.push_to_hub("tester/tok-again")
    assert EncoderLM.from_pretrained("tester/tok-again").tokenizer.mask_token_id == 3


def test_other_architecture_from_the_hub(hub: HubServer) -> None:
    tiny("Seq2SeqTransformer").push_to_hub("tester/s2s")
    with pytest.raises(ValueError, match="tester/s2s@main holds a Seq2SeqTransformer checkpoint, not a DecoderLM"):
        DecoderLM.from_pretrained("tester/s2s")
    assert hub.count("GET", "model.safetensors") == 0  # refused from config.json, before downloading weights


def test_cached_checkpoint_loads_offline(hub: HubServer, monkeypatch) -> None:
    model = tiny("DecoderLM")
    model.push_to_hub("tester/cached", tokenizer=tiny_tokenizer())
    DecoderLM.from_pretrained("tester/cached")
    seen = len(hub.requests)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    pulled = DecoderLM.from_pretrained("tester/cached")
    assert len(hub.requests) == seen  # served from the huggingface_hub cache alone
    assert torch.equal(logits(model), logits(pulled))
    assert pulled.tokenizer.encode("hello zoo") == [2, 3]


# ------------------------------------------------------------------------------------------ server errors
@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """Record the backoff waits (of huggingface_hub's http_backoff and of the zoo's download retry) instead of
    sleeping them."""
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)
    return waits


@pytest.mark.parametrize("method", ["HEAD", "GET"])
@pytest.mark.parametrize("filename", ["config.json", "model.safetensors", "tokenizer.json"])
def test_one_transient_server_error_does_not_fail_the_load(
    method: str, filename: str, hub: HubServer, sleeps: list[float]
) -> None:
    model = tiny("DecoderLM")
    model.push_to_hub("tester/flaky", tokenizer=tiny_tokenizer())
    fault = hub.fail(method, f"/{filename}", status=500, times=1)
    pulled = DecoderLM.from_pretrained("tester/flaky")
    assert fault.served == 1  # the error did happen ...
    assert torch.equal(logits(model), logits(pulled))  # ... and the load went on
    assert pulled.tokenizer is not None and pulled.tokenizer.encode("hello zoo") == [2, 3]
    # huggingface_hub repeats a failed metadata request at once; the zoo retries a failed download after 1 s.
    assert sleeps == ([1.0] if method == "GET" else [])


def test_persistent_server_error_on_the_download_reports_its_status(hub: HubServer, sleeps: list[float]) -> None:
    tiny("DecoderLM").push_to_hub("tester/down")
    hub.fail("GET", "/model.safetensors", status=503, times=None)
    with pytest.raises(HfHubHTTPError) as err:
        DecoderLM.from_pretrained("tester/down")
    assert err.value.response.status_code == 503
    assert "503" in str(err.value) and "model.safetensors" in str(err.value)
    assert "local cache" not in str(err.value)
    assert hub.count("GET", "/model.safetensors") == checkpoint_hub.HUB_RETRIES + 1
    assert sleeps == [1.0, 2.0, 4.0, 8.0, 8.0]  # http_backoff's schedule


@pytest.mark.parametrize("filename", ["model.safetensors", "tokenizer.json"])
def test_persistent_server_error_on_metadata_reports_its_status(
    filename: str, hub: HubServer, sleeps: list[float]
) -> None:
    tiny("DecoderLM").push_to_hub("tester/down", tokenizer=tiny_tokenizer())
    hub.fail("HEAD", f"/{filename}", status=500, times=None)
    with pytest.raises(HfHubHTTPError) as err:  # never mistaken for an absent file (a model without tokenizer)
        DecoderLM.from_pretrained("tester/down")
    assert err.value.response.status_code == 500
    assert "500" in str(err.value) and "cannot find the requested files in the local cache" not in str(err.value)
    assert "'tester/down'" in str(err.value) and filename in str(err.value)
    assert len(sleeps) >= 3  # huggingface_hub retried the metadata request with backoff before giving up


def test_client_errors_are_not_retried(hub: HubServer, sleeps: list[float]) -> None:
    tiny("DecoderLM").push_to_hub("tester/forbidden")
    hub.fail("GET", "/model.safetensors", status=403, times=None)
    with pytest.raises(HfHubHTTPError) as err:
        DecoderLM.from_pretrained("tester/forbidden")
    assert err.value.response.status_code == 403
    assert hub.count("GET", "/model.safetensors") == 1 and sleeps == []


# ------------------------------------------------------------------------------------------ errors
def test_missing_repo(hub: HubServer) -> None:
    with pytest.raises(RepositoryNotFoundError) as err:
        DecoderLM.from_pretrained("tester/nothing-here", revision="v2")
    assert "'tester/nothing-here'" in str(err.value)
    assert "'v2'" in str(err.value)


def test_missing_revision(hub: HubServer) -> None:
    tiny("DecoderLM").push_to_hub("tester/revs")
    with pytest.raises(RevisionNotFoundError) as err:
        DecoderLM.from_pretrained("tester/revs", revision="no-such-branch")
    assert "'tester/revs'" in str(err.value)
    assert "no-such-branch" in str(err.value)
    with pytest.raises(RevisionNotFoundError):
        DecoderLM.from_pretrained("tester/revs", revision="0" * 40)


def test_missing_files(hub: HubServer) -> None:
    api = HfApi()
    api.create_repo("tester/empty")
    with pytest.raises(EntryNotFoundError) as err:
        DecoderLM.from_pretrained("tester/empty")
    assert "config.json" in str(err.value)
    assert "'tester/empty'" in str(err.value) and "'main'" in str(err.value)
    config_dict = tiny("DecoderLM").config.to_dict()
    config = json.dumps({"architecture": "DecoderLM", "format_version": 1, "config": config_dict})
    api.upload_file(path_or_fileobj=config.encode(), path_in_repo="config.json", repo_id="tester/empty")
    with pytest.raises(EntryNotFoundError, match="looked for model.safetensors, model.safetensors.index.json and"):
        DecoderLM.from_pretrained("tester/empty")


class _Hostile:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_hostile_pickle_on_the_hub_is_never_executed(hub: HubServer, tmp_path: Path) -> None:
    model = tiny("DecoderLM")
    marker = tmp_path / "pwned"
    bin_path = tmp_path / "pytorch_model.bin"
    torch.save({**model.state_dict(), "payload": _Hostile(marker)}, bin_path)
    config = json.dumps({"architecture": "DecoderLM", "format_version": 1, "config": model.config.to_dict()})
    api = HfApi()
    api.create_repo("tester/hostile")
    api.create_commit(
        "tester/hostile",
        [
            CommitOperationAdd("config.json", config.encode()),
            CommitOperationAdd("pytorch_model.bin", str(bin_path)),
        ],
        commit_message="a trap",
    )
    with pytest.raises(ValueError, match="refusing to load"):
        DecoderLM.from_pretrained("tester/hostile")
    assert not marker.exists()
    downloaded = hf_hub_download("tester/hostile", "pytorch_model.bin")
    torch.load(downloaded, weights_only=False)  # the payload is live: an unrestricted unpickler runs it
    assert marker.exists()


def test_corrupted_weights_on_the_hub(hub: HubServer) -> None:
    tiny("DecoderLM").push_to_hub("tester/corrupt")
    HfApi().upload_file(path_or_fileobj=b"\x08" + b"\x00" * 7 + b"{}", path_in_repo="model.safetensors",
                        repo_id="tester/corrupt")
    with pytest.raises(ValueError, match="model.safetensors is not a valid safetensors file"):
        DecoderLM.from_pretrained("tester/corrupt")


def test_private_repo_needs_the_token(hub: HubServer) -> None:
    model = tiny("DecoderLM")
    model.push_to_hub("tester/secret", private=True)
    assert hub.repo("tester/secret").private
    with pytest.raises(RepositoryNotFoundError):
        DecoderLM.from_pretrained("tester/secret", token=False)
    assert torch.equal(logits(DecoderLM.from_pretrained("tester/secret")), logits(model))


def test_bad_token_is_refused_and_never_printed(hub: HubServer, capsys, caplog) -> None:
    model = tiny("DecoderLM")
    with caplog.at_level(logging.DEBUG):
        model.push_to_hub("tester/loud")
        DecoderLM.from_pretrained("tester/loud")
        with pytest.raises(HfHubHTTPError) as err:
            model.push_to_hub("tester/loud", token="hf_wrong_token")
    assert err.value.response.status_code == 401
    out = capsys.readouterr()
    for text in (out.out, out.err, caplog.text, str(err.value)):
        assert DUMMY_TOKEN not in text
        assert "hf_wrong_token" not in text


def test_bad_push_arguments_fail_before_any_request(hub: HubServer) -> None:
    model = tiny("DecoderLM")
    with pytest.raises(ValueError, match="Repo id must be"):
        model.push_to_hub("too/many/slashes")
    with pytest.raises(TypeError, match="private must be a bool"):
        model.push_to_hub("tester/x", private="yes")
    with pytest.raises(ValueError, match="revision must be a non-empty branch name"):
        model.push_to_hub("tester/x", revision="")
    with pytest.raises(TypeError, match="tokenizer must have a save"):
        model.push_to_hub("tester/x", tokenizer=object())
    assert hub.requests == []


# ------------------------------------------------------------------------------------------ the example
def test_example_script_round_trips(hub: HubServer, capsys) -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / "hub.py"
    spec = importlib.util.spec_from_file_location("hub_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--repo-id", "tester/example", "--endpoint", hub.url, "--model", "seq2seq"]) == 0
    out = capsys.readouterr().out
    assert "outputs bit-identical=True, tokenizer identical=True" in out
    assert DUMMY_TOKEN not in out


# ------------------------------------------------------------------------------------------ transformers checkpoints
@pytest.mark.parametrize("name", ["DecoderLM", "EncoderLM"])
def test_transformers_checkpoint_from_the_hub(name: str, hub: HubServer, tmp_path: Path) -> None:
    """A repo laid out by ``transformers`` (config.json with model_type, HF tensor names, tied copies left
    out) loads through models.convert."""
    from models.convert import export

    model = tiny(name, dropout=0.0)
    hf_config, hf_state = export.to_transformers(model)
    api = HfApi()
    api.create_repo("tester/hf-format")
    weights = tmp_path / "model.safetensors"
    save_file(hf_state, str(weights), metadata={"format": "pt"})
    operations = [
        CommitOperationAdd("config.json", json.dumps(hf_config).encode()),
        CommitOperationAdd("model.safetensors", str(weights)),
    ]
    api.create_commit("tester/hf-format", operations, commit_message="transformers layout")
    pulled = auto.from_pretrained("tester/hf-format")
    assert type(pulled) is type(model)
    assert torch.equal(logits(model), logits(pulled))
    other = EncoderLM if name == "DecoderLM" else DecoderLM
    with pytest.raises(ValueError, match=f"converts to {name}, not {other.__name__}"):
        other.from_pretrained("tester/hf-format")


def test_sharded_checkpoint_from_the_hub(hub: HubServer, tmp_path: Path) -> None:
    model = tiny("Seq2SeqTransformer")
    model.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    operations = [CommitOperationAdd("config.json", str(tmp_path / "config.json"))]
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / shard), metadata={"format": "pt"})
        operations.append(CommitOperationAdd(shard, str(tmp_path / shard)))
        weight_map.update(dict.fromkeys(keys, shard))
    index = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    operations.append(CommitOperationAdd("model.safetensors.index.json", index))
    api = HfApi()
    api.create_repo("tester/sharded")
    api.create_commit("tester/sharded", operations, commit_message="sharded weights")
    pulled = Seq2SeqTransformer.from_pretrained("tester/sharded")
    assert torch.equal(logits(model), logits(pulled))
    assert all(hub.count("GET", f"/{shard}") == 1 for shard in shards)


def test_server_lists_trees_and_serves_snapshots(hub: HubServer) -> None:
    """The server also answers what snapshot_download and list_repo_tree ask (other code may use them)."""
    tiny("DecoderLM").push_to_hub("tester/tree", tokenizer=tokenization.Tokenizer(tiny_tokenizer()))
    api = HfApi()
    paths = sorted(f.path for f in api.list_repo_tree("tester/tree"))
    assert paths == [
        ".gitattributes", "README.md", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"
    ]
    folder = Path(snapshot_download("tester/tree"))
    assert sorted(p.name for p in folder.iterdir()) == paths
    assert DecoderLM.from_pretrained(folder).tokenizer.encode("zoo") == [3]
