"""GGUF loading (``models.gguf.read_gguf``): files written with ``gguf``'s own ``GGUFWriter`` from random tiny
``transformers`` Llama models, the way llama.cpp's ``convert_hf_to_gguf.py`` writes them, compared with the
original model, with ``transformers``' GGUF loader and with the ggml block formats decoded by hand."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import accelerate  # noqa: E402, F401  (transformers' GGUF loader needs it; a dev dependency: missing fails)
import gguf  # noqa: E402
import numpy as np
import pytest
import torch
import transformers  # noqa: E402

from models.gguf import SUPPORTED_TYPES, read_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType

# GGUF name -> transformers name of one layer's tensors (llama.cpp's convert_hf_to_gguf mapping).
LAYER = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}

TEXTS = ["hello world", "the weather is nice", "two  spaces\nand a line  ", "ünïcödé ✓ 123456", ""]


# --------------------------------------------------------------------------------------------- writing files
def tiny_llama(**overrides) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=None,
    )
    cfg.update(overrides)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    with torch.no_grad():  # norms away from 1, so a norm loaded in the wrong place shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``convert_hf_to_gguf.LlamaModel.permute``: rotate-half rows to llama.cpp's interleaved layout."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(qtype: Q, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Valid random ggml blocks for a type ``gguf`` cannot quantize: random bytes, finite fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(shape[0], shape[1] // block, size), dtype=np.uint8)
    # byte offsets of each type's fp16 scales (ggml-common.h's block_q*_K structs)
    offsets = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,)}[qtype]
    for off in offsets:
        scale = rng.uniform(0.001, 0.02, size=data.shape[:2]).astype(np.float16)
        data[..., off:off + 2] = scale.view(np.uint8).reshape(*data.shape[:2], 2)
    return data.reshape(shape[0], -1)


def encode(values: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    if qtype in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL):
        return random_blocks(qtype, values.shape, rng)
    return gguf.quants.quantize(values.astype(np.float32), qtype)


def write_gguf(
    path: Path,
    model: transformers.LlamaForCausalLM,
    *,
    qtype: Q = Q.F32,
    vocab: str | None = "spm",
    arch: str = "llama",
    rope_freqs: np.ndarray | None = None,
    metadata: list[tuple[str, str, object]] | None = None,
) -> Path:
    """Write ``model`` as llama.cpp's converter does: 2-D weights in ``qtype``, norms in F32, q/k permuted."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    if vocab == "spm":
        add_spm_vocab(writer, cfg.vocab_size)
    elif vocab == "bpe":
        add_bpe_vocab(writer, cfg.vocab_size)
    for method, key, value in metadata or ():
        getattr(writer, method)(key, value)

    rng = np.random.default_rng(0)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    for i in range(cfg.num_hidden_layers):
        names.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight" for g, hf in LAYER.items()})
        names.update({f"model.layers.{i}.{hf}.bias": f"blk.{i}.{g}.bias" for g, hf in LAYER.items()})
    state = model.state_dict()
    names = {hf: g for hf, g in names.items() if hf in state}
    for hf_name, gguf_name in names.items():
        w = state[hf_name].numpy()
        if ".attn_q." in gguf_name:
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif ".attn_k." in gguf_name:
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        if w.ndim == 1 or qtype == Q.F32:
            writer.add_tensor(gguf_name, w.astype(np.float32))
        elif qtype == Q.F16:
            writer.add_tensor(gguf_name, w.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, encode(w, qtype, rng), raw_dtype=qtype)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def spm_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte tokens, then scored pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = ["\u2581", *"abcdefghijklmnopqrstuvwxyz", "\u2581t", "he", "\u2581the", "\u2581w", "or", "ld", "\u2581wor",
              "\u2581world", "ll", "\u2581he", "\u2581hell", "\u2581hello", "\u2581n", "ic", "ice", "\u2581nice"]
    pieces = [p for p in dict.fromkeys(pieces)][: size - len(tokens)]
    tokens += pieces
    types += [1] * len(pieces)
    # later pieces score lower (SentencePiece orders pieces by score); the specials and bytes score 0
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    while len(tokens) < size:  # pad to the embedding size with unused tokens, as real vocabularies do
        tokens.append(f"<unused{len(tokens)}>")
        types.append(5)
        scores.append(-1e4)
    return tokens, scores, types


def add_spm_vocab(writer, size: int) -> None:
    tokens, scores, types = spm_vocab(size)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)


def bpe_tokenizer(size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size, special_tokens=["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    corpus = ["hello world, the weather is nice today", "two spaces and a line", "numbers 123456 and 7890"] * 20
    tok.train_from_iterator(corpus, trainer)
    return tok


def add_bpe_vocab(writer, size: int) -> None:
    import json

    model = json.loads(bpe_tokenizer(size).to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    assert len(tokens) <= size
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)


def hf_from_gguf(path: Path) -> transformers.LlamaForCausalLM:
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()


@pytest.fixture(scope="module")
def model() -> transformers.LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory, model) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "f32.gguf", model)


# --------------------------------------------------------------------------------------------- config and tensors
def test_config_matches_transformers_and_the_model(f32_file, model):
    config, _, _ = read_gguf(f32_file)
    hf = transformers.AutoConfig.from_pretrained(str(f32_file.parent), gguf_file=f32_file.name)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "max_position_embeddings", "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert config[key] == getattr(hf, key) == getattr(model.config, key), key
    assert config["rms_norm_eps"] == hf.rms_norm_eps == pytest.approx(1e-5)  # float32 in the file
    assert config["rope_theta"] == hf.rope_parameters["rope_theta"] == 10000.0
    assert config["model_type"] == "llama" and config["pad_token_id"] is None
    assert "head_dim" not in config and "rope_scaling" not in config


def test_f32_tensors_are_the_original_with_q_k_unpermuted(f32_file, model):
    _, state, _ = read_gguf(f32_file)
    reference = model.state_dict()
    assert sorted(state) == sorted(reference)
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, reference[name]), name
    # and transformers' loader agrees
    hf_state = hf_from_gguf(f32_file).state_dict()
    for name, tensor in state.items():
        assert torch.equal(tensor, hf_state[name]), name


def test_f16_exact_and_dtype_request(tmp_path, model):
    path = write_gguf(tmp_path / "f16.gguf", model, qtype=Q.F16)
    _, state, _ = read_gguf(path)
    _, half, _ = read_gguf(path, dtype="float16")
    _, bf16, _ = read_gguf(path, dtype=torch.bfloat16)
    for name, original in model.state_dict().items():
        expected = original if original.ndim == 1 else original.half().float()  # norms stay F32
        assert torch.equal(state[name], expected), name
        assert half[name].dtype == torch.float16 and torch.equal(half[name], expected.half())
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], expected.bfloat16())


def test_biases(tmp_path):
    model = tiny_llama(attention_bias=True, mlp_bias=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    config, state, _ = read_gguf(write_gguf(tmp_path / "bias.gguf", model, vocab=None))
    assert config["attention_bias"] is True and config["mlp_bias"] is True
    reference = model.state_dict()
    assert sorted(state) == sorted(reference)
    for name, tensor in state.items():
        assert torch.equal(tensor, reference[name]), name  # q/k biases unpermuted too


def test_tied_embeddings_and_head_dim(tmp_path):
    model = tiny_llama(tie_word_embeddings=True, head_dim=32)  # 4 heads of 32 on d_model 64
    path = write_gguf(tmp_path / "tied.gguf", model)
    config, state, _ = read_gguf(path)
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in state
    assert config["head_dim"] == 32
    reference = model.state_dict()
    for name, tensor in state.items():
        assert torch.equal(tensor, reference[name]), name
    hf = hf_from_gguf(path)
    assert hf.config.head_dim == 32 and hf.config.tie_word_embeddings


# Every supported block type against transformers' loader; the K-quants need rows of 256 values.
QUANTIZED = [t for t in SUPPORTED_TYPES if t not in ("F32", "F16")]


@pytest.fixture(scope="module")
def wide_model() -> transformers.LlamaForCausalLM:
    return tiny_llama(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2)


@pytest.mark.parametrize("type_name", QUANTIZED)
def test_dequantized_equals_transformers(tmp_path, wide_model, type_name):
    path = write_gguf(tmp_path / f"{type_name}.gguf", wide_model, qtype=Q[type_name], vocab=None)
    _, state, _ = read_gguf(path)
    hf_state = hf_from_gguf(path).state_dict()
    assert sorted(state) == sorted(hf_state)
    for name, tensor in state.items():
        assert torch.equal(tensor, hf_state[name].float()), name
    if type_name in ("BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):  # written by quantizing the model
        bits = {"BF16": 8, "Q8_0": 8, "Q5_0": 5, "Q5_1": 5, "Q4_0": 4, "Q4_1": 4}[type_name]
        for name, original in wide_model.state_dict().items():
            # within a quantization step of the block's largest value, and unpermuted (else errors ~ |w|)
            step = original.abs().max() / 2 ** (bits - 2)
            assert (state[name] - original).abs().max() <= step, name


def _f16(b: np.ndarray) -> np.ndarray:
    return b.view(np.float16).astype(np.float32)


def decode_by_hand(data: np.ndarray, qtype: Q) -> np.ndarray:
    """Reference decoders written from ggml-common.h's block layouts, one block at a time."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    out = []
    for raw in data.reshape(-1, size):
        if qtype == Q.Q8_0:  # d, 32 x int8
            out.append(_f16(raw[:2])[0] * raw[2:].view(np.int8).astype(np.float32))
        elif qtype == Q.Q4_0:  # d, 16 bytes: element j in the low nibble of byte j, j + 16 in its high nibble
            q = np.concatenate([raw[2:] & 15, raw[2:] >> 4]).astype(np.float32)
            out.append(_f16(raw[:2])[0] * (q - 8))
        elif qtype == Q.Q4_K:  # d, dmin, 12 bytes of 6-bit scales/mins for 8 sub-blocks, 128 bytes of nibbles
            d, dmin, sc, qs = _f16(raw[0:2])[0], _f16(raw[2:4])[0], raw[4:16].astype(int), raw[16:]
            values = []
            for j in range(8):  # get_scale_min_k4
                if j < 4:
                    scale, mn = sc[j] & 63, sc[j + 4] & 63
                else:
                    scale = (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4)
                    mn = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)
                chunk = qs[32 * (j // 2): 32 * (j // 2) + 32]
                q = (chunk & 15) if j % 2 == 0 else (chunk >> 4)
                values.append(d * scale * q.astype(np.float32) - dmin * mn)
            out.append(np.concatenate(values))
        elif qtype == Q.Q6_K:  # 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, d
            ql, qh, sc, d = raw[:128], raw[128:192], raw[192:208].view(np.int8), _f16(raw[208:210])[0]
            y = np.zeros(256, np.float32)
            for half in range(2):
                lo, hi, s = ql[64 * half:], qh[32 * half:], sc[8 * half:]
                for i in range(32):
                    q = [(lo[i] & 15) | ((hi[i] >> 0 & 3) << 4), (lo[i + 32] & 15) | ((hi[i] >> 2 & 3) << 4),
                         (lo[i] >> 4) | ((hi[i] >> 4 & 3) << 4), (lo[i + 32] >> 4) | ((hi[i] >> 6 & 3) << 4)]
                    for k in range(4):
                        y[128 * half + i + 32 * k] = d * s[i // 16 + 2 * k] * (int(q[k]) - 32)
            out.append(y)
    return np.concatenate(out).reshape(data.shape[0], -1)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
def test_dequantized_equals_hand_decoded_blocks(tmp_path, type_name):
    """The values match the ggml formats decoded by hand, rows in place and q/k unpermuted."""
    model = tiny_llama(hidden_size=256, intermediate_size=256, num_hidden_layers=1, vocab_size=8)
    qtype = Q[type_name]
    path = write_gguf(tmp_path / "q.gguf", model, qtype=qtype, vocab=None)
    reader = gguf.GGUFReader(str(path))
    _, state, _ = read_gguf(path)
    for tensor in reader.tensors:
        if tensor.tensor_type != qtype:
            continue
        expected = torch.from_numpy(decode_by_hand(np.asarray(tensor.data), qtype)).float()
        layer_name = tensor.name.split(".")
        if tensor.name.startswith("blk."):
            hf_name = f"model.layers.{layer_name[1]}.{LAYER[layer_name[2]]}.weight"
        else:
            hf_name = {"token_embd": "model.embed_tokens.weight", "output": "lm_head.weight"}[layer_name[0]]
        if layer_name[-2] in ("attn_q", "attn_k"):
            heads = 4 if layer_name[-2] == "attn_q" else model.config.num_key_value_heads
            # the inverse of llama_cpp_permute, by index: row r of the file is row perm[r] of the model
            perm = torch.from_numpy(llama_cpp_permute(np.arange(expected.shape[0]), heads))
            expected = torch.empty_like(expected).index_copy_(0, perm, expected)
        torch.testing.assert_close(state[hf_name], expected, rtol=1e-6, atol=1e-7, msg=hf_name)


# --------------------------------------------------------------------------------------------- tokenizer
@pytest.mark.parametrize("vocab", ["spm", "bpe"])
def test_tokenizer_matches_transformers(tmp_path, model, vocab):
    path = write_gguf(tmp_path / f"{vocab}.gguf", model, vocab=vocab)
    _, _, tok = read_gguf(path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert tok.vocab_size == 300  # transformers adds a 301st token, <|endoftext|>, to a byte-level vocabulary
    assert (tok.bos_token_id, tok.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"], text
        assert ids[:1] == [tok.bos_token_id]  # add_bos_token in the file
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text


def test_spm_tokens_by_hand(tmp_path, model):
    """Independent of transformers: best-scoring pieces, ▁ for spaces, bytes for what has no piece."""
    _, _, tok = read_gguf(write_gguf(tmp_path / "spm.gguf", model, vocab="spm"))
    ids = tok.encode("hello world ✓", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["\u2581hello", "\u2581world", "\u2581", "<0xE2>", "<0x9C>", "<0x93>"]
    assert tok.encode("</s>", add_special_tokens=False) == [2]  # control tokens are matched whole
    # llama.cpp prepends a space to every run of text: also one that starts with spaces, also after a special
    # token (transformers' GGUF tokenizer does neither); decoding removes it again
    pieces = ["<s>", "\u2581", "\u2581", "\u2581t", "w", "o", "</s>", "\u2581hello"]
    ids = tok.encode("  two</s>hello")
    assert [tok.id_to_token(i) for i in ids] == pieces
    assert tok.decode(ids) == "  two hello"
    assert tok.unk_token_id == 0 and tok.pad_token_id is None


def test_bpe_tokens_match_the_trained_tokenizer(tmp_path, model):
    _, _, tok = read_gguf(write_gguf(tmp_path / "bpe.gguf", model, vocab="bpe"))
    reference = bpe_tokenizer(300)  # the tokenizers BPE the file's vocabulary and merges came from
    for text in ["hello world, the weather is nice today", "two spaces and a line"]:
        assert tok.encode(text, add_special_tokens=False) == reference.encode(text).ids
    assert tok.encode("<|eot_id|>", add_special_tokens=False) == [2]


def test_tokenizer_metadata_refused_or_taken_whole():
    from tokenization.gguf import tokenizer_from_gguf

    tokens, scores, types = spm_vocab(300)
    base = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types}
    with pytest.raises(ValueError, match="'bert'"):
        tokenizer_from_gguf({**base, "tokenizer.ggml.model": "bert"})
    with pytest.raises(ValueError, match="pre='qwen9'"):
        tokenizer_from_gguf({**base, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": [],
                             "tokenizer.ggml.pre": "qwen9"})
    with pytest.raises(ValueError, match="bos_token_id=999"):
        tokenizer_from_gguf({**base, "tokenizer.ggml.model": "llama", "tokenizer.ggml.bos_token_id": 999})
    # a file that embeds its tokenizer.json is read as it is
    whole = bpe_tokenizer(300)
    tok = tokenizer_from_gguf({"tokenizer.ggml.tokens": ["x"] * 300, "tokenizer.huggingface.json": whole.to_str(),
                               "tokenizer.ggml.eos_token_id": 2})
    assert tok.encode("hello world") == whole.encode("hello world").ids
    assert tok.eos_token_id == 2 and tok.special_tokens["eos"] == "<|eot_id|>"


def test_no_vocabulary_means_no_tokenizer(tmp_path, model):
    config, _, tok = read_gguf(write_gguf(tmp_path / "bare.gguf", model, vocab=None))
    assert tok is None and config["vocab_size"] == 300


# --------------------------------------------------------------------------------------------- rope scaling
def llama_cpp_rope_freqs(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """``convert_hf_to_gguf.LlamaModel.generate_extra_tensors``: llama3 scaling as per-frequency divisors."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def inv_freq(config: dict) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = {k: v for k, v in config.items() if k != "model_type"}
    return LlamaRotaryEmbedding(transformers.LlamaConfig(**config)).inv_freq


@pytest.mark.parametrize("scaling", [
    # three frequencies between the boundaries: the parameters themselves come back
    {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 16.0, "original_max_position_embeddings": 2048},
    # Llama 3.1's parameters on a tiny head: one frequency between the boundaries
    {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    # none between
    {"factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 3.0, "original_max_position_embeddings": 1000},
])
def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path, scaling):
    original = tiny_llama(max_position_embeddings=16384, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                                                           **scaling})
    divisors = llama_cpp_rope_freqs(16, 10000.0, scaling)
    config, state, _ = read_gguf(write_gguf(tmp_path / "l3.gguf", original, rope_freqs=divisors, vocab=None))
    assert config["rope_scaling"]["rope_type"] == "llama3" and "rope_freqs.weight" not in state
    if scaling["high_freq_factor"] == 16.0:
        assert config["rope_scaling"] == {"rope_type": "llama3", **scaling}
    torch.testing.assert_close(inv_freq(config), inv_freq(original.config.to_dict()), rtol=1e-6, atol=0)


def test_rope_freqs_that_are_not_llama3_are_refused(tmp_path, model):
    divisors = np.array([1.0, 3.0, 1.0, 2.0, 4.0, 1.5, 8.0, 8.0], dtype=np.float32)
    with pytest.raises(ValueError, match="not llama3 rope scaling"):
        read_gguf(write_gguf(tmp_path / "odd.gguf", model, rope_freqs=divisors, vocab=None))


def test_linear_rope_scaling_from_metadata(tmp_path, model):
    meta = [("add_string", "llama.rope.scaling.type", "linear"), ("add_float32", "llama.rope.scaling.factor", 4.0)]
    config, _, _ = read_gguf(write_gguf(tmp_path / "lin.gguf", model, metadata=meta, vocab=None))
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


# --------------------------------------------------------------------------------------------- bad input
def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(path)
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "missing.gguf")


def test_unsupported_architecture(tmp_path, model):
    with pytest.raises(ValueError, match="'falcon'.*expected one of \\['llama', 'qwen2'"):
        read_gguf(write_gguf(tmp_path / "falcon.gguf", model, arch="falcon", vocab=None))


def test_unsupported_tensor_type(tmp_path, model):
    path = write_gguf(tmp_path / "iq.gguf", model, qtype=Q.IQ4_NL, vocab=None)
    with pytest.raises(ValueError, match="IQ4_NL"):
        read_gguf(path)


def test_mixture_of_experts_and_bad_dtype_refused(tmp_path, model):
    path = write_gguf(tmp_path / "moe.gguf", model, vocab=None, metadata=[("add_uint32", "llama.expert_count", 8)])
    with pytest.raises(ValueError, match="expert_count=8"):
        read_gguf(path)
    with pytest.raises(ValueError, match="int8"):
        read_gguf(path, dtype=torch.int8)


def test_tensors_that_do_not_fit_the_metadata(tmp_path):
    path = write_gguf(tmp_path / "bad.gguf", tiny_llama(num_key_value_heads=4), vocab=None)
    # head_count_kv 4 -> 2 in place (same width, the file stays valid): k/v are now twice too tall
    editable = gguf.GGUFReader(str(path), "r+")
    editable.fields["llama.attention.head_count_kv"].parts[-1][0] = 2
    editable.data.flush()
    with pytest.raises(ValueError, match=r"head_count_kv=2 \(x head size 16 = 32\) disagrees with the tensor "
                                         r"blk.0.attn_k.weight of shape \(64, 64\)"):
        read_gguf(path)


def test_missing_gguf_package(monkeypatch, f32_file):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match=r"pip install transformer-zoo\[gguf\]"):
        read_gguf(f32_file)


# --------------------------------------------------------------------------------------------- end to end
def zoo_from_gguf(path: Path):
    from models.auto import load_state_into
    from models.convert import from_transformers

    config, state, _ = read_gguf(path)
    converted = from_transformers(config, state)
    zoo = converted.architecture(converted.config)
    load_state_into(zoo, converted.state_dict, allow_missing=converted.allow_missing)
    return zoo.eval()


@pytest.mark.parametrize("type_name, variant", [("F32", "gqa"), ("Q8_0", "gqa"), ("Q4_K", "wide"), ("F16", "tied")])
def test_zoo_logits_match_transformers_from_the_same_file(tmp_path, model, wide_model, type_name, variant):
    if variant == "tied":  # tied embeddings, head_dim 32 on d_model 64 with 4 heads
        source = tiny_llama(tie_word_embeddings=True, head_dim=32)
    else:
        source = wide_model if variant == "wide" else model
    path = write_gguf(tmp_path / "m.gguf", source, qtype=Q[type_name], vocab=None)
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_from_gguf(path)(ids).logits
        got = zoo_from_gguf(path)(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_zoo_logits_with_biases(tmp_path):
    """transformers' GGUF loader drops q/k/v/o and MLP biases; the model the file came from is the reference."""
    source = tiny_llama(attention_bias=True, mlp_bias=True)
    with torch.no_grad():
        for name, p in source.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    path = write_gguf(tmp_path / "bias.gguf", source, vocab=None)
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(zoo_from_gguf(path)(ids).logits, source(ids).logits, atol=1e-4, rtol=0)


def test_zoo_logits_with_llama3_rope_scaling(tmp_path):
    """transformers' GGUF loader drops rope_freqs; the model it came from is the reference here."""
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 16.0, "original_max_position_embeddings": 64}
    original = tiny_llama(max_position_embeddings=1024, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                                                          **scaling})
    path = write_gguf(tmp_path / "l3.gguf", original, rope_freqs=llama_cpp_rope_freqs(16, 10000.0, scaling), vocab=None)
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(zoo_from_gguf(path)(ids).logits, original(ids).logits, atol=1e-4, rtol=0)


def test_from_pretrained_gguf(tmp_path, model):
    import models

    path = write_gguf(tmp_path / "m.gguf", model, qtype=Q.Q8_0, vocab="spm")
    zoo = models.from_pretrained(str(path))
    ids = torch.tensor([zoo.tokenizer.encode("hello world")])
    with torch.no_grad():
        torch.testing.assert_close(zoo(ids).logits, hf_from_gguf(path)(ids).logits, atol=1e-4, rtol=0)
