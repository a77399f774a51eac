"""``save_gguf``: zoo models of every GGUF family written with ``gguf``'s writer and quantizers, read back by the zoo
(bit-identical for F32, within the quantizer's error otherwise) and by ``transformers``' GGUF loader (logits within
1e-4 and the same greedy tokens), with their tokenizer; written atomically."""

from __future__ import annotations

import gguf
import pytest
import torch
from tokenizers import AddedToken

import models
from models.convert import from_transformers
from models.gguf import read_gguf, read_gguf_tokenizer
from models.gguf.export import EXPORT_TYPES
from tests.models.test_gguf_families import FAMILIES, IDS, QUANT, tiny, transformers_from
from tests.tokenization.test_gguf_pretokenizers import TEXTS
from tokenization import train_byte_level_bpe

VOCAB = 300
# Bound of |w - dequantize(quantize(w))| per type, as a fraction of the tensor's largest |w|.
ERROR = {"Q8_0": 1 / 127, "Q4_0": 1 / 7, "Q4_1": 2 / 15, "Q5_0": 1 / 15, "Q5_1": 2 / 31, "F16": 2 ** -10,
         "BF16": 2 ** -7}


@pytest.fixture(scope="module")
def tokenizer():
    corpus = [t for t in TEXTS if "<|" not in t] * 4 + ["the quick brown fox jumps over the lazy dog"] * 4
    tok = train_byte_level_bpe(corpus, vocab_size=VOCAB, special_tokens={"bos": "<|bos|>", "eos": "<|eos|>"})
    extra = [AddedToken(f"<extra_{i}>", normalized=False) for i in range(VOCAB - tok.vocab_size)]
    tok.backend.add_tokens(extra)  # as many ids as the embedding has rows, as a GGUF vocabulary needs
    assert tok.vocab_size == VOCAB
    return tok


@pytest.fixture(scope="module")
def zoo_models(tokenizer):
    out = {}
    for family in FAMILIES:
        hf = tiny(family, VOCAB)
        converted = from_transformers(hf.config.to_dict(), hf.state_dict())
        model = converted.architecture(converted.config)
        model.load_state_dict(converted.state_dict, strict=False)
        model.tokenizer = tokenizer
        out[family] = model.eval()
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_f32_export_round_trips_and_runs_in_transformers(tmp_path, zoo_models, tokenizer, family):
    model = zoo_models[family]
    path = model.save_gguf(tmp_path / "m.gguf")
    back = models.from_pretrained(path)
    for name, tensor in model.state_dict().items():
        want = (tensor + 1) - 1 if family == "gemma2" and "norm" in name else tensor  # Gemma's 1 + w in float32
        assert torch.equal(back.state_dict()[name], want), name
    reference = transformers_from(path)
    prompt = IDS[:, :6]
    with torch.no_grad():
        torch.testing.assert_close(reference(IDS).logits, model(IDS).logits, atol=1e-4, rtol=0)
        ours = model.generate(prompt, max_new_tokens=6, eos_token_id=None)
        theirs = reference.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours.tolist() == theirs.tolist()
    # the tokenizer travels with the model
    for text in TEXTS:
        assert back.tokenizer.encode(text) == tokenizer.encode(text), text


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_quantized_export_within_the_quantizer_error(tmp_path, zoo_models, family):
    dtype = QUANT[family].name
    path = zoo_models[family].save_gguf(tmp_path / "q.gguf", dtype)
    ours = read_gguf(path)[1]
    theirs = transformers_from(path).state_dict()
    reference = read_gguf(zoo_models[family].save_gguf(tmp_path / "f.gguf"))[1]
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
        exact = reference[name]
        bound = ERROR[dtype] * exact.abs().max() if tensor.ndim == 2 else 0.0
        assert (tensor - exact).abs().max() <= bound + 1e-7, name
    assert QUANT[family] in {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}


def test_gguf_tokenizer_metadata_is_written_back(tmp_path, zoo_models):
    model = zoo_models["llama"]
    path = model.save_gguf(tmp_path / "a.gguf")
    tok = read_gguf_tokenizer(path)
    tok.metadata["tokenizer.chat_template"] = "{{ messages }}"
    again = read_gguf_tokenizer(model.save_gguf(tmp_path / "b.gguf", tokenizer=tok))
    assert again.chat_template == "{{ messages }}" and again.pre == "gpt-2"
    assert again.encode("hello world") == tok.encode("hello world")


def test_refusals_and_atomic_replace(tmp_path, zoo_models, monkeypatch):
    model = zoo_models["qwen2"]
    with pytest.raises(ValueError, match="dtype='Q4_K'"):
        model.save_gguf(tmp_path / "x.gguf", "Q4_K")
    assert "Q4_K" not in EXPORT_TYPES
    with pytest.raises(ValueError, match="path="):
        model.save_gguf(tmp_path / "x.bin")
    path = model.save_gguf(tmp_path / "m.gguf")
    before = path.read_bytes()

    def crash(self):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", crash)
    with pytest.raises(OSError, match="disk full"):
        model.save_gguf(path, "Q8_0")
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_sliding_window_llama_cpp_cannot_run_is_refused(tmp_path):
    hf = tiny("mistral")
    hf.config.sliding_window = 16
    converted = from_transformers(hf.config.to_dict(), hf.state_dict())
    model = converted.architecture(converted.config)
    with pytest.raises(ValueError, match="sliding_window=16"):
        model.save_gguf(tmp_path / "w.gguf")
    assert not list(tmp_path.iterdir())


def test_demo_model_and_lora_merged_model_export(tmp_path, tokenizer):
    """The demo's GPT-style DecoderLM (``examples/generate.py``'s preset) with its byte-level tokenizer, and a model
    whose LoRA adapter was merged, run the same in transformers; an unmerged adapter is refused. (max_len 1024 and
    d_ff = 4 d_model: transformers' GGUF loader reads neither for GPT-2.)"""
    from models import DecoderLM

    torch.manual_seed(0)
    demo = DecoderLM.from_preset("tiny", vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, d_ff=256, max_len=1024,
                                 dropout=0.0, bos_token_id=tokenizer.bos_token_id,
                                 eos_token_id=tokenizer.eos_token_id).eval()
    demo.tokenizer = tokenizer
    path = demo.save_gguf(tmp_path / "demo.gguf", "F32")
    with torch.no_grad():
        torch.testing.assert_close(transformers_from(path)(IDS).logits, demo(IDS).logits, atol=1e-4, rtol=0)
    assert read_gguf_tokenizer(path).encode("hello world") == tokenizer.encode("hello world")

    demo.add_adapter("lora", target_modules="all-linear", r=4)
    with torch.no_grad():
        for name, p in demo.named_parameters():
            if "lora" in name:
                p.normal_(0, 0.05)
    with pytest.raises(ValueError, match="(?i)adapter|lora"):
        demo.save_gguf(tmp_path / "unmerged.gguf")
    merged = demo.merge_and_unload()
    path = merged.save_gguf(tmp_path / "merged.gguf")
    with torch.no_grad():
        torch.testing.assert_close(models.from_pretrained(path)(IDS).logits, merged(IDS).logits, atol=0, rtol=0)
        torch.testing.assert_close(transformers_from(path)(IDS).logits, merged(IDS).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family, rope", [
    ("llama", {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 8.0, "original_max_position_embeddings": 128}),
    ("llama", {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}),
    ("phi3", {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5}),
])
def test_rope_settings_survive_the_round_trip(tmp_path, family, rope):
    """Llama 3.1 scaling (written as llama.cpp's rope_freqs tensor), linear scaling and Phi-3's partial rotary;
    partial rotary under another architecture is refused (only phi3's GGUF states a rotary size apart)."""
    hf = tiny(family, VOCAB)
    hf.config.rope_parameters = rope
    hf = type(hf)(hf.config).eval()
    converted = from_transformers(hf.config.to_dict(), hf.state_dict())
    model = converted.architecture(converted.config).eval()
    model.load_state_dict(converted.state_dict, strict=False)
    path = model.save_gguf(tmp_path / "r.gguf", model_type=family)
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert ("rope_freqs.weight" in names) == (rope["rope_type"] == "llama3")
    back = models.from_pretrained(path)
    ids = torch.arange(40).reshape(1, 40) % VOCAB
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=1e-4, rtol=0)
    if family == "phi3":
        with pytest.raises(ValueError, match="partial_rotary_factor=0.5.*model_type='phi3'"):
            model.save_gguf(tmp_path / "l.gguf", model_type="llama")
