"""Hub transport through ``huggingface_hub``: downloads into its cache with transient errors retried, and one
upload path (a folder written by the caller, pushed in one commit) for models and adapters alike.
"""

from __future__ import annotations

import logging
import socket
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub import CommitOperationAdd, HfApi, constants, get_session, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import validate_repo_id

from .atomic import staging_folder
from .files import LIBRARY_NAME, library_version
from .paths import check_commit, check_etag, confined

if TYPE_CHECKING:
    from huggingface_hub import CommitInfo

logger = logging.getLogger(__name__)

# hf_hub_download already retries the metadata request (HEAD) on 5xx and network errors with http_backoff, and
# resumes a download cut by a network error, but it does not retry the download request (GET) on a 5xx, and a
# metadata request that keeps failing surfaces as LocalEntryNotFoundError ("... cannot find the requested files in
# the local cache"), which hides the status. hub_download adds the missing retry, with http_backoff's schedule
# (1, 2, 4, 8, 8 s; attributes below, so tests can shorten it), around the whole cached download, and reports a
# persistent failure as the server's own error.
HUB_RETRIES = 5
HUB_RETRY_WAIT_S = 1.0
HUB_RETRY_MAX_WAIT_S = 8.0
TRANSIENT_STATUS = (408, 429, 500, 502, 503, 504)  # huggingface_hub's http_backoff default


def hub_download(
    repo_id: str, filename: str, *, revision: str, token: str | bool | None = None, endpoint: str | None = None
) -> Path:
    """``hf_hub_download`` into the cache, retrying transient server errors, reporting the real failure.

    Args:
        repo_id: the Hub repository, as for ``huggingface_hub.hf_hub_download``.
        filename: the file in it.
        revision: branch, tag or commit.
        token: the Hub token (None: ``huggingface_hub``'s own places).
        endpoint: the Hub's URL (None: ``huggingface_hub``'s default).

    Returns:
        The cached file's path.

    The cache names files after the ETag and commit id the server sends, so a hostile server could otherwise make
    ``huggingface_hub`` write outside the cache: the metadata answers it receives are checked as they arrive, before
    it reads them (``check_metadata``), and the revision before anything is asked.

    Raises:
        ValueError: the server sent an ETag or commit id that is not hex, or ``revision`` would name a cache
            file outside the cache (the value is quoted).
        huggingface_hub.errors.HfHubHTTPError: the Hub kept answering an error status (the status is in the
            message and in ``.response.status_code``), or answered a non-transient one.
        huggingface_hub.errors.RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError: as
            ``hf_hub_download``.
        huggingface_hub.errors.LocalEntryNotFoundError: offline (or unreachable) and not in the cache.
    """
    wait = HUB_RETRY_WAIT_S
    for attempt in range(HUB_RETRIES + 1):
        try:
            with checked_metadata(repo_id, filename, revision):
                return Path(hf_hub_download(
                    repo_id, filename, revision=revision, token=token, endpoint=endpoint,
                    library_name=LIBRARY_NAME, library_version=library_version(),
                ))
        except LocalEntryNotFoundError as e:
            # The metadata request failed even after huggingface_hub's own retries: say why, when the Hub said.
            if isinstance(e.__cause__, HfHubHTTPError) and e.__cause__.response is not None:
                cause = e.__cause__
                append_to_message(cause, f"\n[transformer-zoo: could not download {filename!r} of {repo_id!r} at "
                                          f"revision {revision!r}; huggingface_hub retried with backoff]")
                raise cause from None
            raise
        except HfHubHTTPError as e:
            status = e.response.status_code if e.response is not None else None
            if status not in TRANSIENT_STATUS or isinstance(e, EntryNotFoundError):
                raise
            if attempt == HUB_RETRIES:
                append_to_message(e, f"\n[transformer-zoo: downloading {filename!r} of {repo_id!r} at revision "
                                      f"{revision!r} failed {attempt + 1} times with a server error]")
                raise
            logger.warning(
                "the Hub answered HTTP %s while downloading %r of %r; retrying in %.1f s [%d/%d]",
                status, filename, repo_id, wait, attempt + 1, HUB_RETRIES,
            )
            time.sleep(wait)
            wait = min(HUB_RETRY_MAX_WAIT_S, wait * 2)
    raise AssertionError("unreachable")


# What the current thread is downloading (``checked_metadata``); the response hook checks only those answers.
_DOWNLOADING = threading.local()


@contextmanager
def checked_metadata(repo_id: str, filename: str, revision: str) -> Iterator[None]:
    """Check the revision, then, while the block runs, every metadata answer (``HEAD .../resolve/...``) that
    ``huggingface_hub``'s HTTP session receives on this thread (``check_metadata``), before ``huggingface_hub``
    reads it. The check sits on the very answer the cache is named after: a server cannot pass a check with one
    answer and send another to the download.

    Args:
        repo_id: the repository, for messages.
        filename: the file, for messages.
        revision: the revision asked for.

    Yields:
        Nothing; the hook is active inside the ``with`` block.

    Raises:
        ValueError: a revision that leads out of the cache's ``refs`` folder (a branch or tag is written as
            ``refs/<revision>``); inside the block, as ``check_metadata``.
    """
    what = f"downloading {filename!r} of {repo_id!r} at revision {revision!r}"
    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    if not is_commit_sha(revision):
        confined(storage / "refs", revision, f"{what}: the revision")
    session = get_session()  # huggingface_hub's shared client (made again after close_session/set_client_factory)
    hooks = session.event_hooks
    if check_metadata not in hooks["response"]:
        hooks["response"].append(check_metadata)
        session.event_hooks = hooks
    outer = getattr(_DOWNLOADING, "what", None)
    _DOWNLOADING.what = what
    try:
        yield
    finally:
        _DOWNLOADING.what = outer


def check_metadata(response: Any) -> None:
    """A response hook on ``huggingface_hub``'s session: on a thread inside ``checked_metadata``, an answer to a
    metadata request (``HEAD`` of a ``/resolve/`` URL, error answers included) must carry an ETag and
    ``X-Linked-Etag`` that are sha1 or sha256 in hex and an ``X-Repo-Commit`` that is a sha1 in hex, where present:
    the blob is ``blobs/<etag>``, the snapshot ``snapshots/<commit>/``, a missing file ``.no_exist/<commit>/``.
    Other answers (the download itself, possibly from a CDN with ETags of its own) are not looked at.

    Args:
        response: the HTTP response.

    Raises:
        ValueError: a bad value, quoted, with the header and the file it came with.
    """
    what = getattr(_DOWNLOADING, "what", None)
    request = response.request
    if what is None or request.method != "HEAD" or "/resolve/" not in request.url.path:
        return
    headers = response.headers
    commit = headers.get(constants.HUGGINGFACE_HEADER_X_REPO_COMMIT)
    if commit is not None:
        check_commit(commit, f"{what} (the X-Repo-Commit header)")
    for header in (constants.HUGGINGFACE_HEADER_X_LINKED_ETAG, "ETag"):
        if headers.get(header) is not None:
            check_etag(headers[header], f"{what} (the {header} header)")


def check_push_arguments(repo_id: str, private: bool, revision: str | None) -> None:
    """Check ``push_folder``'s arguments before anything is written or requested.

    Args:
        repo_id: the repository.
        private: create it private.
        revision: the branch to commit to, or None.

    Raises:
        ValueError: an invalid ``repo_id``, or a ``revision`` that is not a non-empty branch name.
        TypeError: ``private`` is not a bool.
    """
    validate_repo_id(repo_id)
    if not isinstance(private, bool):
        raise TypeError(f"private must be a bool, got {private!r}")
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise ValueError(f"revision must be a non-empty branch name, got {revision!r}")


def push_folder(
    repo_id: str,
    write: Callable[[Path], None],
    *,
    commit_message: str,
    private: bool = False,
    revision: str | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
) -> CommitInfo:
    """Upload the files ``write(folder)`` puts in a fresh folder to a Hub model repo in one commit, creating the
    repo (and the branch ``revision``, from ``main``) if needed.

    The folder is staged like a local save, beside a fixed name in the temporary folder: a push killed half way
    leaves a folder that the next push removes.

    Args:
        repo_id: as checked by ``check_push_arguments``.
        private: as checked by ``check_push_arguments``.
        revision: as checked by ``check_push_arguments``.
        write: writes the files (plain files only) into the folder it is given.
        commit_message: passed to ``huggingface_hub``.
        token: passed to ``huggingface_hub``.
        endpoint: passed to ``huggingface_hub``.

    Returns:
        ``huggingface_hub.CommitInfo`` (``.oid`` is the commit sha; with nothing changed, the current head).

    Raises:
        huggingface_hub.errors.HfHubHTTPError: the Hub refused (e.g. no write access).
    """
    check_push_arguments(repo_id, private, revision)
    api = HfApi(endpoint=endpoint, token=token, library_name=LIBRARY_NAME, library_version=library_version())
    api.create_repo(repo_id, private=private, exist_ok=True)
    if revision not in (None, "main"):
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    with staging_folder(Path(tempfile.gettempdir()) / "transformer-zoo-push") as folder:
        write(folder)
        operations = [
            CommitOperationAdd(path_in_repo=p.name, path_or_fileobj=str(p)) for p in sorted(folder.iterdir())
        ]
        return api.create_commit(repo_id, operations, commit_message=commit_message, revision=revision)


@contextmanager
def naming_the_repo(repo_id: str | None, revision: str | None) -> Iterator[None]:
    """Name the repo and the requested revision in the Hub's not-found errors raised inside.

    Args:
        repo_id: the repository, or None.
        revision: the revision asked for, or None.

    Yields:
        Nothing; errors raised inside the ``with`` block are amended.
    """
    try:
        yield
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as e:
        append_to_message(e, f"\n[transformer-zoo: loading Hub repo {repo_id!r} at revision {revision!r}]")
        raise


def hub_unreachable(endpoint: str | None = None, timeout: float = 3.0) -> str | None:
    """Why the Hub at ``endpoint`` (default ``HF_ENDPOINT`` or huggingface.co) cannot be reached — its host name does
    not resolve, or a TCP connection fails within ``timeout`` seconds — or ``None`` when it can. One quick probe, so
    that a load without a network says so at once instead of after ``huggingface_hub``'s retries.

    Args:
        endpoint: the Hub's URL.
        timeout: seconds the connection may take.

    Returns:
        What failed, in words, or ``None``.
    """
    url = urllib.parse.urlsplit(endpoint or constants.ENDPOINT)
    host = url.hostname or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except socket.gaierror:
        return f"the host name {host!r} does not resolve"
    except OSError as err:
        return f"{host}:{port}: {err.strerror or err}"
    return None


def is_commit_sha(text: str) -> bool:
    """Whether ``text`` is a full 40-character Hub commit sha (the name of a cache snapshot folder).

    Args:
        text: a revision.

    Returns:
        True for a commit sha.
    """
    return len(text) == 40 and all(c in "0123456789abcdef" for c in text)


def append_to_message(error: BaseException, extra: str) -> None:
    """Add ``extra`` to an exception's message in place (``huggingface_hub`` errors and plain ones alike).

    Args:
        error: the exception.
        extra: the text to append.
    """
    if error.args and isinstance(error.args[0], str):
        error.args = (error.args[0] + extra, *error.args[1:])
    else:
        error.args = (*error.args, extra.strip())
