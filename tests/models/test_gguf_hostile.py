"""Hostile GGUF files (issue 27): each one is a valid tiny file written with ``gguf.GGUFWriter`` with one field then
corrupted in place, and ``read_gguf`` must refuse it with a ``ValueError`` that names the field, before decoding or
allocating anything; the "huge count" files are also loaded in a child process, which must fail fast with a bounded
peak RSS."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from models.gguf import read_gguf
from tests.models.test_gguf import spm_vocab, tiny_llama, write_gguf
from tokenization.gguf import tokenizer_from_gguf


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def valid(tmp_path_factory, model) -> Path:
    return write_gguf(tmp_path_factory.mktemp("hostile") / "valid.gguf", model)


def corrupt(valid: Path, tmp_path: Path, edit, name: str = "bad.gguf") -> Path:
    """A copy of ``valid`` with ``edit(reader)`` applied in place through ``gguf.GGUFReader`` in ``r+`` mode."""
    path = tmp_path / name
    path.write_bytes(valid.read_bytes())
    reader = gguf.GGUFReader(str(path), "r+")
    edit(reader)
    reader.data.flush()
    del reader
    return path


def tensor_part(reader, name: str, part: int):
    """A tensor description's part: 0 name length, 1 name bytes, 2 n_dims, 3 dims, 4 type, 5 offset."""
    return next(t for t in reader.tensors if t.name == name).field.parts[part]


def field_set(key: str, value, part: int = -1):
    def edit(reader):
        reader.fields[key].parts[part][0] = value
    return edit


def tensor_set(name: str, part: int, value, index: int = 0):
    def edit(reader):
        tensor_part(reader, name, part)[index] = value
    return edit


# --------------------------------------------------------------------------------------------- header counts
HUGE = {  # counts and lengths the file cannot hold; the first three made the old loader loop for hours
    "tensor_count": field_set("GGUF.tensor_count", 2**40),
    "kv_count": field_set("GGUF.kv_count", 2**40),
    "tokenizer.ggml.token_type array length": field_set("tokenizer.ggml.token_type", 2**40, part=4),
    "tokenizer.ggml.tokens array length": field_set("tokenizer.ggml.tokens", 2**40, part=4),
    "metadata general.architecture length": field_set("general.architecture", 2**62, part=3),
    "llama.block_count": field_set("llama.block_count", 10**9),
    "runs past the data section": tensor_set("token_embd.weight", 3, 2**40, index=1),
}


@pytest.mark.parametrize("field", list(HUGE))
def test_counts_the_file_cannot_hold_are_refused_by_name(valid, tmp_path, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        read_gguf(corrupt(valid, tmp_path, HUGE[field]))


CHILD = """
import json, resource, sys
from models.gguf import read_gguf
read_gguf(sys.argv[1])  # the valid file: imports and first-use allocations settle
settled = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
errors = []
for path in sys.argv[2:]:
    try:
        read_gguf(path)
        errors.append(None)
    except ValueError as err:
        errors.append(str(err))
print(json.dumps({"settled_kib": settled, "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "errors": errors}))
"""


def test_huge_counts_fail_fast_in_bounded_memory(valid, tmp_path):
    """In a child process (a hang is a timeout, not a stuck suite): every huge-count file is refused, and together
    they raise the process's peak RSS by less than 16 MiB over a valid load of the same 0.3 MB file."""
    paths = [str(corrupt(valid, tmp_path, edit, f"{i}.gguf")) for i, edit in enumerate(HUGE.values())]
    done = subprocess.run([sys.executable, "-c", CHILD, str(valid), *paths], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for field, error in zip(HUGE, report["errors"], strict=True):
        assert error is not None and field in error, (field, error)
    assert report["peak_kib"] - report["settled_kib"] < 16 * 1024, report


# --------------------------------------------------------------------------------------------- header structure
def test_truncated_header(valid, tmp_path):
    last = gguf.GGUFReader(str(valid)).tensors[-1].field.offset  # cut inside the last tensor's description
    path = tmp_path / "cut.gguf"
    path.write_bytes(valid.read_bytes()[:last + 20])
    fields = r"tensor #\d+.s (name|n_dims|dims|type|offset)"
    with pytest.raises(ValueError, match=rf"(ends inside {fields})|({fields}.* cannot be right)"):
        read_gguf(path)


def test_unknown_value_type_and_duplicate_key(valid, tmp_path):
    with pytest.raises(ValueError, match=r"llama\.context_length: value type 99 is unknown"):
        read_gguf(corrupt(valid, tmp_path, field_set("llama.context_length", 99, part=2)))

    def rename(reader):  # llama.context_lengtX -> llama.context_length: the same key twice
        reader.fields["llama.context_lengtX"].parts[1][-1] = ord("h")
    path = write_gguf(tmp_path / "dup.gguf", tiny_llama(), vocab=None,
                      metadata=[("add_uint32", "llama.context_lengtX", 5)])
    with pytest.raises(ValueError, match="'llama.context_length' appears twice"):
        read_gguf(corrupt(path, tmp_path, rename))


def test_nested_array_refused(tmp_path):
    path = write_gguf(tmp_path / "nested.gguf", tiny_llama(), vocab=None,
                      metadata=[("add_array", "general.nested", [[1, 2], [3]])])
    with pytest.raises(ValueError, match=r"general\.nested is an array of arrays"):
        read_gguf(path)


def test_tensor_name_not_utf8(valid, tmp_path):
    with pytest.raises(ValueError, match="not valid UTF-8"):
        read_gguf(corrupt(valid, tmp_path, tensor_set("output_norm.weight", 1, 0xFF)))


# --------------------------------------------------------------------------------------------- tensor layout
def test_offset_that_wraps_around_is_refused(valid, tmp_path):
    # data start + 2**64 - 32 wraps to 32 bytes before the data section in 64-bit arithmetic
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight': offset=18446744073709551584 .* runs past"):
        read_gguf(corrupt(valid, tmp_path, tensor_set("blk.0.attn_q.weight", 5, 2**64 - 32)))


def test_unaligned_offset_is_refused(valid, tmp_path):
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight': offset=\d+ is not a multiple of general\."
                                         r"alignment=32"):
        read_gguf(corrupt(valid, tmp_path, lambda r: tensor_part(r, "blk.0.attn_q.weight", 5).__iadd__(4)))


def test_overlapping_tensors_are_refused(valid, tmp_path):
    """Overlap is how a small file claims many parameters: every layer pointing at the same bytes."""
    def overlap(reader):
        tensor_part(reader, "blk.1.attn_q.weight", 5)[0] = tensor_part(reader, "blk.0.attn_q.weight", 5)[0]
    with pytest.raises(ValueError, match=r"'blk\.[01]\.attn_q\.weight' .* overlap"):
        read_gguf(corrupt(valid, tmp_path, overlap))


@pytest.mark.parametrize("part, index, value, message", [
    (3, 0, 0, r"dims \[0, 300\] .* must be positive"),
    (2, 0, 5, "n_dims=5, expected 1 to 4"),
    (4, 0, 999, "type id 999 is not a ggml type"),
    (4, 0, int(gguf.GGMLQuantizationType.Q4_K), "first a multiple of Q4_K's block of 256"),  # a row of 64
])
def test_bad_dims_and_types(valid, tmp_path, part, index, value, message):
    name = "output_norm.weight" if "Q4_K" in message else "token_embd.weight"
    with pytest.raises(ValueError, match=rf"'{name}'.*{message}"):
        read_gguf(corrupt(valid, tmp_path, tensor_set(name, part, value, index)))


# --------------------------------------------------------------------------------------------- metadata vs tensors
@pytest.mark.parametrize("key, value", [
    ("llama.block_count", 3),
    ("llama.block_count", 1),
    ("llama.embedding_length", 128),
    ("llama.feed_forward_length", 64),
    ("llama.attention.head_count", 8),
    ("llama.vocab_size", 301),
])
def test_sizes_that_disagree_with_the_tensors(valid, tmp_path, key, value):
    with pytest.raises(ValueError, match=rf"{key.replace('.', '[.]')}={value}"):
        read_gguf(corrupt(valid, tmp_path, field_set(key, value)))


@pytest.mark.parametrize("key, value, message", [
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), "finite positive"),
    ("llama.rope.freq_base", float("inf"), "finite positive"),
    ("tokenizer.ggml.bos_token_id", 10**6, "1000000"),
])
def test_numbers_a_model_cannot_use(valid, tmp_path, key, value, message):
    with pytest.raises(ValueError, match=rf"{key.replace('.', '[.]')}=.*{message}"):
        read_gguf(corrupt(valid, tmp_path, field_set(key, value)))


def test_split_parts_are_found_by_name_only(tmp_path):
    # A path in the metadata is never followed: the parts are the first part's siblings, named by the count.
    path = write_gguf(tmp_path / "m-00001-of-00002.gguf", tiny_llama(), vocab=None,
                      metadata=[("add_uint16", "split.count", 2), ("add_string", "split.path", "../../etc/x.gguf")])
    with pytest.raises(FileNotFoundError, match=r"m-00002-of-00002\.gguf"):
        read_gguf(path)
    renamed = path.rename(tmp_path / "model.gguf")
    with pytest.raises(ValueError, match=r"split\.count=2 .*-00001-of-00002\.gguf"):
        read_gguf(renamed)


def test_vocabulary_that_does_not_fit_the_embedding(tmp_path):
    tokens, scores, _ = spm_vocab(300)
    meta = [("add_string", "tokenizer.ggml.model", "llama"), ("add_array", "tokenizer.ggml.tokens", tokens[:299]),
            ("add_array", "tokenizer.ggml.scores", scores[:299])]
    path = write_gguf(tmp_path / "v.gguf", tiny_llama(), vocab=None, metadata=meta)
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.tokens has 299 entries; .* \(300\)"):
        read_gguf(path)


# --------------------------------------------------------------------------------------------- tokenizer lists
def test_tokenizer_lists_refused_by_name():
    tokens, scores, types = spm_vocab(300)
    base = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores}
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.tokens\[3\]=7"):
        tokenizer_from_gguf({**base, "tokenizer.ggml.tokens": tokens[:3] + [7] + tokens[4:]})
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.scores\[5\]=nan"):
        tokenizer_from_gguf({**base, "tokenizer.ggml.scores": scores[:5] + [float("nan")] + scores[6:]})
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.token_type\[0\]='x'"):
        tokenizer_from_gguf({**base, "tokenizer.ggml.token_type": ["x"] + types[1:]})
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.merges do not fit"):
        tokenizer_from_gguf({**base, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
                             "tokenizer.ggml.merges": ["nosuch token"]})
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.merges entry 5"):
        tokenizer_from_gguf({**base, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
                             "tokenizer.ggml.merges": [5]})
    with pytest.raises(ValueError, match=r"tokenizer\.huggingface\.json"):
        tokenizer_from_gguf({**base, "tokenizer.huggingface.json": "{not json"})


def test_long_piece_refused_before_merges_are_derived():
    """Deriving merges cuts every piece at every position: one 10**6-character piece would take ~10**12 steps."""
    tokens, scores, _ = spm_vocab(300)
    tokens = tokens[:299] + ["a" * 10**6]
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.tokens\[299\] is 1000000 characters long"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                             "tokenizer.ggml.scores": scores})
