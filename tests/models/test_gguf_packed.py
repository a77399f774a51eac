"""GGUF files load quantized: every block format stays packed (``blocks.quantized.ggml``), its unpacked weights are
the ``gguf`` package's dequantized values bit for bit, its greedy tokens are those of the same file loaded as
float32, it saves and loads back bit-identical, and a GGUF export writes the file's blocks unchanged (read back
with ``gguf``'s own ``GGUFReader``)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

import models
from blocks.quantized import QuantizedEmbedding, QuantizedLinear, quantized_modules, scheme_of
from models.generation import compiled
from tests.models.test_gguf_families import llama_cpp_permute, metadata

Q = gguf.GGMLQuantizationType
#: types the gguf package quantizes (written from float weights) and K-quants (random valid blocks).
QUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
# Byte offsets of the float16 scales in a K-quant block (the rest of a block is any bytes).
_K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def tiny_llama(hidden: int, tie: bool = True) -> transformers.PreTrainedModel:
    """A llama at sizes away from the defaults; ``hidden`` and the FFN width are multiples of the block size."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=96, rms_norm_eps=1e-5, tie_word_embeddings=tie)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 5000.0}
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def random_blocks(qtype: str, data: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks of a K-quant for a float array's shape (the gguf package has no K-quant quantizer)."""
    block, size = gguf.GGML_QUANT_SIZES[Q[qtype]]
    rows, cols = data.shape
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in _K_SCALES[qtype]:
        scales = rng.uniform(1e-3, 2e-2, size=(rows, cols // block)).astype(np.float16)
        raw[..., offset:offset + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def write_llama(path: Path, model, types: dict[str, str] | str, seed: int = 0) -> Path:
    """The model as llama.cpp's converter writes it, every 2-d tensor (the embedding too) in a block format:
    ``types`` is one type or a map from a tensor-name fragment to its type (the first that matches)."""
    rng = np.random.default_rng(seed)
    c = model.config
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), "llama")
    metadata(writer, "llama", "llama", c)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = name_map.get_name(base) + "." + suffix
        data = t.float().numpy().copy()
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            data = llama_cpp_permute(data, c.num_attention_heads if "attn_q" in name else c.num_key_value_heads)
        qtype = types if isinstance(types, str) else next(v for k, v in types.items() if k in name)
        if data.ndim == 2:
            raw = random_blocks(qtype, data, rng) if qtype in K_QUANTS else gguf.quants.quantize(data, Q[qtype])
            writer.add_tensor(name, raw, raw_dtype=Q[qtype])
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


IDS = torch.tensor([[5, 17, 3, 90, 42, 7, 11, 64, 2, 8]])


@pytest.mark.parametrize("qtype", QUANTIZED + K_QUANTS)
def test_each_block_format_loads_packed_and_decodes_as_the_float_file(tmp_path, qtype):
    hidden = 256 if qtype in K_QUANTS else 96  # a whole number of blocks, not a power of two for the 32-blocks
    path = write_llama(tmp_path / f"m-{qtype}.gguf", tiny_llama(hidden), qtype)
    packed = models.from_pretrained(path)
    floats = models.from_pretrained(path, dequantize=True)
    scheme = qtype.lower()
    layers = quantized_modules(packed)
    # Every 2-d weight is packed, the embedding too, and the tied head is the embedding's own packed table.
    assert set(layers.values()) == {scheme} and len(layers) == 2 * 7 + 2
    assert isinstance(packed.embed_tokens, QuantizedEmbedding) and packed.lm_head is packed.embed_tokens.table
    assert not any(p.numel() >= 96 * hidden for p in packed.parameters())  # no float copy of a weight
    # Unpacked: the values of gguf.quants.dequantize (the float load decodes with it), bit for bit.
    for name in layers:
        layer = packed.get_submodule(name)
        table = layer.table if isinstance(layer, QuantizedEmbedding) else layer
        assert torch.equal(table.unpack(), floats.get_submodule(name).weight), name
    # The packed model computes the float model's function (float32 rounding apart) and its greedy tokens.
    with torch.no_grad():
        assert torch.allclose(packed(IDS).logits, floats(IDS).logits, rtol=1e-4, atol=1e-4)
        expected = floats.generate(IDS, max_new_tokens=32, eos_token_id=None)
        assert torch.equal(packed.generate(IDS, max_new_tokens=32, eos_token_id=None), expected)
    # It reads the file's bytes, not four per weight: the packed tensors are the size of the file's blocks.
    blocks_in_file = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if t.tensor_type == Q[qtype])
    held = sum(m.nbytes() for m in {id(m): m for m in packed.modules() if isinstance(m, QuantizedLinear)}.values())
    assert blocks_in_file <= held <= blocks_in_file * 1.07  # float16 block scales may be held apart from the blocks


def test_compiled_decoding_of_a_packed_model_equals_eager(tmp_path, graph_backend):
    path = write_llama(tmp_path / "m.gguf", tiny_llama(64), {"attn": "Q4_0", "ffn": "Q5_1", "": "Q8_0"})
    model = models.from_pretrained(path)
    assert set(quantized_modules(model).values()) == {"q4_0", "q5_1", "q8_0"}
    with torch.no_grad():
        eager = model.generate(IDS, max_new_tokens=12, eos_token_id=None)
        assert torch.equal(model.generate(IDS, max_new_tokens=12, eos_token_id=None, compile=True), eager)


def test_inductor_compiled_packed_decoding_equals_eager_by_step_logits(tmp_path):
    path = write_llama(tmp_path / "m.gguf", tiny_llama(64), "Q4_0")
    model = models.from_pretrained(path)
    assert compiled.BACKEND == "inductor"
    with torch.no_grad():
        tokens = model.generate(IDS, max_new_tokens=6, eos_token_id=None)
        assert torch.equal(model.generate(IDS, max_new_tokens=6, eos_token_id=None, compile=True), tokens)
        # A forward of 1 and 4 rows compiled by inductor (the packed weights unpacked inside the product's loop)
        # against eager (chunks unpacked, then BLAS).
        forward = torch.compile(lambda ids: model(ids).logits, backend="inductor", dynamic=False)
        for rows in (tokens[:, -1:], tokens[:, -4:]):
            assert torch.allclose(forward(rows), model(rows).logits, rtol=1e-4, atol=1e-5)


def test_mixed_formats_save_and_load_back_bit_identical(tmp_path):
    path = write_llama(tmp_path / "m.gguf", tiny_llama(256, tie=False),
                       {"token_embd": "Q6_K", "output": "Q6_K", "attn_v": "Q5_K", "": "Q4_K"})
    model = models.from_pretrained(path)
    folder = model.save_pretrained(tmp_path / "saved")
    entry = json.loads((Path(folder) / "config.json").read_text())["quantization"]
    assert entry["modules"]["embed_tokens"] == "q6_k" and entry["modules"]["lm_head"] == "q6_k"
    assert entry["modules"]["layers.1.self_attn.v_proj"] == "q5_k"
    assert entry["modules"]["layers.0.ffn.up_proj"] == "q4_k"
    loaded = models.from_pretrained(folder)
    assert quantized_modules(loaded) == quantized_modules(model)
    before, after = model.state_dict(), loaded.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_K"])
def test_gguf_export_writes_the_blocks_it_loaded_unchanged(tmp_path, qtype):
    hidden = 256 if qtype in K_QUANTS else 64
    source = write_llama(tmp_path / "in.gguf", tiny_llama(hidden), qtype)
    model = models.from_pretrained(source)
    out = model.save_gguf(tmp_path / "out.gguf", "F32")  # dtype is for float tensors: the blocks are kept
    original = {t.name: t for t in gguf.GGUFReader(source).tensors}
    written = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert set(original) <= set(written)
    for name, tensor in original.items():
        assert written[name].tensor_type == tensor.tensor_type, name
        assert np.array_equal(np.asarray(written[name].data), np.asarray(tensor.data)), name
    reloaded = models.from_pretrained(out)
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, model(IDS).logits)


def test_a_float_file_and_dequantize_load_float_layers(tmp_path):
    path = write_llama(tmp_path / "m.gguf", tiny_llama(64), "Q8_0")
    model = models.from_pretrained(path, dequantize=True)
    assert not quantized_modules(model) and isinstance(model.embed_tokens, torch.nn.Embedding)
    with pytest.raises(TypeError, match="dequantize must be True or False, got str 'yes'"):
        models.from_pretrained(path, dequantize="yes")
    packed = models.from_pretrained(path)
    assert scheme_of(packed.layers[0].ffn.down_proj) == "q8_0"
    # model.dequantize() gives the float model back, the tie kept.
    packed.dequantize()
    assert not quantized_modules(packed) and packed.lm_head.weight is packed.embed_tokens.weight
    assert torch.equal(packed.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize("qtype", ["Q5_1", "Q6_K"])
def test_tensors_read_in_chunks_of_a_few_rows_are_the_whole_tensors(tmp_path, qtype, monkeypatch):
    """``read_state`` reads whole rows a chunk at a time and splits them as they come: with chunks of 3 rows (the
    last one short) the packed tensors, the llama q/k rows put back in order included, unpack as gguf decodes."""
    from models.gguf import packed as gguf_packed

    hidden = 256 if qtype in K_QUANTS else 96
    path = write_llama(tmp_path / f"m-{qtype}.gguf", tiny_llama(hidden), qtype)
    floats = models.from_pretrained(path, dequantize=True)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    row_bytes = int(tensors["blk.0.attn_q.weight"].n_bytes) // int(tensors["blk.0.attn_q.weight"].shape[-1])
    reads = []
    original = gguf_packed.read_state

    def counting(*args, **kwargs):
        reads.append(args[1].name)
        return original(*args, **kwargs)

    monkeypatch.setattr(gguf_packed, "CHUNK_BYTES", 3 * row_bytes)
    monkeypatch.setattr(gguf_packed, "read_state", counting)
    packed = models.from_pretrained(path)
    assert "blk.0.attn_q.weight" in reads
    for name in quantized_modules(packed):
        layer = packed.get_submodule(name)
        table = layer.table if isinstance(layer, QuantizedEmbedding) else layer
        assert torch.equal(table.unpack(), floats.get_submodule(name).weight), name
