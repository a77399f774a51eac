"""A Hub-compatible HTTP server for tests, written with the standard library only.

It answers the endpoints ``huggingface_hub`` 2.x calls to create repos, branches and tags, commit files,
describe revisions and download files, over in-memory git-like storage: every repo has commits addressed by
sha, branches and tags pointing at them, and each commit holds a full snapshot of the files. Errors carry the
``X-Error-Code`` header (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``) that the client turns into
its exception classes. Every upload is offered ``uploadMode: "regular"`` (content inline in the commit), so
no LFS or Xet storage is involved.

Usage::

    with HubServer(token="hf_dummy") as hub:
        ...  # point huggingface_hub.constants.ENDPOINT at hub.url
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

USER = "tester"
#: the token the fixtures' servers accept (and ``point_huggingface_hub_at`` makes ``huggingface_hub`` send).
DUMMY_TOKEN = "hf_transformerzoo_dummy_token_0123456789"
REPO_TYPES = ("model", "dataset", "space")


def git_blob_oid(data: bytes) -> str:
    """The git object id of a blob (what the Hub reports as a regular file's oid)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    oid: str
    parent: str | None
    files: dict[str, bytes]
    title: str
    message: str
    date: str


@dataclass
class Repo:
    repo_type: str
    repo_id: str
    private: bool
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> Commit | None:
        """The commit a branch, tag or full commit sha points at (``None`` if none)."""
        oid = self.branches.get(revision) or self.tags.get(revision)
        if oid is None and revision in self.commits:
            oid = revision
        return None if oid is None else self.commits[oid]

    def add_commit(self, branch: str | None, files: dict[str, bytes], title: str, message: str = "") -> Commit:
        """Record a commit holding ``files`` on top of ``branch`` (``None``: a root commit) and move the branch."""
        parent = self.branches.get(branch) if branch is not None else None
        date = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
        digest = hashlib.sha1()
        for part in (self.repo_id, parent or "", title, message, date, str(len(self.commits))):
            digest.update(part.encode() + b"\0")
        for path in sorted(files):
            digest.update(path.encode() + b"\0" + git_blob_oid(files[path]).encode())
        commit = Commit(digest.hexdigest(), parent, dict(files), title, message, date)
        self.commits[commit.oid] = commit
        self.branches[branch or "main"] = commit.oid
        return commit


@dataclass
class Fault:
    """An injected error: ``times`` more requests (``None``: every one) matching ``method`` and ``path_part``
    get HTTP ``status``; ``served`` counts the ones already answered so."""

    method: str
    path_part: str
    status: int
    times: int | None
    served: int = 0


class HubHTTPError(Exception):
    """An error answer: status, optional ``X-Error-Code``, message, extra headers and extra JSON body fields."""

    def __init__(
        self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None,
        body: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.headers, self.body = headers or {}, body or {}


class HubServer:
    """An in-process Hub on ``127.0.0.1`` at a free port; ``url`` is its endpoint.

    Args:
        token: the only token accepted for writes and for reading private repos.
    """

    def __init__(self, token: str) -> None:
        self.token = token
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        self.faults: list[Fault] = []
        self.forged: list[list] = []  # [path part, headers, answers left honest] from ``forge``
        self.lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.hub = self  # type: ignore[attr-defined]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, name="hub-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def repo(self, repo_id: str, repo_type: str = "model") -> Repo:
        """Direct access to a stored repo (for assertions)."""
        return self.repos[(repo_type, repo_id)]

    def fail(self, method: str, path_part: str, status: int = 500, times: int | None = 1) -> Fault:
        """Answer the next ``times`` requests (``None``: all) with ``method`` and ``path_part`` in their path
        with HTTP ``status`` and no error code, as a Hub having a bad moment does."""
        fault = Fault(method, path_part, status, times)
        with self.lock:
            self.faults.append(fault)
        return fault

    def forge(self, path_part: str, headers: dict[str, str], after: int = 0) -> None:
        """Send ``headers`` (replacing the real ones) with every answer, error or not, to a request whose path has
        ``path_part`` in it, as a hostile or broken server would: e.g. ``{"ETag": '"../../x"'}``. The first
        ``after`` such answers stay honest (a server that passes a check, then lies)."""
        with self.lock:
            self.forged.append([path_part, dict(headers), after])

    def count(self, method: str, path_part: str) -> int:
        """How many requests with ``method`` had ``path_part`` in their path."""
        return sum(1 for m, p in self.requests if m == method and path_part in p)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects
    timeout = 30
    server: ThreadingHTTPServer

    # ------------------------------------------------------------------ plumbing
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's signature
        pass

    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    @property
    def hub(self) -> HubServer:
        return self.server.hub  # type: ignore[attr-defined]

    def _handle(self, method: str) -> None:
        body = self._read_body()  # always drain it, or the next request on this connection breaks
        url = urlsplit(self.path)
        segments = [unquote(s) for s in url.path.split("/")[1:]]
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        with self.hub.lock:
            self.hub.requests.append((method, url.path))
            try:
                self._injected_fault(method, url.path)
                status, headers, payload = self._route(method, segments, query, body)
            except HubHTTPError as e:
                status, headers = e.status, {"X-Error-Message": e.message, **e.headers}
                if e.code:
                    headers["X-Error-Code"] = e.code
                payload = {"error": e.message, **e.body}
            for entry in self.hub.forged:
                path_part, forged, honest = entry
                if path_part in url.path:
                    if honest:
                        entry[2] -= 1
                    else:
                        headers = {**headers, **forged}
        if isinstance(payload, (dict, list)):
            data = json.dumps(payload).encode()
            headers.setdefault("Content-Type", "application/json")
        else:
            data = payload
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", headers.get("Content-Length", str(len(data))))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(data)

    def _injected_fault(self, method: str, path: str) -> None:
        for fault in self.hub.faults:
            if fault.method == method and fault.path_part in path and (fault.times is None or fault.times > 0):
                if fault.times is not None:
                    fault.times -= 1
                fault.served += 1
                raise HubHTTPError(fault.status, f"Injected error {fault.status} for {method} {path}")

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _authorized(self) -> bool:
        return self.headers.get("authorization") == f"Bearer {self.hub.token}"

    def _require_auth(self) -> None:
        if not self._authorized():
            raise HubHTTPError(401, "Invalid credentials in Authorization header")

    def _repo(self, repo_type: str, repo_id: str) -> Repo:
        repo = self.hub.repos.get((repo_type, repo_id))
        if repo is None or (repo.private and not self._authorized()):
            raise HubHTTPError(404, "Repository not found", "RepoNotFound")
        return repo

    @staticmethod
    def _commit(repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HubHTTPError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    @staticmethod
    def _json(body: bytes) -> dict[str, Any]:
        try:
            data = json.loads(body or b"{}")
        except json.JSONDecodeError as e:
            raise HubHTTPError(400, f"invalid JSON body: {e}") from e
        if not isinstance(data, dict):
            raise HubHTTPError(400, "JSON body must be an object")
        return data

    def _web_prefix(self, repo_type: str) -> str:
        return "" if repo_type == "model" else f"{repo_type}s/"

    # ------------------------------------------------------------------ routes
    def _route(
        self, method: str, seg: list[str], query: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], Any]:
        if seg[:1] == ["api"]:
            if method == "POST" and seg == ["api", "repos", "create"]:
                return self._create_repo(self._json(body))
            if method == "POST" and seg == ["api", "validate-yaml"]:
                return 200, {}, {"errors": [], "warnings": []}
            if len(seg) >= 4 and seg[1] in {f"{t}s" for t in REPO_TYPES}:
                repo_type, repo_id, rest = seg[1][:-1], f"{seg[2]}/{seg[3]}", seg[4:]
                return self._repo_api(method, repo_type, repo_id, rest, query, body)
            raise HubHTTPError(404, f"no such endpoint: {method} /{'/'.join(seg)}")
        repo_type = "model"
        if seg and seg[0] in ("datasets", "spaces"):
            repo_type, seg = seg[0][:-1], seg[1:]
        if method in ("GET", "HEAD") and len(seg) >= 5 and seg[2] == "resolve":
            return self._resolve(method, repo_type, f"{seg[0]}/{seg[1]}", seg[3], "/".join(seg[4:]))
        raise HubHTTPError(404, f"no such page: {method} {self.path}")

    def _repo_api(
        self, method: str, repo_type: str, repo_id: str, rest: list[str], query: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], Any]:
        repo = self._repo(repo_type, repo_id)
        action = rest[0] if rest else ""
        if method == "GET" and (not rest or (action == "revision" and len(rest) == 2)):
            return self._info(repo, rest[1] if rest else "main")
        if method == "GET" and action == "tree" and len(rest) >= 2:
            recursive = query.get("recursive", "false").lower() in ("1", "true")
            return self._tree(repo, rest[1], "/".join(rest[2:]), recursive)
        if method == "GET" and action == "commits" and len(rest) == 2:
            return self._commits(repo, rest[1])
        if method == "GET" and rest == ["refs"]:
            return self._refs(repo)
        if method == "POST" and action == "preupload" and len(rest) == 2:
            self._require_auth()
            return self._preupload(repo, rest[1], self._json(body), query)
        if method == "POST" and action == "commit" and len(rest) == 2:
            self._require_auth()
            return self._commit_files(repo, rest[1], body, query)
        if method == "POST" and action == "branch" and len(rest) == 2:
            self._require_auth()
            return self._create_branch(repo, rest[1], self._json(body))
        if method == "POST" and action == "tag" and len(rest) == 2:
            self._require_auth()
            return self._create_tag(repo, rest[1], self._json(body))
        raise HubHTTPError(404, f"no such endpoint: {method} {self.path}")

    def _create_repo(self, payload: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
        self._require_auth()
        name, organization = payload.get("name"), payload.get("organization")
        repo_type = payload.get("type") or "model"
        if not isinstance(name, str) or not name or repo_type not in REPO_TYPES:
            raise HubHTTPError(400, f"invalid repo name {name!r} or type {repo_type!r}")
        repo_id = f"{organization or USER}/{name}"
        url = f"{self.hub.url}/{self._web_prefix(repo_type)}{repo_id}"
        if (repo_type, repo_id) in self.hub.repos:
            # The client reads the repo URL from the body of this 409 as well.
            raise HubHTTPError(409, "You already created this model repo", body={"url": url})
        repo = Repo(repo_type, repo_id, private=payload.get("visibility") == "private" or bool(payload.get("private")))
        # Like the Hub, a new repo starts with one commit holding .gitattributes.
        repo.add_commit("main", {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"},
                        "initial commit")
        self.hub.repos[(repo_type, repo_id)] = repo
        return 200, {}, {"url": url, "name": repo_id, "id": repo_id}

    def _info(self, repo: Repo, revision: str) -> tuple[int, dict[str, str], Any]:
        commit = self._commit(repo, revision)
        return 200, {}, {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "author": repo.repo_id.split("/")[0],
            "sha": commit.oid,
            "private": repo.private,
            "lastModified": commit.date,
            "tags": [],
            "siblings": [{"rfilename": path} for path in sorted(commit.files)],
        }

    def _tree(self, repo: Repo, revision: str, path: str, recursive: bool) -> tuple[int, dict[str, str], Any]:
        commit = self._commit(repo, revision)
        prefix = f"{path.rstrip('/')}/" if path else ""
        if path and not any(p.startswith(prefix) for p in commit.files):
            raise HubHTTPError(404, f"{path} does not exist on {revision}", "EntryNotFound",
                               headers={"X-Repo-Commit": commit.oid})
        entries: dict[str, dict[str, Any]] = {}
        for file_path, data in sorted(commit.files.items()):
            if not file_path.startswith(prefix):
                continue
            parts = file_path[len(prefix):].split("/")
            for depth in range(1, len(parts)):  # the folders on the way
                folder = prefix + "/".join(parts[:depth])
                if recursive or depth == 1:
                    entries.setdefault(folder, {
                        "type": "directory", "path": folder, "size": 0,
                        "oid": hashlib.sha1(f"tree:{commit.oid}:{folder}".encode()).hexdigest(),
                    })
            if recursive or len(parts) == 1:
                entries[file_path] = {"type": "file", "path": file_path, "size": len(data), "oid": git_blob_oid(data)}
        return 200, {}, list(entries.values())

    def _commits(self, repo: Repo, revision: str) -> tuple[int, dict[str, str], Any]:
        commit: Commit | None = self._commit(repo, revision)
        history = []
        while commit is not None:
            history.append({
                "id": commit.oid, "title": commit.title, "message": commit.message,
                "authors": [{"user": USER}], "date": commit.date,
            })
            commit = repo.commits.get(commit.parent) if commit.parent else None
        return 200, {}, history

    def _refs(self, repo: Repo) -> tuple[int, dict[str, str], Any]:
        def refs(kind: str, table: dict[str, str]) -> list[dict[str, str]]:
            return [{"name": n, "ref": f"refs/{kind}/{n}", "targetCommit": oid} for n, oid in sorted(table.items())]

        return 200, {}, {
            "branches": refs("heads", repo.branches), "tags": refs("tags", repo.tags),
            "converts": [], "pullRequests": [],
        }

    def _branch_head(self, repo: Repo, branch: str, query: dict[str, str]) -> Commit:
        if query.get("create_pr"):
            raise HubHTTPError(400, "pull requests are not supported by this test server")
        if branch not in repo.branches:
            raise HubHTTPError(404, f"Invalid rev id: {branch} (commits go to existing branches)", "RevisionNotFound")
        return repo.commits[repo.branches[branch]]

    def _preupload(
        self, repo: Repo, branch: str, payload: dict[str, Any], query: dict[str, str]
    ) -> tuple[int, dict[str, str], Any]:
        head = self._branch_head(repo, branch, query)
        files = payload.get("files")
        if not isinstance(files, list):
            raise HubHTTPError(400, "preupload body needs a 'files' list")
        answers = []
        for item in files:
            path = item.get("path") if isinstance(item, dict) else None
            if not isinstance(path, str):
                raise HubHTTPError(400, f"preupload entry without a path: {item!r}")
            old = head.files.get(path)
            answers.append({
                "path": path, "uploadMode": "regular", "shouldIgnore": False,
                "oid": git_blob_oid(old) if old is not None else None,
            })
        return 200, {}, {"files": answers, "commitOid": head.oid}

    def _commit_files(
        self, repo: Repo, branch: str, body: bytes, query: dict[str, str]
    ) -> tuple[int, dict[str, str], Any]:
        head = self._branch_head(repo, branch, query)
        files = dict(head.files)
        header: dict[str, Any] | None = None
        for line in body.splitlines():
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                key, value = item["key"], item["value"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise HubHTTPError(400, f"malformed commit line {line[:80]!r}: {e}") from e
            if key == "header":
                header = value
            elif key == "file":
                if value.get("encoding") != "base64":
                    raise HubHTTPError(400, f"unsupported encoding {value.get('encoding')!r}")
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                if value["path"] not in files:
                    raise HubHTTPError(404, f"A file with this name doesn't exist: {value['path']}", "EntryNotFound")
                del files[value["path"]]
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                files = {p: d for p, d in files.items() if not p.startswith(prefix)}
            else:
                raise HubHTTPError(400, f"unsupported commit operation {key!r} (this server only takes regular files)")
        if header is None or not header.get("summary"):
            raise HubHTTPError(400, "commit needs a header line with a summary")
        parent = header.get("parentCommit")
        if parent is not None and parent != head.oid:
            raise HubHTTPError(412, f"parent commit {parent} is not the head of {branch} ({head.oid})")
        commit = repo.add_commit(branch, files, header["summary"], header.get("description") or "")
        url = f"{self.hub.url}/{self._web_prefix(repo.repo_type)}{repo.repo_id}/commit/{commit.oid}"
        return 200, {}, {"success": True, "commitOid": commit.oid, "commitUrl": url, "hookOutput": ""}

    def _create_branch(self, repo: Repo, branch: str, payload: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
        if branch in repo.branches:
            raise HubHTTPError(409, f"Reference already exists: refs/heads/{branch}")
        start = self._commit(repo, payload.get("startingPoint") or "main")
        repo.branches[branch] = start.oid
        return 200, {}, {}

    def _create_tag(self, repo: Repo, revision: str, payload: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
        tag = payload.get("tag")
        if not isinstance(tag, str) or not tag:
            raise HubHTTPError(400, "tag body needs a 'tag' name")
        if tag in repo.tags:
            raise HubHTTPError(409, f"Reference already exists: refs/tags/{tag}")
        repo.tags[tag] = self._commit(repo, revision).oid
        return 200, {}, {}

    def _resolve(
        self, method: str, repo_type: str, repo_id: str, revision: str, path: str
    ) -> tuple[int, dict[str, str], Any]:
        repo = self._repo(repo_type, repo_id)
        commit = self._commit(repo, revision)
        data = commit.files.get(path)
        if data is None:
            raise HubHTTPError(404, "Entry not found", "EntryNotFound", headers={"X-Repo-Commit": commit.oid})
        headers = {
            "X-Repo-Commit": commit.oid,
            "ETag": f'"{git_blob_oid(data)}"',
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes",
        }
        requested = self.headers.get("Range", "")
        if method == "GET" and requested.startswith("bytes="):
            first, _, last = requested[len("bytes="):].partition("-")
            start, end = int(first or 0), int(last) if last else len(data) - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            return 206, headers, data[start:end + 1]
        return 200, headers, data


def point_huggingface_hub_at(server: HubServer, home: Path, monkeypatch: Any) -> None:
    """Make ``huggingface_hub`` talk to ``server``, cache under ``home`` and authenticate with ``DUMMY_TOKEN``, for
    the rest of a test (``monkeypatch`` undoes it). Nothing leaves the machine."""
    from huggingface_hub import constants

    # huggingface_hub reads these at import time, so the environment alone is not enough.
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    template = server.url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_XET_CACHE", str(home / "xet"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    monkeypatch.setenv("HF_TOKEN", DUMMY_TOKEN)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)  # no user-agent lookups against the Hub
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
