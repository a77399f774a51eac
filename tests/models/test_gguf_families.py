"""GGUF files of every family the zoo reads (llama, mistral, qwen2, qwen3, gemma2, phi3, gpt2), written from tiny
random ``transformers`` models the way llama.cpp's ``convert_hf_to_gguf.py`` writes them (``gguf``'s own name map
``get_tensor_name_map`` and ``GGUFWriter``, llama's q/k permutation, Gemma's ``1 + w`` norms, GPT-2's transposed
``Conv1D`` weights, quantized with ``gguf.quants``), then read by the zoo and by ``transformers``' GGUF loader:
dequantized tensors bit-identical, logits within 1e-4. Split sets and the Hub are covered here too."""

from __future__ import annotations

from pathlib import Path

import accelerate  # noqa: F401  (transformers' GGUF loader needs it)
import gguf
import numpy as np
import pytest
import torch
import transformers

import models
from models.gguf import read_gguf
from models.gguf.families import SUPPORTED_ARCHITECTURES

Q = gguf.GGMLQuantizationType

# Sizes away from every default. Where transformers' GGUF loader does not read a size from the file it uses its
# config default, so those few are set to the default (qwen3's head_dim 128, gemma2's 256 = query_pre_attn_scalar).
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(head_dim=16, attention_bias=False)),
    "mistral": (transformers.MistralConfig, dict(head_dim=16, sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, dict()),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=128)),
    "gemma2": (transformers.Gemma2Config, dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=8,
                                               final_logit_softcapping=30.0, attn_logit_softcapping=50.0)),
    "phi3": (transformers.Phi3Config, dict(pad_token_id=0)),
    "gpt2": (transformers.GPT2Config, dict()),
}
ARCH = {"mistral": "llama"}
# One quantized type per family, so that together they cover every type gguf can write.
QUANT = {"llama": Q.Q8_0, "mistral": Q.Q4_0, "qwen2": Q.Q4_1, "qwen3": Q.Q5_0, "gemma2": Q.Q5_1, "phi3": Q.F16,
         "gpt2": Q.BF16}


def tiny(family: str, vocab_size: int = 160) -> transformers.PreTrainedModel:
    config_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    if family == "gpt2":
        # transformers' GGUF loader reads neither n_inner nor n_positions (GPT2Config's defaults: 4 x n_embd, 1024)
        config = config_class(vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, layer_norm_epsilon=1e-4,
                              tie_word_embeddings=False)
    else:
        config = config_class(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                              rms_norm_eps=1e-5, tie_word_embeddings=family == "gemma2", **extra)
        config.rope_parameters = {"rope_type": "default", "rope_theta": 5000.0}
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms and biases away from their init, so one loaded in the wrong place shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or ".ln_" in name:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.uniform_(-0.1, 0.1)
    return model


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write(path: Path, family: str, model, qtype: Q = Q.F32, parts: int = 1, drop: tuple[str, ...] = (),
          add: tuple[tuple[str, np.ndarray], ...] = ()) -> Path:
    """llama.cpp's converter in brief: metadata under the architecture, tensors renamed by gguf's map."""
    arch = ARCH.get(family, family)
    c = model.config
    n_layers = c.num_hidden_layers
    name_map = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), n_layers)
    tensors: list[tuple[str, np.ndarray]] = []
    for hf_name, t in model.state_dict().items():
        if family != "gpt2" and hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = name_map.get_name(base) + "." + suffix
        data = t.float().numpy().copy()
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            data = llama_cpp_permute(data, c.num_attention_heads if "attn_q" in name else c.num_key_value_heads)
        if family == "gemma2" and name.endswith("norm.weight"):
            data = data + 1
        if family == "gpt2" and data.ndim == 2 and not name.startswith(("token_embd", "position_embd", "output.")):
            data = data.T.copy()
        if family == "gpt2" and name == "token_embd.weight" and c.tie_word_embeddings:
            tensors.append(("output.weight", data))  # llama.cpp writes GPT-2's tied output as a copy
        tensors.append((name, data))
    # A split set as convert_hf_to_gguf --split-max-tensors writes it: the writer names the parts and adds split.*.
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=-(-len(tensors) // parts) if parts > 1 else 0)
    metadata(writer, family, arch, c)
    for key in drop:  # metadata keys or tensors left out, for the tests of bad files
        writer.kv_data[0].pop(key, None)
    for name, data in [(n, d) for n, d in tensors if n not in drop] + list(add):
        if data.ndim == 2 and qtype != Q.F32 and "embd" not in name:
            writer.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path if parts == 1 else path.with_name(f"{path.stem}-00001-of-{parts:05d}.gguf")


def metadata(writer, family: str, arch: str, c) -> None:
    writer.add_name(f"{family}-tiny")
    if family == "gpt2":
        writer.add_context_length(c.n_positions)
        writer.add_embedding_length(c.n_embd)
        writer.add_feed_forward_length(c.n_inner or 4 * c.n_embd)
        writer.add_block_count(c.n_layer)
        writer.add_head_count(c.n_head)
        writer.add_layer_norm_eps(c.layer_norm_epsilon)
    else:
        writer.add_context_length(c.max_position_embeddings)
        writer.add_embedding_length(c.hidden_size)
        writer.add_feed_forward_length(c.intermediate_size)
        writer.add_block_count(c.num_hidden_layers)
        writer.add_head_count(c.num_attention_heads)
        writer.add_head_count_kv(c.num_key_value_heads)
        writer.add_layer_norm_rms_eps(c.rms_norm_eps)
        writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
        writer.add_vocab_size(c.vocab_size)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        writer.add_rope_dimension_count(head_dim)
        if family in ("qwen3", "gemma2", "llama", "mistral"):
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        if family == "gemma2":
            writer.add_sliding_window(c.sliding_window)
            writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
            writer.add_final_logit_softcapping(c.final_logit_softcapping)
    # a vocabulary (transformers reads GPT-2's vocabulary size from it)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(["a", "b", "ab"] + [f"t{i}" for i in range(3, c.vocab_size)])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if getattr(c, "pad_token_id", None) is not None:
        writer.add_pad_token_id(c.pad_token_id)


def transformers_from(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


IDS = torch.tensor([[5, 17, 3, 99, 42, 7, 150, 11, 64, 2, 8, 30]])


@pytest.fixture(scope="module")
def tiny_models():
    return {family: tiny(family) for family in FAMILIES}


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "quantized"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_transformers_gguf_loader(tmp_path, tiny_models, family, quantized):
    original = tiny_models[family]
    qtype = QUANT[family] if quantized else Q.F32
    path = write(tmp_path / f"{family}.gguf", family, original, qtype)
    config, state, tokenizer = read_gguf(path)
    assert config["model_type"] == family and tokenizer is not None
    reference = transformers_from(path)
    theirs = reference.state_dict()
    assert set(state) <= set(theirs)
    for name, tensor in state.items():  # the zoo and transformers dequantize to the same bits
        assert torch.equal(tensor, theirs[name]), name
    if not quantized:  # and F32 is the original model (Gemma's norms: as float32 makes (w + 1) - 1)
        for name, tensor in state.items():
            want = original.state_dict()[name]
            if family == "gemma2" and "norm" in name:
                want = (want + 1) - 1
            assert torch.equal(tensor, want), name
    zoo = models.from_pretrained(path)
    with torch.no_grad():
        expected = reference(IDS).logits
        got = zoo(IDS).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_split_set_reads_as_one_file(tmp_path, tiny_models):
    first = write(tmp_path / "q.gguf", "qwen2", tiny_models["qwen2"], Q.Q8_0, parts=3)
    assert first.name == "q-00001-of-00003.gguf"
    single = write(tmp_path / "single.gguf", "qwen2", tiny_models["qwen2"], Q.Q8_0)
    config, state, _ = read_gguf(first)
    config1, state1, _ = read_gguf(single)
    assert config == config1 and state.keys() == state1.keys()
    assert all(torch.equal(state[k], state1[k]) for k in state)
    # a part that says it is another part, or a missing part, is refused by name
    (tmp_path / "q-00003-of-00003.gguf").rename(tmp_path / "moved.gguf")
    with pytest.raises(FileNotFoundError, match="q-00003-of-00003"):
        read_gguf(first)
    (tmp_path / "q-00003-of-00003.gguf").write_bytes((tmp_path / "q-00002-of-00003.gguf").read_bytes())
    with pytest.raises(ValueError, match="split.no=1 of split.count=3; expected split.no=2"):
        read_gguf(first)


def test_architectures_listed():
    assert set(SUPPORTED_ARCHITECTURES) == {ARCH.get(f, f) for f in FAMILIES} | {"t5"}


@pytest.mark.parametrize("family, drop, add, message", [
    ("qwen2", ("qwen2.block_count",), (), "no 'qwen2.block_count'"),
    ("qwen2", ("blk.1.attn_k.bias",), (), r"qwen2 model .*missing \['blk.1.attn_k.bias'\]"),
    ("qwen3", ("blk.0.attn_q_norm.weight",), (), r"missing \['blk.0.attn_q_norm.weight'\]"),
    ("gemma2", (), (("output.weight", np.zeros((160, 64), np.float32)),), "gemma2 GGUF with its own output.weight"),
    ("phi3", ("phi3.attention.head_count_kv",), (), r"head_count \+ 2 x head_count_kv=12 .*attn_qkv"),
    ("gpt2", (), (("blk.2.attn_norm.weight", np.ones(64, np.float32)),), r"block_count=2.*blocks \['0', '1', '2'\]"),
    ("llama", (), (("blk.0.attn_q.bias", np.ones(64, np.float32)),), r"only some of the biases.*attention_bias"),
])
def test_family_files_that_lie_are_refused_by_name(tmp_path, tiny_models, family, drop, add, message):
    path = write(tmp_path / "bad.gguf", family, tiny_models[family], drop=drop, add=add)
    with pytest.raises(ValueError, match=message):
        read_gguf(path)


def test_split_sets_that_lie_are_refused(tmp_path, tiny_models):
    first = write(tmp_path / "s.gguf", "llama", tiny_models["llama"], parts=2)
    second = tmp_path / "s-00002-of-00002.gguf"
    # the second part re-stores a tensor of the first
    reader = gguf.GGUFReader(str(first))
    writer = gguf.GGUFWriter(str(second), "llama")
    writer.add_uint16("split.no", 1)
    writer.add_uint16("split.count", 2)
    writer.add_int32("split.tensors.count", len(reader.tensors) + 1)
    for t in [*reader.tensors, reader.tensors[0]][-2:]:
        writer.add_tensor(t.name, np.array(t.data, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist()))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="is stored in both"):
        read_gguf(first)


def test_model_built_without_init_gets_every_weight(tmp_path, tiny_models, monkeypatch):
    """A GGUF load builds the model with torch.nn.init switched off (every weight is then assigned from the file);
    the init functions are back afterwards, also when the build fails, and nothing is left uninitialised."""
    normal = torch.nn.init.normal_
    path = write(tmp_path / "l.gguf", "llama", tiny_models["llama"])
    model = models.from_pretrained(path)
    assert torch.nn.init.normal_ is normal
    state = read_gguf(path)[1]
    assert torch.equal(model.embed_tokens.weight, state["model.embed_tokens.weight"])
    from models import DecoderLM

    def broken(self, config):
        raise RuntimeError("build failed")

    monkeypatch.setattr(DecoderLM, "__init__", broken)
    with pytest.raises(RuntimeError, match="build failed"):
        models.from_pretrained(path)
    assert torch.nn.init.normal_ is normal


def test_t5_matches_transformers_gguf_loader_and_its_unigram_vocabulary(tmp_path):
    """T5 1.1 / Flan (gated-gelu, untied head) from a GGUF file as llama.cpp writes it (enc./dec. blocks): tensors
    bit-identical to transformers' GGUF loader, logits those of the original model; its Unigram vocabulary
    (tokenizer.ggml.model = t5) gives SentencePiece's own ids (with EOS, as llama.cpp adds it)."""
    import sentencepiece as spm

    from tests.tokenization.test_gguf_pretokenizers import CORPUS, TEXTS

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(t for t in CORPUS if t and "<|" not in t))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=110,
                                   model_type="unigram", character_coverage=1.0, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=sp.get_piece_size(), d_model=64, d_ff=96, d_kv=16, num_heads=4,
                                   num_layers=2, relative_attention_num_buckets=16, feed_forward_proj="gated-gelu",
                                   tie_word_embeddings=False, layer_norm_epsilon=1e-5, decoder_start_token_id=0)
    original = transformers.T5ForConditionalGeneration(config).eval()
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.T5, config.num_layers)
    writer = gguf.GGUFWriter(str(tmp_path / "t5.gguf"), "t5")
    writer.add_name("flan-t5-tiny")
    writer.add_context_length(512)
    writer.add_embedding_length(config.d_model)
    writer.add_feed_forward_length(config.d_ff)
    writer.add_block_count(config.num_layers)
    writer.add_head_count(config.num_heads)
    writer.add_key_length(config.d_kv)
    writer.add_value_length(config.d_kv)
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    writer.add_relative_attn_buckets_count(config.relative_attention_num_buckets)
    writer.add_decoder_start_token_id(0)
    writer.add_vocab_size(config.vocab_size)
    n = sp.get_piece_size()
    writer.add_tokenizer_model("t5")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types([2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 1 for i in range(n)])
    writer.add_pad_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(2)
    for hf_name, tensor in original.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        mapped = name_map.get_name(base)
        if mapped is not None and not (mapped == "token_embd" and base != "shared"):
            writer.add_tensor(f"{mapped}.{suffix}", tensor.numpy().copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path = tmp_path / "t5.gguf"

    config_read, state, tokenizer = read_gguf(path)
    reference = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                                        dtype=torch.float32).eval()
    theirs = reference.state_dict()
    for name, tensor in state.items():
        assert torch.equal(tensor, theirs[name]) and torch.equal(tensor, original.state_dict()[name]), name
    zoo = models.from_pretrained(path)
    src, tgt = IDS % n, torch.tensor([[0, 5, 9, 33, 4]])
    # Logits against the original model: transformers' GGUF loader builds T5 with a gated *relu* (its config
    # keeps dense_act_fn="relu" while setting is_gated_act), where Flan-T5 and llama.cpp use a gated gelu.
    assert reference.config.dense_act_fn == "relu" and reference.config.is_gated_act
    with torch.no_grad():
        want = original(input_ids=src, decoder_input_ids=tgt).logits
        torch.testing.assert_close(zoo(src, tgt).logits, want, atol=1e-4, rtol=0)
    for text in [t for t in TEXTS if "<|" not in t]:
        assert tokenizer.encode(text) == [*sp.encode(text), 1], text
