"""sentence-transformers folders: read on load (``models.from_pretrained``), written by ``save_sentence_transformers``.

A sentence-transformers model is a list of modules on disk (``modules.json``): a ``Transformer`` whose
``config.json``, weights and tokenizer sit at the folder's root, a ``Pooling`` (``1_Pooling/config.json``), an
optional ``Normalize``; ``sentence_bert_config.json`` holds the maximum sequence length and
``config_sentence_transformers.json`` the prompts. The zoo loads such a folder as its transformer with an
``embedding`` head whose options are the pooling, normalisation, maximum length and prompts, and writes the same
layout back (the classic one, which every sentence-transformers version since 2 reads).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import nn

from ..convert.tasks import export_base
from ..core.finite import check_finite
from .atomic import replace_folder, staging_folder
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
    the name stays inside the folder and the nesting is bounded as for every checkpoint file.

    Args:
        location: the located folder or Hub commit.
        name: the file's path inside it.

    Returns:
        The parsed JSON value, or None when the file is absent.

    Raises:
        ValueError: the file is not valid JSON or nests deeper than ``MAX_JSON_DEPTH``.
    """
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

    Every file is read strictly: a file that is not the JSON type sentence-transformers writes (an object, or the
    list of ``modules.json``), an entry of the wrong type, or a setting the zoo would read differently is refused
    with the file and the field named, never read as a default.

    Args:
        read_json: a file's parsed JSON by its path inside the folder or repo (None when absent).
        source: the folder or repo, for messages.

    Returns:
        The head options; a maximum length taken from ``tokenizer_config.json`` (not ``sentence_bert_config.json``)
        is under ``model_max_length``, for ``fit_sentence_options`` to cap at the model's positions.

    Raises:
        ValueError: modules the zoo does not compute (a ``Dense`` layer, weighted-mean pooling, several poolings,
            a transformer outside the folder's root, a pooling that excludes the prompt), no Transformer or no
            Pooling module, a file of the wrong JSON type, ``prompts`` not an object of strings, a
            ``max_seq_length`` that is not a positive integer; each named.
    """
    modules = read_json(MODULES_NAME)
    if modules is None:
        return None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{source}: {MODULES_NAME} must be a list of module entries, got {modules!r}")
    options: dict[str, Any] = {"normalize": False}
    kinds: list[str] = []
    for module in modules:
        kind, path = module.get("type"), module.get("path", "")
        if not isinstance(kind, str) or not isinstance(path, str):
            raise ValueError(f"{source}: {MODULES_NAME} entry {module!r} must have a string 'type' and 'path'")
        kind = kind.rsplit(".", 1)[-1]
        kinds.append(kind)
        if kind == "Transformer":
            if path not in ("", "."):
                raise ValueError(f"{source}: the Transformer module sits in {path!r}; the zoo reads it at the root")
        elif kind == "Pooling":
            options["pooling"] = pooling_mode(json_object(read_json, f"{path}/config.json", source), source)
        elif kind == "Normalize":
            options["normalize"] = True
        else:
            raise ValueError(f"{source}: sentence-transformers module {module.get('type')!r} has no zoo counterpart")
    if kinds.count("Transformer") != 1 or kinds.count("Pooling") != 1 or kinds[0] != "Transformer":
        raise ValueError(f"{source}: {MODULES_NAME} lists the modules {kinds}; the zoo reads a Transformer first, "
                         "then exactly one Pooling (and an optional Normalize)")
    bert_config = json_object(read_json, "sentence_bert_config.json", source)
    tokenizer_config = json_object(read_json, "tokenizer_config.json", source)
    max_length = bert_config.get("max_seq_length")
    if max_length is not None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"{source}: sentence_bert_config.json has max_seq_length={max_length!r}; expected a "
                             "positive integer")
        options["max_seq_length"] = max_length
    else:
        fallback = tokenizer_config.get("model_max_length")
        if isinstance(fallback, int) and not isinstance(fallback, bool) and fallback > 0:
            options["model_max_length"] = fallback
    if bert_config.get("do_lower_case"):
        raise ValueError(f"{source}: do_lower_case=True in sentence_bert_config.json is not supported")
    st_config = json_object(read_json, "config_sentence_transformers.json", source)
    prompts = st_config.get("prompts")
    if prompts is not None and not (
        isinstance(prompts, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items())
    ):
        raise ValueError(f"{source}: config_sentence_transformers.json has prompts={prompts!r}; expected an object "
                         "mapping prompt names to prompt texts")
    if prompts:
        options["prompts"] = dict(prompts)
        default = st_config.get("default_prompt_name")
        if default is not None:
            if default not in prompts:
                raise ValueError(f"{source}: config_sentence_transformers.json has default_prompt_name={default!r}; "
                                 f"expected one of the prompts {sorted(prompts)}")
            options["default_prompt_name"] = default
    return options


def json_object(read_json: Callable[[str], Any | None], name: str, source: str) -> dict[str, Any]:
    """The JSON object of file ``name`` (``{}`` when absent).

    Args:
        read_json: a file's parsed JSON by its path inside the folder or repo (None when absent).
        name: the file.
        source: the folder or repo, for messages.

    Returns:
        The object.

    Raises:
        ValueError: the file holds another JSON type (a list, a string ...), naming the file.
    """
    data = read_json(name)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{source}: {name} must hold a JSON object, got {type(data).__name__} {data!r:.80}")
    return data


def fit_sentence_options(options: dict[str, Any], max_len: int) -> dict[str, Any]:
    """The head options of ``read_sentence_folder`` for a model of ``max_len`` positions: a maximum length from
    ``tokenizer_config.json`` is capped at ``max_len`` as sentence-transformers does (an explicit
    ``max_seq_length`` beyond the positions is refused by the model's config).

    Args:
        options: ``read_sentence_folder``'s options.
        max_len: the model's positions.

    Returns:
        The head options (without ``model_max_length``).
    """
    options = dict(options)
    fallback = options.pop("model_max_length", None)
    if fallback is not None and "max_seq_length" not in options:
        options["max_seq_length"] = min(fallback, max_len)
    return options


def pooling_mode(config: dict[str, Any], source: str) -> str:
    """The zoo pooling of a ``1_Pooling/config.json`` (current or legacy keys).

    Args:
        config: the parsed ``1_Pooling/config.json``.
        source: names the folder in messages.

    Returns:
        The zoo pooling's name.

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

    The folder is written atomically, even if the process is killed: it is staged beside ``directory`` and replaces
    it as a whole (``models.checkpoints.atomic.replace_folder``), so a reader sees the old folder or the new one;
    the other files of an old folder are carried over (hard links).

    Args:
        model: the text model, with its tokenizer attached.
        directory: the folder to write (created with its parents if needed).

    Returns:
        The folder's path.

    Raises:
        ValueError: no tokenizer attached, a base no ``transformers`` family represents, or a tensor holding NaN or
            inf (named); nothing is written then.
        NotADirectoryError: ``directory`` exists and is not a folder (nothing is written).
    """
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("a sentence-transformers folder needs the tokenizer: set model.tokenizer first")
    options = model.embedding_options()
    hf_config, state = export_base(model)
    check_finite(state, "sentence-transformers export")
    path = Path(directory)
    target = path.expanduser().resolve()  # leftovers of killed saves are found beside the real folder
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"cannot save a sentence-transformers folder to {target}: it is not a folder")
    with staging_folder(target) as staging:
        _write_files(staging, model, tokenizer, options, hf_config, state)
        keep_other_files(target, staging)
        replace_folder(staging, target)
    return path


def _write_files(path: Path, model: nn.Module, tokenizer: Any, options: dict[str, Any], hf_config: dict[str, Any],
                 state: dict[str, Any]) -> None:
    """Every file of the sentence-transformers folder, written into the (staging) folder ``path``."""
    (path / "1_Pooling").mkdir()
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
        (path / "2_Normalize").mkdir()
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    write(path / "modules.json", modules)
    write(path / "sentence_bert_config.json", {"max_seq_length": max_length, "do_lower_case": False})
    write(path / "config_sentence_transformers.json", {
        "prompts": dict(options.get("prompts") or {}), "default_prompt_name": options.get("default_prompt_name"),
        "similarity_fn_name": "cosine",
    })


def keep_other_files(target: Path, staging: Path) -> None:
    """Hard-link (or copy) into ``staging`` what ``target`` holds that the new folder does not write, so that
    replacing ``target`` by ``staging`` keeps the user's other files.

    Args:
        target: the folder being replaced (need not exist).
        staging: the new folder, complete.
    """
    if not target.is_dir():
        return
    for entry in sorted(target.iterdir()):
        if os.path.lexists(staging / entry.name):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry), staging / entry.name)
        elif entry.is_dir():
            shutil.copytree(entry, staging / entry.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, staging / entry.name)


def _link_or_copy(source: str | os.PathLike[str], destination: str | os.PathLike[str]) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def write(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON with a trailing newline.

    Args:
        path: the file to write.
        data: the JSON value.
    """
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


@contextlib.contextmanager
def unused_by_sentence_models(quiet: bool) -> Iterator[None]:
    """Inside, with ``quiet``: no warning that the base model's pooler or LM head is left out — a
    sentence-transformers model pools with its own modules and never uses them.

    Args:
        quiet: silence those warnings (False: a no-op).

    Yields:
        Nothing; the warnings are filtered while inside.
    """
    if not quiet:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*leaving out the pooler")
        warnings.filterwarnings("ignore", message=r".*base-model checkpoint has no LM head")
        warnings.filterwarnings("ignore", message=r".*the 'embedding' head does not use the checkpoint's")
        yield
