"""sentence-transformers folders: read on load (``models.from_pretrained``), written by ``save_sentence_transformers``.

A sentence-transformers model is a list of modules on disk (``modules.json``): a ``Transformer`` whose
``config.json``, weights and tokenizer sit at the folder's root, a ``Pooling`` (``1_Pooling/config.json``), an
optional ``Normalize``; ``sentence_bert_config.json`` holds the maximum sequence length and
``config_sentence_transformers.json`` the prompts. The zoo loads such a folder as its transformer with an
``embedding`` head whose options are the pooling, normalisation, maximum length and prompts, and writes the same
layout back (the classic one, which every sentence-transformers version since 2 reads).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import nn

from ..convert.tasks import export_base
from ..core.finite import check_finite
from .files import MAX_JSON_DEPTH, json_depth
from .paths import confined

MODULES_NAME = "modules.json"
#: sentence-transformers pooling modes -> the zoo's poolings.
POOLINGS = {"cls": "cls", "mean": "mean", "max": "max", "mean_sqrt_len_tokens": "mean_sqrt_len", "lasttoken": "last"}
#: the legacy boolean keys of ``1_Pooling/config.json``.
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


def located_json(location: Any, name: str) -> Any:
    """A JSON file of a located folder or Hub commit (``models.checkpoints.locate.Location``), None when absent;
    the name stays inside the folder and the nesting is bounded as for every checkpoint file."""
    name = name.lstrip("/")
    if location.folder is not None:
        path = confined(location.folder, name, f"the sentence-transformers file {name!r}", file_may_link=True)
        if not path.is_file():
            return None
    else:
        path = location.fetch_optional(name)
        if path is None:
            return None
    try:
        text = Path(path).read_text(encoding="utf-8")
        if json_depth(text) > MAX_JSON_DEPTH:
            raise ValueError(f"nests JSON deeper than {MAX_JSON_DEPTH} levels")
        return json.loads(text)
    except (ValueError, RecursionError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err


def read_sentence_folder(read_json: Callable[[str], Any | None], source: str) -> dict[str, Any] | None:
    """The ``embedding`` head options of a sentence-transformers folder, or None when it has no ``modules.json``.

    Args:
        read_json: a file's parsed JSON by its path inside the folder or repo (None when absent).
        source: the folder or repo, for messages.

    Raises:
        ValueError: modules the zoo does not compute (a ``Dense`` layer, weighted-mean pooling, several poolings,
            a transformer outside the folder's root, a pooling that excludes the prompt), named.
    """
    modules = read_json(MODULES_NAME)
    if modules is None:
        return None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{source}: {MODULES_NAME} must be a list of module entries, got {modules!r}")
    options: dict[str, Any] = {"pooling": "cls", "normalize": False}
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = str(module.get("path", ""))
        if kind == "Transformer":
            if path not in ("", "."):
                raise ValueError(f"{source}: the Transformer module sits in {path!r}; the zoo reads it at the root")
        elif kind == "Pooling":
            options["pooling"] = pooling_mode(read_json(f"{path}/config.json") or {}, source)
        elif kind == "Normalize":
            options["normalize"] = True
        else:
            raise ValueError(f"{source}: sentence-transformers module {module.get('type')!r} has no zoo counterpart")
    bert_config = read_json("sentence_bert_config.json") or {}
    tokenizer_config = read_json("tokenizer_config.json") or {}
    max_length = bert_config.get("max_seq_length") or tokenizer_config.get("model_max_length")
    if isinstance(max_length, int) and not isinstance(max_length, bool) and 0 < max_length < 10**6:
        options["max_seq_length"] = max_length
    if bert_config.get("do_lower_case"):
        raise ValueError(f"{source}: do_lower_case=True in sentence_bert_config.json is not supported")
    st_config = read_json("config_sentence_transformers.json") or {}
    if st_config.get("prompts"):
        options["prompts"] = dict(st_config["prompts"])
        if st_config.get("default_prompt_name") is not None:
            options["default_prompt_name"] = st_config["default_prompt_name"]
    return options


def pooling_mode(config: dict[str, Any], source: str) -> str:
    """The zoo pooling of a ``1_Pooling/config.json`` (current or legacy keys).

    Raises:
        ValueError: no mode, several, one the zoo lacks, or ``include_prompt`` False.
    """
    mode = config.get("pooling_mode")
    modes = [mode] if isinstance(mode, str) else list(mode) if isinstance(mode, list) else []
    if not modes:
        modes = [name for key, name in LEGACY_POOLING_KEYS.items() if config.get(key)]
    if len(modes) != 1 or modes[0] not in POOLINGS:
        raise ValueError(
            f"{source}: pooling {modes} is not supported; the zoo pools with exactly one of {sorted(POOLINGS)}"
        )
    if config.get("include_prompt", True) is not True:
        raise ValueError(f"{source}: include_prompt=False (pooling without the prompt tokens) is not supported")
    return POOLINGS[modes[0]]


def save_sentence_transformers(model: nn.Module, directory: str | os.PathLike[str]) -> Path:
    """Write ``model`` (a text model; its ``embedding`` head's options, or mean pooling) and its tokenizer as a
    sentence-transformers folder that ``SentenceTransformer(directory)`` loads.

    Raises:
        ValueError: no tokenizer attached, a base no ``transformers`` family represents, or a tensor holding NaN or
            inf (named); nothing is written then.
    """
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("a sentence-transformers folder needs the tokenizer: set model.tokenizer first")
    options = model.embedding_options()
    hf_config, state = export_base(model)
    check_finite(state, "sentence-transformers export")
    path = Path(directory)
    (path / "1_Pooling").mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    write(path / "config.json", hf_config)
    tokenizer.save(path / "tokenizer.json")
    max_length = options.get("max_seq_length") or model.config.max_len
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    write(path / "tokenizer_config.json", {**tokenizer_config, "model_max_length": max_length})
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    mode = {zoo: st for st, zoo in POOLINGS.items()}[options.get("pooling", "mean")]
    pooling = {"word_embedding_dimension": model.config.d_model, "include_prompt": True,
               **{key: name == mode for key, name in LEGACY_POOLING_KEYS.items()}}
    write(path / "1_Pooling" / "config.json", pooling)
    if options.get("normalize"):
        (path / "2_Normalize").mkdir(exist_ok=True)
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    write(path / "modules.json", modules)
    write(path / "sentence_bert_config.json", {"max_seq_length": max_length, "do_lower_case": False})
    write(path / "config_sentence_transformers.json", {
        "prompts": dict(options.get("prompts") or {}), "default_prompt_name": options.get("default_prompt_name"),
        "similarity_fn_name": "cosine",
    })
    return path


def write(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
