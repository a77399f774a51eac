"""Local checkpoint folders: save_pretrained / from_pretrained / models.auto.from_pretrained."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

import blocks
import models as zoo
import tokenization
from models import DecoderLM, EncoderLM, Seq2SeqTransformer, auto
from models import gguf as zoo_gguf
from models.checkpoints import files as checkpoint_files
from models.convert import registry as converter_registry
from models.gguf import read_gguf as real_read_gguf
from tests.strategies import registry_names

TINY = {
    "DecoderLM": (DecoderLM, dict(vocab_size=100, d_model=32, n_layers=1)),
    "EncoderLM": (EncoderLM, dict(vocab_size=100, d_model=32, n_layers=1)),
    "Seq2SeqTransformer": (
        Seq2SeqTransformer, dict(vocab_size=100, d_model=32, n_encoder_layers=1, n_decoder_layers=1)
    ),
}


def tiny(name: str, **overrides) -> torch.nn.Module:
    cls, fields = TINY[name]
    return cls.from_preset("tiny", **{**fields, **overrides}).eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 100, (2, 6), generator=gen).to(next(model.parameters()).device)
    with torch.no_grad():
        if isinstance(model, Seq2SeqTransformer):
            return model(ids, ids[:, :4]).logits
        return model(ids).logits


def perturb(model: torch.nn.Module, seed: int = 1) -> None:
    """Move every weight a little so tests never compare two fresh initialisations."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.01)


def tiny_tokenizer() -> Tokenizer:
    vocab = {"[UNK]": 0, "[PAD]": 1, "hello": 2, "world": 3, "zoo": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


# ------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("name", list(TINY))
def test_round_trip_is_bit_identical(name: str, tmp_path: Path) -> None:
    model = tiny(name)
    perturb(model)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = type(model).from_pretrained(tmp_path / "ckpt")
    assert type(loaded) is type(model)
    assert loaded.config == model.config
    assert not loaded.training
    assert_same_weights(model, loaded)
    assert torch.equal(logits(model), logits(loaded))
    assert loaded.num_parameters() == model.num_parameters()


@pytest.mark.parametrize("name", list(TINY))
def test_auto_loader_picks_the_class(name: str, tmp_path: Path) -> None:
    model = tiny(name)
    model.save_pretrained(str(tmp_path / "ckpt"))
    loaded = zoo.from_pretrained(str(tmp_path / "ckpt"))  # models.from_pretrained, the top-level loader
    assert type(loaded) is type(model)
    assert torch.equal(logits(model), logits(loaded))


def test_folder_layout_and_config_json(tmp_path: Path) -> None:
    model = tiny("DecoderLM")
    out = model.save_pretrained(tmp_path / "a" / "b")
    assert out == tmp_path / "a" / "b"
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b"]  # no staging leftovers
    raw = json.loads((out / "config.json").read_text())
    assert raw["architecture"] == "DecoderLM"
    assert raw["format_version"] == 1
    assert raw["library"] == "transformer-zoo"
    assert raw["config"] == json.loads(json.dumps(model.config.to_dict()))
    assert raw["dtype"] == "float32"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata()["format"] == "pt"


def test_saving_is_deterministic(tmp_path: Path) -> None:
    model = tiny("Seq2SeqTransformer")
    model.save_pretrained(tmp_path, tokenizer=tiny_tokenizer())
    first = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for _ in range(3):  # an unchanged model must give unchanged files, or every push would be a new commit
        model.save_pretrained(tmp_path, tokenizer=tiny_tokenizer())
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == first


@pytest.mark.parametrize(
    ("name", "stored", "aliases"),
    [
        ("DecoderLM", "embed_tokens.weight", ["lm_head.weight"]),
        ("EncoderLM", "embed_tokens.weight", ["mlm_head.decoder.weight"]),
        ("Seq2SeqTransformer", "src_embed.weight", ["tgt_embed.weight", "lm_head.weight"]),
    ],
)
def test_tied_weights_are_stored_once_and_retied(name: str, stored: str, aliases: list[str], tmp_path: Path) -> None:
    model = tiny(name)
    model.save_pretrained(tmp_path)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert stored in keys
    assert not keys & set(aliases)
    loaded = type(model).from_pretrained(tmp_path)
    params = dict(loaded.named_parameters(remove_duplicate=False))
    for alias in aliases:
        assert params[alias] is params[stored]
    # Still tied after loading: training one updates the other.
    with torch.no_grad():
        params[stored].add_(1.0)
    assert torch.equal(params[aliases[0]], params[stored])


def test_untied_weights_are_stored_separately(tmp_path: Path) -> None:
    model = tiny("DecoderLM", tie_embeddings=False)
    model.save_pretrained(tmp_path)
    assert {"embed_tokens.weight", "lm_head.weight"} <= set(load_file(str(tmp_path / "model.safetensors")))
    loaded = DecoderLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is not loaded.embed_tokens.weight
    assert_same_weights(model, loaded)


@st.composite
def zoo_models(draw: st.DrawFn) -> torch.nn.Module:
    name = draw(st.sampled_from(sorted(TINY)))
    fields = dict(
        d_model=16, n_heads=2, d_ff=32, dropout=0.0, max_len=32,
        positional=draw(registry_names("positional")), ffn=draw(registry_names("ffn")),
        norm=draw(registry_names("norm")), sublayer=draw(registry_names("sublayer")),
        tie_embeddings=draw(st.booleans()), bias=draw(st.booleans()),
    )
    if name == "Seq2SeqTransformer":
        fields.update(share_embeddings=draw(st.booleans()), output_bias=draw(st.booleans()))
    if name == "EncoderLM":
        fields.update(type_vocab_size=draw(st.sampled_from([0, 2])))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    return tiny(name, **fields)


@settings(max_examples=15)
@given(model=zoo_models())
def test_round_trip_over_registered_blocks(model: torch.nn.Module) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        loaded = auto.from_pretrained(tmp)
    assert loaded.config == model.config
    assert_same_weights(model, loaded)
    assert torch.equal(logits(model), logits(loaded))
    tied = lambda m: sorted(  # noqa: E731 - names grouped by shared parameter object
        sorted(n for n, p in m.named_parameters(remove_duplicate=False) if p is q) for q in m.parameters()
    )
    assert tied(loaded) == tied(model)


# ------------------------------------------------------------------------------------------ dtype, device, backend
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dtype_is_preserved(dtype: torch.dtype, tmp_path: Path) -> None:
    model = tiny("DecoderLM").to(dtype)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    loaded = DecoderLM.from_pretrained(tmp_path)
    assert {p.dtype for p in loaded.parameters()} == {dtype}
    assert_same_weights(model, loaded)
    assert torch.equal(logits(model), logits(loaded))


def test_dtype_argument_casts_like_module_to(tmp_path: Path) -> None:
    model = tiny("Seq2SeqTransformer")
    model.save_pretrained(tmp_path)
    loaded = Seq2SeqTransformer.from_pretrained(tmp_path, dtype="bfloat16")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    reference = tiny("Seq2SeqTransformer")
    reference.load_state_dict(model.state_dict())
    reference.to(torch.bfloat16)
    assert torch.equal(logits(reference), logits(loaded))
    assert loaded.lm_head.weight is loaded.src_embed.weight


def test_one_float64_tensor_is_cast_to_the_model_dtype(tmp_path: Path, caplog) -> None:
    model = tiny("DecoderLM")
    perturb(model)
    model.final_norm.to(torch.float64)  # one float64 tensor among float32 ones
    model.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="models.checkpoints.loading"):
        loaded = DecoderLM.from_pretrained(tmp_path)
    assert "final_norm.weight (float64)" in caplog.text and "cast to float32" in caplog.text
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    reference = tiny("DecoderLM")
    reference.load_state_dict(model.state_dict())  # torch's own copy casts float64 into the float32 parameter
    out = logits(loaded)  # a model mixing dtypes fails here, at its first matmul
    assert torch.isfinite(out).all()
    assert torch.equal(out, logits(reference))
    as_float64 = DecoderLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert {p.dtype for p in as_float64.parameters()} == {torch.float64}
    assert torch.equal(as_float64.final_norm.weight, model.final_norm.weight)  # no round trip through float32
    assert torch.allclose(logits(as_float64).float(), out, atol=1e-5)


def test_the_dtype_of_most_weights_wins(tmp_path: Path) -> None:
    model = tiny("DecoderLM").to(torch.bfloat16)
    model.final_norm.to(torch.float32)  # a few float32 tensors in a bfloat16 checkpoint
    model.save_pretrained(tmp_path)
    loaded = DecoderLM.from_pretrained(tmp_path)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert torch.equal(loaded.final_norm.weight, model.final_norm.weight.to(torch.bfloat16))
    assert logits(loaded).dtype == torch.bfloat16


def test_device_argument(tmp_path: Path) -> None:
    tiny("EncoderLM").save_pretrained(tmp_path)
    loaded = EncoderLM.from_pretrained(tmp_path, device="cpu")
    assert {p.device for p in loaded.parameters()} == {torch.device("cpu")}
    with pytest.raises(ValueError, match="not a valid torch device"):
        EncoderLM.from_pretrained(tmp_path, device="nonsense")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error(tmp_path: Path) -> None:
    tiny("EncoderLM").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="CUDA is not available"):
        EncoderLM.from_pretrained(tmp_path, device="cuda")


@pytest.mark.gpu
def test_device_cuda(tmp_path: Path) -> None:
    model = tiny("DecoderLM")
    model.save_pretrained(tmp_path)
    loaded = DecoderLM.from_pretrained(tmp_path, device="cuda")
    assert {p.device.type for p in loaded.parameters()} == {"cuda"}
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    assert torch.equal(logits(model.cuda()), logits(loaded))  # same device, same kernels


def test_attention_backend_is_applied(tmp_path: Path) -> None:
    tiny("Seq2SeqTransformer").save_pretrained(tmp_path)
    loaded = Seq2SeqTransformer.from_pretrained(tmp_path, attention_backend="math")
    backends = {m.backend for m in loaded.modules() if isinstance(m, blocks.MultiHeadAttention)}
    assert backends == {"math"}
    assert loaded.config.attention_backend == "math"


def test_bad_arguments_fail_before_reading(tmp_path: Path) -> None:
    missing = tmp_path / "does-not-exist"
    with pytest.raises(ValueError, match="unknown attention_backend 'nope'"):
        DecoderLM.from_pretrained(missing, attention_backend="nope")
    with pytest.raises(ValueError, match="dtype='int8'"):
        DecoderLM.from_pretrained(missing, dtype="int8")
    with pytest.raises(ValueError, match="floating"):
        DecoderLM.from_pretrained(missing, dtype=torch.int64)
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        DecoderLM.from_pretrained(missing)
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        DecoderLM.from_pretrained("./not/a/checkpoint")


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("name", ["EncoderLM", "Seq2SeqTransformer"])
def test_other_architecture_is_refused_naming_both(name: str, tmp_path: Path) -> None:
    tiny(name).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"{name} checkpoint, not a DecoderLM"):
        DecoderLM.from_pretrained(tmp_path)


def test_weights_that_do_not_fit_are_all_listed(tmp_path: Path) -> None:
    model = tiny("DecoderLM")
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    del state["final_norm.weight"]
    state["layers.0.extra.weight"] = torch.zeros(3)
    state["final_norm.bias"] = torch.zeros(7)
    save_file(state, str(path))
    with pytest.raises(ValueError) as err:
        DecoderLM.from_pretrained(tmp_path)
    message = str(err.value)
    assert "missing (1): final_norm.weight" in message
    assert "unexpected (1): layers.0.extra.weight" in message
    assert "final_norm.bias: checkpoint (7,) vs model (32,)" in message


def test_missing_tied_weight_names_its_aliases(tmp_path: Path) -> None:
    tiny("DecoderLM").save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    del state["embed_tokens.weight"]
    save_file(state, str(path))
    with pytest.raises(ValueError, match=r"embed_tokens.weight \(tied with lm_head.weight\)"):
        DecoderLM.from_pretrained(tmp_path)


def test_tied_names_with_different_values_are_refused(tmp_path: Path) -> None:
    tiny("DecoderLM").save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    state["lm_head.weight"] = state["embed_tokens.weight"] + 1
    save_file(state, str(path))
    with pytest.raises(ValueError, match="tied weights embed_tokens.weight and lm_head.weight hold different"):
        DecoderLM.from_pretrained(tmp_path)


def test_one_tensor_for_two_untied_parameters_is_copied() -> None:
    model = tiny("DecoderLM", tie_embeddings=False)
    state = checkpoint_files.unique_state(tiny("DecoderLM", tie_embeddings=False))
    state["lm_head.weight"] = state["embed_tokens.weight"]  # the same tensor object under both names
    auto.load_state_into(model, state)
    assert torch.equal(model.lm_head.weight, model.embed_tokens.weight)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)  # still untied


def test_tied_names_stored_twice_with_equal_values_load(tmp_path: Path) -> None:
    model = tiny("DecoderLM")
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    state["lm_head.weight"] = state["embed_tokens.weight"].clone()
    save_file(state, str(path))
    assert torch.equal(logits(DecoderLM.from_pretrained(tmp_path)), logits(model))


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda data: data[: len(data) // 2],  # truncated
        lambda data: b"",  # empty
        lambda data: b"\x00" * 64 + data[64:],  # header destroyed
    ],
    ids=["truncated", "empty", "garbage-header"],
)
def test_corrupted_safetensors_is_a_clear_error(corrupt, tmp_path: Path) -> None:
    tiny("DecoderLM").save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(ValueError, match="not a valid safetensors file") as err:
        DecoderLM.from_pretrained(tmp_path)
    assert str(path) in str(err.value)


def test_invalid_config_json_is_a_clear_error(tmp_path: Path) -> None:
    tiny("DecoderLM").save_pretrained(tmp_path)
    config = tmp_path / "config.json"
    config.write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        DecoderLM.from_pretrained(tmp_path)
    config.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="neither a transformer-zoo config"):
        DecoderLM.from_pretrained(tmp_path)


def test_config_with_bad_values_is_a_clear_error(tmp_path: Path) -> None:
    tiny("DecoderLM").save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    raw["config"]["d_model"] = -3
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="d_model must be a positive integer, got -3"):
        DecoderLM.from_pretrained(tmp_path)
    raw["config"]["d_model"] = 32
    raw["config"]["colour"] = "blue"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"unknown DecoderLMConfig key\(s\) \['colour'\]"):
        DecoderLM.from_pretrained(tmp_path)


def test_newer_format_version_is_refused(tmp_path: Path) -> None:
    tiny("DecoderLM").save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    raw["format_version"] = 99
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="format_version=99, newer than"):
        DecoderLM.from_pretrained(tmp_path)


def test_unknown_architecture_lists_the_registered_ones(tmp_path: Path) -> None:
    tiny("DecoderLM").save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    raw["architecture"] = "Perceiver"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"unknown architecture 'Perceiver'.*'DecoderLM'"):
        auto.from_pretrained(tmp_path)


def test_missing_files_and_wrong_paths(tmp_path: Path) -> None:
    tiny("DecoderLM").save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="only applies to Hub repos"):
        DecoderLM.from_pretrained(tmp_path / "ckpt", revision="main")
    with pytest.raises(ValueError, match="is a file; expected a checkpoint folder"):
        DecoderLM.from_pretrained(tmp_path / "ckpt" / "model.safetensors")
    (tmp_path / "ckpt" / "model.safetensors").rename(tmp_path / "ckpt" / "model.pt")
    with pytest.raises(FileNotFoundError, match=r"has no weights.*\.pt/\.ckpt are never loaded.*model\.pt"):
        DecoderLM.from_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        DecoderLM.from_pretrained(tmp_path / "ckpt")


# ------------------------------------------------------------------------------------------ pickles
class _Hostile:
    """Unpickling this creates ``marker``: stands for any code a malicious checkpoint could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_hostile_pickle_is_never_executed(tmp_path: Path) -> None:
    model = tiny("DecoderLM")
    model.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    state = {k: v for k, v in model.state_dict().items()}
    state["payload"] = _Hostile(marker)
    torch.save(state, tmp_path / "ckpt" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="refusing to load .*pytorch_model.bin.*could run arbitrary code"):
        DecoderLM.from_pretrained(tmp_path / "ckpt")
    assert not marker.exists()
    # The payload is live: an unrestricted unpickler would have run it.
    torch.load(tmp_path / "ckpt" / "pytorch_model.bin", weights_only=False)
    assert marker.exists()


def test_plain_tensor_pickle_loads_through_weights_only(tmp_path: Path) -> None:
    model = tiny("DecoderLM")
    perturb(model)
    model.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    torch.save(state, tmp_path / "pytorch_model.bin")
    loaded = DecoderLM.from_pretrained(tmp_path)
    assert torch.equal(logits(model), logits(loaded))


def test_pickle_that_is_not_a_flat_state_dict_is_refused(tmp_path: Path) -> None:
    tiny("DecoderLM").save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save([torch.zeros(2)], tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="flat dict of tensor name -> tensor"):
        DecoderLM.from_pretrained(tmp_path)


# ------------------------------------------------------------------------------------------ shards
def _shard(folder: Path, names: list[list[str]], index_map: dict[str, str] | None = None) -> None:
    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    weight_map = {}
    for i, keys in enumerate(names):
        shard = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        save_file({k: state[k] for k in keys}, str(folder / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, shard))
    index = {"metadata": {}, "weight_map": index_map or weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    model = tiny("EncoderLM")
    perturb(model)
    model.save_pretrained(tmp_path)
    keys = sorted(load_file(str(tmp_path / "model.safetensors")))
    _shard(tmp_path, [keys[::2], keys[1::2]])
    loaded = EncoderLM.from_pretrained(tmp_path)
    assert torch.equal(logits(model), logits(loaded))


def test_shard_index_cannot_point_outside_the_folder(tmp_path: Path) -> None:
    tiny("EncoderLM").save_pretrained(tmp_path)
    keys = sorted(load_file(str(tmp_path / "model.safetensors")))
    _shard(tmp_path, [keys], index_map=dict.fromkeys(keys, "../elsewhere.safetensors"))
    with pytest.raises(ValueError, match="weight_map of .* names '../elsewhere.safetensors', which leads outside"):
        EncoderLM.from_pretrained(tmp_path)


def test_shard_index_that_disagrees_with_the_shards_is_refused(tmp_path: Path) -> None:
    tiny("EncoderLM").save_pretrained(tmp_path)
    keys = sorted(load_file(str(tmp_path / "model.safetensors")))
    index_map = dict.fromkeys(keys, "model-00001-of-00001.safetensors")
    index_map["ghost.weight"] = "model-00001-of-00001.safetensors"
    _shard(tmp_path, [keys], index_map=index_map)
    with pytest.raises(ValueError, match=r"lists tensors that no shard holds: \['ghost.weight'\]"):
        EncoderLM.from_pretrained(tmp_path)


# ------------------------------------------------------------------------------------------ atomic saves
def test_interrupted_weight_write_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    old = tiny("DecoderLM")
    old.save_pretrained(tmp_path / "ckpt")
    new = tiny("DecoderLM")
    perturb(new, seed=7)

    def crash(state, path, metadata=None):
        Path(path).write_bytes(b"partial")  # a half-written file, then the disk fills up
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_files, "save_file", crash)
    with pytest.raises(OSError, match="No space left"):
        new.save_pretrained(tmp_path / "ckpt")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # staging folder cleaned up
    loaded = DecoderLM.from_pretrained(tmp_path / "ckpt")
    assert torch.equal(logits(loaded), logits(old))


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_interrupt_during_the_switch_completes_the_new_checkpoint(tmp_path: Path, monkeypatch) -> None:
    old = tiny("Seq2SeqTransformer")
    old.save_pretrained(tmp_path / "ckpt", tokenizer=tiny_tokenizer())
    new = tiny("Seq2SeqTransformer", d_ff=64)  # another shape: mixing files would not load
    perturb(new)
    real_replace, calls = os.replace, []

    def interrupted_replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # after README.md is in place, before the weights and config.json
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", interrupted_replace)
    with pytest.raises(KeyboardInterrupt):
        new.save_pretrained(tmp_path / "ckpt")
    monkeypatch.undo()
    # Past the commit point the save is finished rather than undone: exactly the new checkpoint.
    assert _hidden(tmp_path) == []
    loaded = Seq2SeqTransformer.from_pretrained(tmp_path / "ckpt")
    assert loaded.config == new.config
    assert torch.equal(logits(loaded), logits(new))
    assert loaded.tokenizer is not None  # tokenizer.json is not part of this save: an unrelated file, kept


def test_a_switch_that_keeps_failing_is_finished_by_the_next_load(tmp_path: Path, monkeypatch) -> None:
    old = tiny("DecoderLM")
    old.save_pretrained(tmp_path / "ckpt")
    new = tiny("DecoderLM", d_ff=48)
    real_replace, calls = os.replace, []

    def failing_replace(src, dst):
        calls.append(dst)
        if len(calls) > 1:
            raise OSError(5, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="Input/output error"):
        new.save_pretrained(tmp_path / "ckpt")
    monkeypatch.undo()
    assert [name.rsplit(".", 1)[-1] for name in _hidden(tmp_path)] == ["commit"]
    loaded = DecoderLM.from_pretrained(tmp_path / "ckpt")  # rolls the committed save forward first
    assert loaded.config == new.config
    assert torch.equal(logits(loaded), logits(new))
    assert _hidden(tmp_path) == []


def test_leftovers_of_earlier_versions_are_removed(tmp_path: Path) -> None:
    tiny("DecoderLM").save_pretrained(tmp_path / "ckpt")
    for name in (".ckpt.0123456789ab.saving", ".ckpt.ba9876543210.backup"):  # what the old publish leaked
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / ".other.0123456789ab.saving").mkdir()  # another folder's: not ours to judge here
    DecoderLM.from_pretrained(tmp_path / "ckpt")
    assert _hidden(tmp_path) == [".other.0123456789ab.saving"]


def test_interrupted_first_save_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(checkpoint_files, "write_json", lambda obj, path: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        tiny("EncoderLM").save_pretrained(tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_resave_keeps_unrelated_files(tmp_path: Path) -> None:
    tiny("DecoderLM").save_pretrained(tmp_path)
    (tmp_path / "training_log.txt").write_text("step 1")
    model = tiny("DecoderLM")
    perturb(model)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "training_log.txt").read_text() == "step 1"
    assert torch.equal(logits(DecoderLM.from_pretrained(tmp_path)), logits(model))


def test_save_to_a_file_path_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="exists and is not a folder"):
        tiny("DecoderLM").save_pretrained(tmp_path / "file")
    with pytest.raises(TypeError, match="save_directory must be a folder path"):
        tiny("DecoderLM").save_pretrained(42)


# ------------------------------------------------------------------------------------------ tokenizer, card
def test_tokenizer_is_saved_and_attached(tmp_path: Path) -> None:
    raw = tiny_tokenizer()
    tiny("DecoderLM").save_pretrained(tmp_path / "a", tokenizer=raw)
    assert (tmp_path / "a" / "tokenizer.json").is_file()
    assert "Tokenizer: included" in (tmp_path / "a" / "README.md").read_text()
    loaded = DecoderLM.from_pretrained(tmp_path / "a")
    assert isinstance(loaded.tokenizer, tokenization.Tokenizer)
    assert loaded.tokenizer.encode("hello zoo world") == raw.encode("hello zoo world").ids == [2, 4, 3]
    # The attached tokenizer travels with the model on the next save.
    loaded.save_pretrained(tmp_path / "b")
    assert DecoderLM.from_pretrained(tmp_path / "b").tokenizer.encode("zoo") == [4]
    tiny("DecoderLM").save_pretrained(tmp_path / "c")
    assert DecoderLM.from_pretrained(tmp_path / "c").tokenizer is None


def test_tokenizer_special_token_roles_survive(tmp_path: Path) -> None:
    tok = tokenization.Tokenizer(tiny_tokenizer(), special_tokens={"mask": "zoo", "pad": "[PAD]"})
    tiny("EncoderLM").save_pretrained(tmp_path, tokenizer=tok)
    loaded = EncoderLM.from_pretrained(tmp_path)
    assert loaded.tokenizer.mask_token_id == 4
    assert loaded.tokenizer.pad_token_id == 1


def test_tokenizer_without_save_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="tokenizer must have a save"):
        tiny("DecoderLM").save_pretrained(tmp_path, tokenizer={"hello": 1})
    assert not tmp_path.joinpath("config.json").exists()


def test_corrupted_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    tiny("DecoderLM").save_pretrained(tmp_path, tokenizer=tiny_tokenizer())
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json' is not a valid tokenizer.json"):
        DecoderLM.from_pretrained(tmp_path)


def test_model_card(tmp_path: Path) -> None:
    model = tiny("EncoderLM")
    model.save_pretrained(tmp_path / "ckpt")
    card = ModelCard.load(tmp_path / "ckpt" / "README.md")
    assert "Tokenizer: not included" in card.text
    assert "from models import EncoderLM" in card.text
    assert card.data.library_name == "transformer-zoo"
    assert "EncoderLM" in card.data.tags
    assert f"{model.num_parameters():,}" in card.text
    assert f'EncoderLM.from_pretrained("{tmp_path / "ckpt"}")' in card.text
    for key, value in model.config.to_dict().items():
        assert f"| `{key}` | `{value!r}` |" in card.text


# ------------------------------------------------------------------------------------------ registry
def test_registered_subclass_loads_as_itself(tmp_path: Path) -> None:
    @auto.register_architecture
    class PersistenceTestLM(DecoderLM):
        """A DecoderLM variant defined by a test."""

    assert auto.get_architecture("PersistenceTestLM") is PersistenceTestLM
    model = PersistenceTestLM(tiny("DecoderLM").config).eval()
    model.save_pretrained(tmp_path)
    loaded = auto.from_pretrained(tmp_path)
    assert type(loaded) is PersistenceTestLM
    assert torch.equal(logits(model), logits(loaded))
    with pytest.raises(ValueError, match="PersistenceTestLM checkpoint, not a DecoderLM"):
        DecoderLM.from_pretrained(tmp_path)


def test_two_classes_cannot_share_a_name() -> None:
    with pytest.raises(ValueError, match="'DecoderLM' is already registered by models.decoder_lm.DecoderLM"):
        auto.register_architecture(type("DecoderLM", (DecoderLM,), {"__module__": "somewhere.else"}))
    assert auto.get_architecture("DecoderLM") is DecoderLM
    assert {"DecoderLM", "EncoderLM", "Seq2SeqTransformer"} <= set(auto.architectures())


# ------------------------------------------------------------------------------------------ transformers configs
def _fake_convert(monkeypatch, allow_missing: frozenset[str]) -> None:
    """A stand-in for models.convert.from_transformers (written elsewhere) honouring its contract, to test how the
    loader uses it."""

    def from_transformers(hf_config: dict, state_dict: dict):
        config = DecoderLM.preset_config("tiny", vocab_size=hf_config["vocab_size"], d_model=32, n_layers=1)
        renamed = {k.removeprefix("transformer."): v for k, v in state_dict.items()}
        return types.SimpleNamespace(
            architecture=DecoderLM, config=config, state_dict=renamed, allow_missing=allow_missing
        )

    monkeypatch.setattr(converter_registry, "from_transformers", from_transformers)


def _transformers_folder(folder: Path, drop: str | None = None) -> DecoderLM:
    model = tiny("DecoderLM")
    perturb(model)
    folder.mkdir()
    state = {f"transformer.{k}": v for k, v in checkpoint_files.unique_state(model).items() if k != drop}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "toy", "vocab_size": 100}))
    return model


def test_transformers_checkpoint_goes_through_the_converter(tmp_path: Path, monkeypatch) -> None:
    _fake_convert(monkeypatch, frozenset())
    model = _transformers_folder(tmp_path / "hf")
    loaded = zoo.auto.from_pretrained(tmp_path / "hf")
    assert type(loaded) is DecoderLM
    assert torch.equal(logits(model), logits(loaded))
    with pytest.raises(ValueError, match="converts to DecoderLM, not EncoderLM"):
        EncoderLM.from_pretrained(tmp_path / "hf")


def test_converter_allow_missing_keeps_init_and_warns(tmp_path: Path, monkeypatch, caplog) -> None:
    _fake_convert(monkeypatch, frozenset({"final_norm.bias"}))
    _transformers_folder(tmp_path / "hf", drop="final_norm.bias")
    with caplog.at_level(logging.WARNING, logger="models.checkpoints.loading"):
        loaded = DecoderLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(loaded.final_norm.bias, torch.zeros(32))  # the fresh initialisation
    assert "final_norm.bias" in caplog.text
    _fake_convert(monkeypatch, frozenset())
    with pytest.raises(ValueError, match=r"missing \(1\): final_norm.bias"):
        DecoderLM.from_pretrained(tmp_path / "hf")


# ------------------------------------------------------------------------------------------ options, GGUF, imports
def test_load_options_are_stated_once(tmp_path: Path) -> None:
    tiny("DecoderLM").save_pretrained(tmp_path)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['revison'\]; it takes \[.*'revision'"):
        DecoderLM.from_pretrained(tmp_path, revison="main")
    with pytest.raises(TypeError, match="unexpected keyword"):
        zoo.from_pretrained(tmp_path, torch_dtype=torch.float16)
    with pytest.raises(TypeError, match="positional argument"):
        DecoderLM.from_pretrained(tmp_path, "main")
    with pytest.raises(TypeError, match="token must be a string, a bool or None"):
        DecoderLM.from_pretrained(tmp_path, token=123)
    # One list of names everywhere: the TypedDict the three entry points unpack.
    assert set(auto.LoadOptions.__annotations__) == {
        "revision", "device", "dtype", "attention_backend", "token", "endpoint", "gguf_file", "head", "num_labels",
        "id2label", "head_options", "dequantize",
    }


def test_no_import_cycle_between_auto_persistence_and_gguf() -> None:
    import ast

    def imported(module: str) -> set[str]:
        tree = ast.parse(Path(zoo.__file__).parent.joinpath(*module.split(".")).with_suffix(".py").read_text())
        return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}

    # auto -> checkpoints.loading <- gguf (which registers its file format there), persistence -> loading: one way.
    assert "persistence" not in imported("auto") and "checkpoints.persistence" not in imported("auto")
    assert not {m for m in imported("checkpoints.persistence") if "auto" in m}
    assert not {m for m in imported("checkpoints.files") if "auto" in m or "persistence" in m}
    assert not {m for m in imported("gguf.__init__") | imported("gguf.read") if "auto" in m}
    assert not {m for m in imported("checkpoints.loading") if "gguf" in m or "auto" in m}
    assert "loading" in imported("checkpoints.persistence")


def _fake_gguf(monkeypatch, calls: list) -> object:
    """A stand-in for models.gguf.read_gguf (written elsewhere) honouring its contract:
    read_gguf(path, dtype=None, keep_packed=False) -> (transformers config dict, state dict under transformers names,
    tokenizer)."""
    model = tiny("DecoderLM")
    perturb(model)
    tokenizer = object()

    def read_gguf(path, dtype=None, keep_packed=False):
        calls.append((Path(path), dtype))
        state = {f"transformer.{k}": v.to(dtype or v.dtype) for k, v in checkpoint_files.unique_state(model).items()}
        return {"model_type": "toy", "vocab_size": 100}, state, tokenizer

    monkeypatch.setattr(zoo_gguf, "read_gguf", read_gguf)
    return model, tokenizer


def test_gguf_file_goes_through_read_gguf_and_the_converter(tmp_path: Path, monkeypatch) -> None:
    _fake_convert(monkeypatch, frozenset())
    calls: list = []
    model, tokenizer = _fake_gguf(monkeypatch, calls)
    path = tmp_path / "model.Q8_0.gguf"
    path.write_bytes(b"GGUF")
    loaded = zoo.from_pretrained(str(path))
    assert type(loaded) is DecoderLM and loaded.tokenizer is tokenizer
    assert torch.equal(logits(loaded), logits(model))
    half = DecoderLM.from_pretrained(path, dtype="bfloat16")
    assert calls == [(path, None), (path, torch.bfloat16)]
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="converts to DecoderLM, not EncoderLM"):
        EncoderLM.from_pretrained(path)
    with pytest.raises(ValueError, match="revision='v1' only applies to Hub repos"):
        zoo.from_pretrained(path, revision="v1")
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        zoo.from_pretrained(tmp_path / "absent.gguf")
    monkeypatch.setattr(zoo_gguf, "read_gguf", real_read_gguf)
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if the optional gguf package were missing
    with pytest.raises(ImportError, match=r"needs models.gguf and the gguf package"):
        zoo.from_pretrained(path)
