"""Every llama.cpp byte-level pre-tokenizer (``tokenizer.ggml.pre``): a ``tokenizers`` tokenizer built as the original
model's ``tokenizer.json`` builds it, trained on a tiny corpus, written to GGUF with ``gguf``'s own ``GGUFWriter`` the
way llama.cpp's converter writes a vocabulary, and read back by the zoo, gives the same ids on text with digits,
contractions, CJK, emoji, code, whitespace runs and special tokens.

The references are written here independently of ``tokenization.gguf_pretokenizers``: GPT-2's ``ByteLevel``
with its built-in pattern, SmolLM/StarCoder's ``Digits`` + ``ByteLevel``, and for pattern-based vocabularies
llama.cpp's own C++ spelling of the pattern (``'[sS]`` rather than ``(?i:'s)``) where it differs from the
``tokenizer.json`` spelling the zoo uses; only the very long character-class patterns are shared."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

import tokenization.gguf_pretokenizers as table
from models.gguf import read_gguf_tokenizer
from tokenization.gguf import GGUFTokenizer, tokenizer_from_gguf

SPECIALS = ["<|bos|>", "<|eos|>", "<|eot|>"]
USER_DEFINED = "<tool>"
TEXTS = [
    "Hello, world! I'm here; you're there, they've gone. WE'LL SEE IT'S FINE",
    "numbers 1234567 and 3.14159, 2024-11-24, 10000000000 000",
    "中文文本，日本語のテキスト、한국어 텍스트",
    "emoji 😀🎉👍🏽 and ñandú café ÉCOLE école Ωmega",
    "def f(x):\n\treturn x**2  # comment\n\n\n    if a != b: pass\r\n",
    "   leading and trailing spaces   ",
    "tabs\t\tand\n\nnewlines \n \n",
    "<|bos|>special<|eot|> tokens <tool> in text<|eos|>",
    "",
]
CORPUS = TEXTS * 3 + ["the quick brown fox jumps over the lazy dog 0123456789"] * 5

_APOS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp's C++ spellings (src/llama-vocab.cpp), typed here from that file.
_CPP = {
    "llama3": _APOS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": _APOS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": _APOS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
              r"|\s+",
    "seed-coder": _APOS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
    "bailingmoe": r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
                  r"[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "minicpm5": _APOS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "exaone-moe": _APOS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
                  r"|\s*[\r\n]|\s+(?!\S)|\s+",
    "tekken": r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])"
              r"([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_GROUPS = {
    "llama3": "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano dbrx smaug-bpe glm4 "
              "chatglm-bpe",
    "qwen2": "qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open grok-2",
    "gpt2": "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert exaone4 jina-v1-en "
            "jina-v2-code roberta-bpe mpt olmo jais trillion granite-docling",
    "digits": "starcoder refact command-r smollm codeshell exaone minerva-7b mellum2",
}
GROUP_OF = {name: group for group, names in _GROUPS.items() for name in names.split()}


def split_then_bytes(*patterns: str) -> pre_tokenizers.PreTokenizer:
    steps = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
    return pre_tokenizers.Sequence([*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def reference_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of the original model's tokenizer.json (see the module docstring)."""
    group = GROUP_OF.get(pre)
    if group == "gpt2":  # GPT-2's tokenizer.json: ByteLevel with its own pattern
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if group == "digits":  # SmolLM / StarCoder: individual digits, then GPT-2's byte level
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if group in _CPP:
        return split_then_bytes(_CPP[group])
    cpp = {"qwen35": (_CPP["qwen35"],), "seed-coder": (_CPP["seed-coder"],), "minicpm5": (r"\p{N}{1,3}",
           _CPP["minicpm5"]), "exaone-moe": (_CPP["exaone-moe"],), "tekken": (_CPP["tekken"],),
           "jais-2": (_APOS + table.JAIS2[table.JAIS2.index("|[^"):],),
           "bailingmoe": (_CPP["bailingmoe"],), "bailingmoe2": (_CPP["bailingmoe"],),
           "llada-moe": (_CPP["bailingmoe"],)}
    if pre in cpp:
        return split_then_bytes(*cpp[pre])
    return split_then_bytes(*table.PRE_TOKENIZERS[pre].splits)


def trained(pre: str) -> Tokenizer:
    entry = table.PRE_TOKENIZERS[pre]
    tok = Tokenizer(models.BPE(ignore_merges=entry.ignore_merges))
    tok.pre_tokenizer = reference_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken(USER_DEFINED, normalized=False)])
    assert json.loads(tok.to_str())["model"]["ignore_merges"] == entry.ignore_merges
    return tok


def write_vocab(path: Path, tok: Tokenizer, pre: str | None, **flags) -> Path:
    """As llama.cpp's converter: tokens by id, token types (3 control, 4 user-defined), merges "a b", ids."""
    model = json.loads(tok.to_str())["model"]
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    types = [3 if t in SPECIALS else 4 if t == USER_DEFINED else 1 for t in tokens]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    writer.add_bos_token_id(vocab["<|bos|>"])
    writer.add_eos_token_id(vocab["<|eos|>"])
    writer.add_eot_token_id(vocab["<|eot|>"])
    writer.add_chat_template("{% for m in messages %}<|bos|>{{ m['content'] }}<|eot|>{% endfor %}")
    for name, value in flags.items():
        getattr(writer, f"add_{name}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre", sorted(table.PRE_TOKENIZERS))
def test_every_pre_tokenizer_gives_the_original_ids(tmp_path, pre):
    reference = trained(pre)
    zoo = read_gguf_tokenizer(write_vocab(tmp_path / "v.gguf", reference, pre, add_bos_token=True))
    assert isinstance(zoo, GGUFTokenizer) and zoo.pre == pre
    bos = reference.token_to_id("<|bos|>")
    for text in TEXTS:
        ids = reference.encode(text, add_special_tokens=False).ids
        assert zoo.encode(text, add_special_tokens=False) == ids, text
        assert zoo.encode(text) == [bos, *ids]
        assert zoo.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
    assert zoo.special_ids["eot"] == reference.token_to_id("<|eot|>")
    assert zoo.chat_template.startswith("{% for m in messages %}")
    assert zoo.eos_token_id == reference.token_to_id("<|eos|>")


def test_pre_tokenizers_split_the_issue_examples():
    """Spot checks of what each kind of rule does (independent of training)."""
    def pieces(pre: str, text: str) -> list[str]:
        return [p for p, _ in table.pre_tokenizer_for(pre).build().pre_tokenize_str(text)]

    assert pieces("smollm", "x 123") == ["x", "Ġ", "1", "2", "3"]
    assert pieces("llama-bpe", "x 12345") == ["x", "Ġ", "123", "45"]
    assert pieces("gpt-2", "x 12345") == ["x", "Ġ12345"]
    assert pieces("tiny_aya", "1234567") == ["1", "234", "567"]
    assert pieces("afmoe", "1234567") == ["1", "234", "567"]
    assert pieces("superbpe", "1234567") == ["1", "234", "567"]
    assert pieces("deepseek-coder", "ab12") == ["ab", "1", "2"]
    assert pieces("kimi-k2", "中文abc") == ["ä¸Ńæĸĩ", "abc"]


def test_defaults_and_refusals(tmp_path):
    tok = trained("gpt-2")
    # No pre type: llama.cpp's "default" rules.
    zoo = read_gguf_tokenizer(write_vocab(tmp_path / "none.gguf", tok, None))
    default = split_then_bytes(*table.PRE_TOKENIZERS["default"].splits)
    assert [p for p, _ in zoo.backend.pre_tokenizer.pre_tokenize_str("a 1234!")] == \
        [p for p, _ in default.pre_tokenize_str("a 1234!")]
    # llama.cpp's default BOS for llama3-type vocabularies (no add_bos_token key in the file): added.
    llama3 = read_gguf_tokenizer(write_vocab(tmp_path / "l3.gguf", trained("llama-bpe"), "llama-bpe"))
    assert llama3.add_bos_token and llama3.encode("a")[0] == llama3.bos_token_id
    assert not read_gguf_tokenizer(write_vocab(tmp_path / "q.gguf", tok, "qwen2")).add_bos_token
    with pytest.raises(ValueError, match="pre='qwen9'"):
        read_gguf_tokenizer(write_vocab(tmp_path / "bad.gguf", tok, "qwen9"))
    with pytest.raises(ValueError, match="pre='gemma4'.*not a byte-level"):
        read_gguf_tokenizer(write_vocab(tmp_path / "g4.gguf", tok, "gemma4"))


def test_extra_ids_and_chat_template_checked():
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b"]}
    with pytest.raises(ValueError, match="eot_token_id=7"):
        tokenizer_from_gguf({**base, "tokenizer.ggml.eot_token_id": 7})
    with pytest.raises(ValueError, match="chat_template=3"):
        tokenizer_from_gguf({**base, "tokenizer.chat_template": 3})
    with pytest.raises(ValueError, match="pre=5"):
        tokenizer_from_gguf({**base, "tokenizer.ggml.pre": 5})
    # A merge whose result is not a token (tokenizers would panic, not raise).
    with pytest.raises(ValueError, match=r"merges\[0\]='a b'"):
        tokenizer_from_gguf({**base, "tokenizer.ggml.tokens": ["a", "b", "c"]})


def test_template_processor_adds_eos_when_asked(tmp_path):
    tok = trained("qwen2")
    zoo = read_gguf_tokenizer(write_vocab(tmp_path / "e.gguf", tok, "qwen2", add_bos_token=False,
                                          add_eos_token=True))
    assert zoo.encode("hi") == [*tok.encode("hi").ids, tok.token_to_id("<|eos|>")]
    assert isinstance(zoo.backend.post_processor, processors.TemplateProcessing)


def test_sentencepiece_vocabulary_with_byte_fallback(tmp_path):
    """SPM (tokenizer.ggml.model = llama): a SentencePiece BPE model with byte fallback, written as llama.cpp's
    converter writes it (pieces, scores, token types), gives the ids of SentencePiece itself (with BOS)."""
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(t.replace("<|bos|>", "").replace("<|eot|>", "").replace("<|eos|>", "")
                                for t in CORPUS if t))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=400,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   add_dummy_prefix=True, remove_extra_whitespaces=False, minloglevel=2,
                                   normalization_rule_name="identity")  # as Llama's; llama.cpp normalizes nothing
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    kinds = [1 if sp.is_unknown(i) is False and not sp.is_control(i) and not sp.is_byte(i) else
             2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 for i in range(sp.get_piece_size())]
    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    writer.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    writer.add_token_types(kinds)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    zoo = read_gguf_tokenizer(tmp_path / "spm.gguf")
    texts = [t.replace("<|bos|>", "").replace("<|eot|>", "").replace("<|eos|>", "") for t in TEXTS]
    for text in [*texts, "控制 ☃ unseen 𝔘 bytes"]:
        assert zoo.encode(text) == [sp.bos_id(), *sp.encode(text)], text
    assert any(sp.is_byte(i) for i in zoo.encode("𝔘☃"))  # pieces the vocabulary lacks fell back to bytes


def test_t5_charsmap_is_used_and_a_hostile_one_never_crashes(tmp_path):
    """A SentencePiece NFKC charsmap normalizes as SentencePiece does; a corrupted one is refused with ValueError
    (tokenizers would index it unchecked and panic), never a crash."""
    import random

    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    (tmp_path / "c.txt").write_text("hello world full café\n" * 50)
    spm.SentencePieceTrainer.train(input=str(tmp_path / "c.txt"), model_prefix=str(tmp_path / "m"), vocab_size=16,
                                   model_type="unigram", minloglevel=2)  # the default nmt_nfkc normalizer
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((tmp_path / "m.model").read_bytes())
    charsmap = list(proto.normalizer_spec.precompiled_charsmap)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "m.model"))
    base = {"tokenizer.ggml.model": "t5", "tokenizer.ggml.eos_token_id": sp.eos_id(),
            "tokenizer.ggml.unknown_token_id": sp.unk_id(),
            "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(sp.get_piece_size())],
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(sp.get_piece_size())],
            "tokenizer.ggml.token_type": [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 1
                                          for i in range(sp.get_piece_size())]}
    tok = tokenizer_from_gguf({**base, "tokenizer.ggml.precompiled_charsmap": charsmap})
    for text in ["ｆｕｌｌ ｗｏｒｌｄ", "hello world", "café"]:  # fullwidth letters: NFKC folds them
        assert tok.encode(text) == [*sp.encode(text), sp.eos_id()], text
    rng = random.Random(0)
    refused = 0
    for _ in range(15):
        broken = list(charsmap)
        for _ in range(3):
            broken[rng.randrange(4, len(broken))] = rng.randrange(256)
        try:
            tokenizer_from_gguf({**base, "tokenizer.ggml.precompiled_charsmap": broken}).encode("ｆｕｌｌ é 中 a")
        except ValueError as err:
            assert "precompiled_charsmap" in str(err)
            refused += 1
    assert refused > 0
    with pytest.raises(ValueError, match="precompiled_charsmap"):
        tokenizer_from_gguf({**base, "tokenizer.ggml.precompiled_charsmap": [200, 0, 0, 0, 1, 2]})
