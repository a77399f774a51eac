"""What a GGUF tokenizer keeps: its tokens and merges as compact ``StringTable`` s, equal to what the file holds and
written back as lists; and a string that is not UTF-8 is refused naming it, as before."""

from __future__ import annotations

import gc
import tracemalloc

import gguf
import pytest
from tokenizers import pre_tokenizers

from models.gguf import read_gguf_tokenizer
from tokenization.gguf import tokenizer_to_gguf
from tokenization.string_table import StringTable

SPECIALS = ["<|bos|>", "<|eos|>"]


def byte_level_vocab(size: int) -> tuple[list[str], list[str]]:
    """Byte symbols, then tokens each merging a known token with a byte symbol, breadth first."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens, merges, known = SPECIALS + alphabet, [], len(SPECIALS)
    while len(tokens) < size:
        left, known = tokens[known], known + 1
        for right in alphabet[len(merges) % 256:][:3]:
            merges.append(f"{left} {right}")
            tokens.append(left + right)
    return tokens[:size], merges[:size - len(SPECIALS) - len(alphabet)]


def write(path, tokens, merges):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_tokenizer_keeps_its_strings_compactly_and_writes_them_back(tmp_path):
    tokens, merges = byte_level_vocab(20000)
    path = write(tmp_path / "v.gguf", tokens, merges)
    read_gguf_tokenizer(path)  # the imports and caches of a first read are not the tokenizer's
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tok = read_gguf_tokenizer(path)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    tables = [tok.metadata[f"tokenizer.ggml.{k}"] for k in ("tokens", "merges")]
    assert all(isinstance(t, StringTable) for t in tables)
    assert tables[0] == tokens and tables[1] == merges
    # Kept as Python lists (as the tokenizer once did), the strings cost ~190 bytes a token; as tables ~22, and the
    # token types list 8 more.
    assert kept < 50 * len(tokens), kept
    back = tokenizer_to_gguf(tok)
    assert back["tokenizer.ggml.tokens"] == tokens and back["tokenizer.ggml.merges"] == merges
    assert type(back["tokenizer.ggml.tokens"]) is list and type(back["tokenizer.ggml.merges"]) is list
    assert tok.decode(tok.encode("the quick brown fox")) == "the quick brown fox"


@pytest.mark.parametrize("key", ["tokens", "merges"])
def test_a_string_that_is_not_utf8_is_named(tmp_path, key):
    tokens, merges = byte_level_vocab(300)
    strings = {"tokens": list(tokens), "merges": list(merges)}
    strings[key][5] = strings[key][5].encode()[:1] + b"\xff"  # the writer takes bytes as they are
    with pytest.raises(ValueError, match=rf"GGUF tokenizer\.ggml\.{key}\[5\] is not valid UTF-8"):
        read_gguf_tokenizer(write(tmp_path / "bad.gguf", strings["tokens"], strings["merges"]))
