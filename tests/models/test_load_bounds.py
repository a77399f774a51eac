"""Sizes bounded before allocation: a checkpoint whose config claims more than its weights hold is refused.

Each hostile checkpoint is built the way an attacker builds it: a valid tiny checkpoint written by the real writer
(``save_pretrained`` of the zoo, or of ``transformers``), then one ``config.json`` field set to a huge value. The
loader must raise ``ValueError`` naming the field before it builds the model (no allocator error, no hang), and the
memory a refused load takes is measured in a child process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # a dev dependency: missing, the suite must fail here, not skip

import models
from models import DecoderLM, EncoderLM, Seq2SeqTransformer
from models.checkpoints.architectures import get_architecture
from models.convert.registry import build_bounded

TINY = dict(vocab_size=100, d_model=32, n_heads=2, d_ff=64, max_len=64)


def edit_config(folder: Path, path: tuple[str, ...], value: Any) -> None:
    """Set one field of ``folder/config.json`` (``path`` walks nested objects)."""
    raw = json.loads((folder / "config.json").read_text())
    node = raw
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    (folder / "config.json").write_text(json.dumps(raw))


def zoo_checkpoint(folder: Path, cls: type = DecoderLM, **fields: Any) -> Path:
    cls(cls.config_class(**{**TINY, **fields})).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("cls", "fields", "field", "value"),
    [
        (DecoderLM, {"n_layers": 2}, "vocab_size", 10**12),
        (DecoderLM, {"n_layers": 2}, "d_ff", 10**9),
        (DecoderLM, {"n_layers": 2}, "n_layers", 10**6),  # without the layer check even a meta build runs for hours
        (EncoderLM, {"n_layers": 1}, "type_vocab_size", 10**11),
        # a non-persistent buffer (the sinusoid table) sized by the config alone
        (Seq2SeqTransformer, {"n_encoder_layers": 1, "n_decoder_layers": 1}, "max_len", 10**9),
        (Seq2SeqTransformer, {"n_encoder_layers": 1, "n_decoder_layers": 1}, "n_decoder_layers", 10**6),
    ],
)
def test_zoo_config_claiming_more_than_its_weights_is_refused(
    tmp_path: Path, cls: type, fields: dict[str, Any], field: str, value: int
) -> None:
    folder = zoo_checkpoint(tmp_path / "ckpt", cls, **fields)
    edit_config(folder, ("config", field), value)
    with pytest.raises(ValueError, match=rf"\b{field}={value}\b"):
        models.from_pretrained(folder)


def test_fewer_layers_than_stored_are_named_too(tmp_path: Path) -> None:
    folder = zoo_checkpoint(tmp_path / "ckpt", n_layers=3)
    edit_config(folder, ("config", "n_layers"), 2)
    with pytest.raises(ValueError, match=r"n_layers=2, but the checkpoint stores 3 layers"):
        DecoderLM.from_pretrained(folder)


def hf_checkpoint(folder: Path, family: str) -> Path:
    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64,
        )
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
    else:
        config = transformers.BertConfig(
            vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=32,
        )
        transformers.BertForMaskedLM(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("family", "field", "value", "named"),
    [
        ("llama", "vocab_size", 10**12, "vocab_size=1000000000000"),
        ("llama", "intermediate_size", 10**9, "intermediate_size=1000000000"),
        ("llama", "num_hidden_layers", 10**6, "num_hidden_layers=1000000"),
        ("bert", "vocab_size", 10**12, "vocab_size=1000000000000"),
        ("bert", "max_position_embeddings", 10**9, "max_position_embeddings=1000000000"),
        ("bert", "num_hidden_layers", 10**6, "num_hidden_layers=1000000"),
    ],
)
def test_transformers_config_claiming_more_than_its_weights_is_refused(
    tmp_path: Path, family: str, field: str, value: int, named: str
) -> None:
    folder = hf_checkpoint(tmp_path / "ckpt", family)
    edit_config(folder, (field,), value)
    with pytest.raises(ValueError, match=named):
        models.from_pretrained(folder)


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("DecoderLM", {"n_layers": 2}),
        ("DecoderLM", {"n_layers": 1, "positional": "sinusoidal"}),
        ("EncoderLM", {"n_layers": 1}),
        ("Seq2SeqTransformer", {"n_encoder_layers": 1, "n_decoder_layers": 2}),
        ("VisionTransformer", {"n_layers": 1, "d_model": 32, "n_heads": 2, "d_ff": 64}),
    ],
)
def test_the_meta_build_has_the_real_shapes(name: str, fields: dict[str, Any]) -> None:
    """The bounded meta build (which skips initialisation) builds every parameter and buffer the real one does."""
    cls = get_architecture(name)
    config = cls.config_class(**({**TINY, **fields} if name != "VisionTransformer" else fields))
    real = cls(config)
    meta = build_bounded(cls, config, real.state_dict())
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in [*real.named_parameters(), *real.named_buffers()]}
    assert {k: (tuple(v.shape), v.dtype) for k, v in [*meta.named_parameters(), *meta.named_buffers()]} == shapes


# ---------------------------------------------------------------------------------------------- memory
#: a refused load may take at most this much more memory (peak RSS) than loading the valid checkpoint
RSS_BOUND_MIB = 100
CHILD = textwrap.dedent('''
    import resource, subprocess, sys
    load = """
    import sys, models
    try:
        models.from_pretrained(sys.argv[1])
    except ValueError as e:
        print("refused:", e)
    """
    for folder in sys.argv[1:]:  # the valid checkpoint first: ru_maxrss of children is the peak over all of them
        done = subprocess.run([sys.executable, "-c", load, folder], capture_output=True, text=True)
        print(done.stdout + done.stderr, file=sys.stderr)
        print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
''')


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux")
def test_a_huge_vocabulary_claim_allocates_nothing(tmp_path: Path) -> None:
    """A ~30 KB checkpoint claiming a 5M vocabulary (a 640 MB embedding if built) is refused within the bound.

    Peak RSS is measured by a wrapper process over two children, loading the valid checkpoint then the hostile one
    (so no other child of the test process counts): the second figure is the peak of both.
    """
    valid = zoo_checkpoint(tmp_path / "valid", n_layers=1, tie_embeddings=True)
    hostile = zoo_checkpoint(tmp_path / "hostile", n_layers=1, tie_embeddings=True)
    edit_config(hostile, ("config", "vocab_size"), 5_000_000)
    done = subprocess.run([sys.executable, "-c", CHILD, str(valid), str(hostile)], capture_output=True, text=True)
    assert "refused: " in done.stderr and "vocab_size=5000000" in done.stderr, done.stderr
    baseline, both = (int(kib) / 1024 for kib in done.stdout.split())
    assert both - baseline < RSS_BOUND_MIB, (baseline, both)
