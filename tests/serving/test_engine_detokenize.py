"""Incremental detokenization: the engine decodes a small window of each output per step, and the text it builds
(and streams) equals decoding the whole output — for a byte-level BPE (GPT-2 style) and SentencePiece-style
tokenizers (``▁`` spaces; byte fallback), on text with multi-byte characters split across tokens."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, normalizers
from tokenizers import models as tokenizer_models

from models import DecoderLM
from serving import Engine
from serving.requests import IncrementalText
from tokenization import Tokenizer
from tokenization.trainers import train_bpe, train_byte_level_bpe

TEXTS = ["Grüße aus Köln — naïve café ☃ 日本語のテキスト 🙂👍🏽 done.", "ça va? 你好, мир! e\u0301 🇫🇷 ok",
         "plain ascii words and spaces   here"]


def sentencepiece_byte_fallback() -> Tokenizer:
    """Llama's layout: ``▁`` for spaces, ASCII pieces, every other character as its UTF-8 bytes ``<0xNN>``, and the
    decoder Replace(▁) → ByteFallback → Fuse → Strip(one leading space)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", *map(chr, range(33, 127)), "▁a", "▁c", "an", "▁t"]:
        vocab.setdefault(piece, len(vocab))
    backend = Backend(tokenizer_models.BPE(vocab, [("▁", "a"), ("▁", "c"), ("a", "n"), ("▁", "t")], unk_token="<unk>",
                                 byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = None
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return Tokenizer(backend, {"unk": "<unk>", "bos": "<s>", "eos": "</s>", "pad": None, "mask": None})


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Tokenizer]:
    corpus = TEXTS * 3
    return {"byte-level BPE": train_byte_level_bpe(corpus, vocab_size=300, min_frequency=1),
            "sentencepiece (byte fallback)": sentencepiece_byte_fallback(),
            "sentencepiece (metaspace BPE)": train_bpe(corpus, vocab_size=200, min_frequency=1, unicode_form=None)}


class Counting:
    """A tokenizer wrapper that records how many ids each decode call gets."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("name", ["byte-level BPE", "sentencepiece (byte fallback)", "sentencepiece (metaspace BPE)"])
def test_incremental_text_equals_the_full_decode(tokenizers: dict[str, Tokenizer], name: str) -> None:
    tok = tokenizers[name]
    g = torch.Generator().manual_seed(0)
    sequences = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    sequences += [torch.randint(0, tok.vocab_size, (60,), generator=g).tolist() for _ in range(3)]  # invalid bytes too
    # Decoding token by token is wrong for each of them (characters split into bytes, or spaces dropped as the
    # first token's): what a window decode must get right.
    assert "".join(tok.decode([i]) for i in sequences[0]) != tok.decode(sequences[0])
    for ids in sequences:
        counting = Counting(tok)
        text = IncrementalText(counting)
        streamed = ""
        valid = ids in sequences[: len(TEXTS)]
        for token in ids:
            streamed += text.add([token])
            assert streamed == text.text
            if valid or "fallback" not in name:  # byte fallback rewrites a character invalid bytes follow
                assert tok.decode(ids).startswith(text.text)  # streamed text is never taken back
        assert text.finish() == tok.decode(ids)
        if valid:
            assert text.text == tok.decode(ids) == TEXTS[sequences.index(ids)]
            assert max(counting.lengths[:-1]) <= 12  # a window, never the whole output (but in finish)


def test_engine_text_and_streamed_deltas_equal_the_decoded_output(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["byte-level BPE"]
    torch.manual_seed(0)
    model = DecoderLM.from_preset("tiny", dropout=0.0, vocab_size=tok.vocab_size).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    engine = Engine(model, tok, block_size=4)
    ids = [engine.add_request(t, max_tokens=40) for t in TEXTS[:2]]
    streamed = {i: "" for i in ids}
    while engine.has_unfinished():
        for delta in engine.step():
            streamed[delta.request_id] += delta.text
    for i in ids:
        out = engine.pop_output(i)
        kept = [t for t in out.token_ids if t != model.config.eos_token_id]
        assert out.text == streamed[i] == tok.decode(kept)
        assert len(out.token_ids) > 10
    assert any(127 < ord(c) != 0xFFFD for i in ids for c in streamed[i])  # bytes joined into characters
