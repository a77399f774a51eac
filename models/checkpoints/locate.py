"""Find a checkpoint: its ``config.json`` in a local folder or in one Hub commit, then the rest of its files.

``locate`` finds the config first, so a loader can refuse a wrong checkpoint before downloading its weights; it
serves model checkpoints and adapters alike (``config_name``). Every later file of a Hub checkpoint comes from the
very commit the config came from, so a push landing between two downloads cannot mix two checkpoints.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants, try_to_load_from_cache
from huggingface_hub.errors import (
    EntryNotFoundError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from .atomic import recover
from .files import (
    CHAT_TEMPLATE_NAME,
    CONFIG_NAME,
    PICKLE_WEIGHTS_NAME,
    TOKENIZER_CONFIG_NAME,
    TOKENIZER_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    CheckpointFiles,
    WeightsFormat,
    shard_names,
)
from .hub import append_to_message, hub_download, hub_unreachable, is_commit_sha, naming_the_repo
from .paths import confined


@dataclass(frozen=True)
class Location:
    """A checkpoint whose ``config.json`` has been found: a local ``folder``, or Hub ``repo_id`` at ``commit``.

    Finding the config first lets a loader refuse a wrong checkpoint before downloading its weights.

    Attributes:
        source: what the caller passed, for messages.
        config: the local path of the config file.
        folder: the local folder, or None on the Hub.
        repo_id: the Hub repository, or None for a folder.
        revision: the revision asked for.
        commit: the commit sha it resolved to (downloads use it, so a moving branch cannot mix commits).
        token: the Hub token.
        endpoint: the Hub URL.
    """

    source: str
    config: Path
    folder: Path | None = None
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None
    token: str | bool | None = None
    endpoint: str | None = None

    def fetch(self, filename: str) -> Path:
        """Download ``filename`` of the located commit into the ``huggingface_hub`` cache (Hub only).

        Transient server errors are retried (see ``hub_download``).

        Args:
            filename: the file's path in the repository.

        Returns:
            Its cached path.
        """
        assert self.repo_id is not None and self.commit is not None
        return hub_download(self.repo_id, filename, revision=self.commit, token=self.token, endpoint=self.endpoint)

    def fetch_optional(self, filename: str) -> Path | None:
        """``fetch``, or ``None`` when the file is not in the commit (or, offline, not in the cache).

        Args:
            filename: the file's path in the repository.

        Returns:
            Its cached path, or None.
        """
        try:
            return self.fetch(filename)
        except EntryNotFoundError as e:
            # Absent means "the Hub says there is no such file", or an offline cache miss; a server or network
            # failure is raised, never mistaken for an absent file (that would load a model without its tokenizer).
            offline = isinstance(e, LocalEntryNotFoundError) and (
                e.__cause__ is None or isinstance(e.__cause__, OfflineModeIsEnabled)
            )
            if isinstance(e, RemoteEntryNotFoundError) or offline:
                return None
            raise



def locate(
    path_or_repo_id: str | os.PathLike[str],
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
    config_name: str = CONFIG_NAME,
    kind: str = "checkpoint",
) -> Location:
    """Find a checkpoint's ``config.json`` (or another ``config_name``) in a local folder, or download it from a
    Hub repo. A local folder is first recovered from interrupted saves (``models.checkpoints.atomic.recover``).

    Args:
        path_or_repo_id: an existing folder, or a Hub repo id.
        revision: Hub branch, tag or commit (default ``"main"``); not allowed with a local folder.
        token: passed to ``huggingface_hub``.
        endpoint: passed to ``huggingface_hub``.
        config_name: the file that makes a folder one of these (``adapter_config.json`` for an adapter).
        kind: what is looked for, in messages (``"checkpoint"``, ``"adapter"``).

    Returns:
        Where the checkpoint is.

    Raises:
        TypeError: arguments of the wrong type.
        ValueError: ``revision`` given with a local folder, or a path that is a file, not a folder.
        FileNotFoundError: a local folder without ``config.json``, or a path-like string that does not exist.
        huggingface_hub.errors.RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError: from the
            Hub, with the repo and revision added to the message.
    """
    if not isinstance(path_or_repo_id, (str, os.PathLike)):
        raise TypeError(f"path_or_repo_id must be a folder path or a Hub repo id, got {type(path_or_repo_id).__name__}")
    if revision is not None and not isinstance(revision, str):
        raise TypeError(f"revision must be a branch, tag or commit string, got {type(revision).__name__}")
    path = Path(path_or_repo_id).expanduser()
    text = os.fspath(path_or_repo_id)
    path_like = isinstance(path_or_repo_id, os.PathLike) or text.startswith((".", "~", "/")) or text.count("/") > 1
    if path.exists() or path_like:
        recover(path)  # finish or discard what interrupted saves left, before looking at the folder
    if path.exists():
        if revision is not None:
            raise ValueError(f"revision={revision!r} only applies to Hub repos, but {path} is a local folder")
        if not path.is_dir():
            article = "an" if kind[:1] in tuple("aeiou") else "a"
            raise ValueError(f"{path} is a file; expected {article} {kind} folder (holding {config_name} and weights)")
        if not (path / config_name).is_file():
            raise FileNotFoundError(f"{path} has no {config_name}; it holds {sorted(p.name for p in path.iterdir())}")
        return Location(source=str(path), config=path / config_name, folder=path)
    if path_like:
        raise FileNotFoundError(f"no {kind} folder or file at {text}; check the path")
    check_hub_id(text, kind)
    wanted = revision or "main"
    hub = Location(source=f"{text}@{wanted}", config=Path(), repo_id=text, revision=wanted, commit=wanted,
                   token=token, endpoint=endpoint)
    if not constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(text, config_name, revision=wanted), str):
        where = hub_unreachable(endpoint)
        if where is not None:  # say so at once, not after huggingface_hub's retries
            raise LocalEntryNotFoundError(
                f"no local folder {text!r}, and the Hub cannot be reached to download it ({where}); check the path "
                f"(./{text} for a folder here) or the network (HF_ENDPOINT, HF_HUB_OFFLINE=1 for the cache alone)"
            )
    with naming_the_repo(hub.repo_id, hub.revision):
        config = hub.fetch(config_name)
    # The cache keeps files under snapshots/<commit>/: every later file comes from that very commit, so a push
    # landing between two downloads cannot mix two checkpoints.
    commit = config.parent.name if is_commit_sha(config.parent.name) else wanted
    return dataclasses.replace(hub, config=config, commit=commit)


def check_hub_id(text: str, kind: str = "checkpoint") -> None:
    """Refuse a name that is neither a local path (it does not exist) nor a Hub repo id ``OWNER/NAME``, at once.

    Args:
        text: the name given.
        kind: what is looked for, in messages (``"checkpoint"``, ``"adapter"``).

    Raises:
        FileNotFoundError: a name without an owner (``my-model``; the Hub's unprefixed legacy ids such as ``gpt2``
            now live under an owner, ``openai-community/gpt2``), or one ``huggingface_hub`` refuses as an id.
    """
    if "/" not in text:
        raise FileNotFoundError(
            f"no {kind} folder or file named {text!r} in {Path.cwd()}, and {text!r} is not a Hub id (OWNER/NAME, "
            "e.g. HuggingFaceTB/SmolLM2-135M); check the path"
        )
    try:
        validate_repo_id(text)
    except HFValidationError as err:
        raise FileNotFoundError(f"no {kind} folder or file at {text}, and {text!r} is not a Hub id: "
                                f"{str(err).splitlines()[0]}") from None


def checkpoint_files(location: Location) -> CheckpointFiles:
    """The weights (``model.safetensors``, else the shards of ``model.safetensors.index.json``, else
    ``pytorch_model.bin``) and the optional ``tokenizer.json`` of a located checkpoint, downloaded if on the Hub.

    Args:
        location: from ``locate``.

    Returns:
        The files' local paths.

    Raises:
        FileNotFoundError: a local folder without weights, or without a shard its index names.
        ValueError: a malformed shard index.
        huggingface_hub.errors.EntryNotFoundError: a Hub repo without weights (repo and revision named).
    """
    if location.folder is not None:
        return _local_files(location)
    with naming_the_repo(location.repo_id, location.revision):
        weights, weights_format, index = _fetch_weights(location)
        tokenizer = location.fetch_optional(TOKENIZER_NAME)
        if tokenizer is not None:  # these land beside tokenizer.json in the snapshot
            location.fetch_optional(TOKENIZER_CONFIG_NAME)
            location.fetch_optional(CHAT_TEMPLATE_NAME)
    return CheckpointFiles(
        source=location.source, config=location.config, weights=weights, weights_format=weights_format,
        index=index, tokenizer=tokenizer, commit=location.commit,
    )


def resolve_checkpoint(
    path_or_repo_id: str | os.PathLike[str],
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
) -> CheckpointFiles:
    """``locate`` then ``checkpoint_files``: every file of a checkpoint, local or downloaded.

    Args:
        path_or_repo_id: a local folder or a Hub repository id.
        revision: Hub branch, tag or commit.
        token: passed to ``huggingface_hub``.
        endpoint: passed to ``huggingface_hub``.

    Returns:
        The files' local paths.
    """
    return checkpoint_files(locate(path_or_repo_id, revision=revision, token=token, endpoint=endpoint))


def _local_files(location: Location) -> CheckpointFiles:
    folder = location.folder
    assert folder is not None
    tokenizer = folder / TOKENIZER_NAME
    common = dict(source=location.source, config=location.config, tokenizer=tokenizer if tokenizer.is_file() else None)
    if (folder / WEIGHTS_NAME).is_file():
        return CheckpointFiles(weights=(folder / WEIGHTS_NAME,), weights_format="safetensors", **common)
    index = folder / WEIGHTS_INDEX_NAME
    if index.is_file():
        shards = _shards(index)
        absent = [s.name for s in shards if not s.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names shards that are not in {folder}: {absent}")
        return CheckpointFiles(weights=shards, weights_format="sharded", index=index, **common)
    if (folder / PICKLE_WEIGHTS_NAME).is_file():
        return CheckpointFiles(weights=(folder / PICKLE_WEIGHTS_NAME,), weights_format="pickle", **common)
    raise FileNotFoundError(
        f"{folder} has no weights: expected {WEIGHTS_NAME}, {WEIGHTS_INDEX_NAME} or {PICKLE_WEIGHTS_NAME} "
        f"(other pickles such as .pt/.ckpt are never loaded); it holds {sorted(p.name for p in folder.iterdir())}"
    )


def _fetch_weights(location: Location) -> tuple[tuple[Path, ...], WeightsFormat, Path | None]:
    single = location.fetch_optional(WEIGHTS_NAME)
    if single is not None:
        return (single,), "safetensors", None
    index = location.fetch_optional(WEIGHTS_INDEX_NAME)
    if index is not None:
        _shards(index)  # every name checked before the first shard is downloaded
        return tuple(location.fetch(name) for name in shard_names(index)), "sharded", index
    try:
        return (location.fetch(PICKLE_WEIGHTS_NAME),), "pickle", None
    except EntryNotFoundError as e:
        append_to_message(
            e, f"\nno weights found: looked for {WEIGHTS_NAME}, {WEIGHTS_INDEX_NAME} and {PICKLE_WEIGHTS_NAME}"
        )
        raise


def _shards(index: Path) -> tuple[Path, ...]:
    """The shard files a ``model.safetensors.index.json`` names, each confined to the index's folder.

    A shard may itself be a link the folder holds (a Hugging Face cache snapshot links every file into its
    ``blobs``), but a name cannot lead out of the folder.

    Raises:
        ValueError: a malformed index, or a name that leads outside the folder (quoted).
    """
    return tuple(
        confined(index.parent, name, f"the weight_map of {index}", file_may_link=True)
        for name in shard_names(index)
    )
