"""A local stand-in for the Hugging Face hub's HTTP API, as far as huggingface_hub's downloads go
(model info at a revision, the recursive tree listing, HEAD and GET of ``/resolve/``), plus plain
file serving with Range: for ``atrium model pull`` tests that never reach the real hub.

Faults on demand: a file whose served bytes differ from its listed checksum, a transfer cut
halfway once, a file that fails with 500. Every request is logged with its headers.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    commit: str = "a" * 40
    branches: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    token: str | None = None  # the bearer token every call must carry, when set

    def lfs(self, name: str) -> bool:
        return name.endswith(".safetensors")


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    static: dict[str, bytes] = field(default_factory=dict)  # /path -> bytes, plain downloads
    corrupt: dict[str, bytes] = field(default_factory=dict)  # file -> bytes served instead
    cut_once: set[str] = field(default_factory=set)  # file: the first GET stops halfway
    failing: set[str] = field(default_factory=set)  # file: GET answers 500
    seen: list[Seen] = field(default_factory=list)
    url: str = ""

    def gets(self, name: str) -> list[Seen]:
        return [s for s in self.seen if s.method == "GET" and s.path.endswith("/" + name)]


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def _tree(repo: FakeRepo) -> list[dict[str, object]]:
    entries: list[dict[str, object]] = []
    for name, data in sorted(repo.files.items()):
        entry: dict[str, object] = {
            "type": "file", "path": name, "size": len(data), "oid": git_blob_id(data)
        }  # fmt: skip
        if repo.lfs(name):
            sha = hashlib.sha256(data).hexdigest()
            entry["lfs"] = {"oid": sha, "size": len(data), "pointerSize": 134}
        entries.append(entry)
    return entries


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve(head=True)

        def do_GET(self) -> None:
            self._serve(head=False)

        def _reply(self, status: int, body: bytes, headers: dict[str, str], head: bool) -> None:
            self.send_response(status)
            for key, value in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(key, value)
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, status: int, body: object) -> None:
            self._reply(
                status, json.dumps(body).encode(), {"Content-Type": "application/json"}, False
            )

        def _serve(self, head: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.seen.append(
                Seen(self.command, path, {k.lower(): v for k, v in self.headers.items()})
            )
            if path in hub.static:
                return self._file(path, hub.static[path], {}, head)
            api = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)", path)
            resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            repo_id = (api or resolve).group(1) if (api or resolve) else None
            repo = hub.repos.get(repo_id or "")
            if repo is None:
                return self._json(404, {"error": "Repository not found"})
            if repo.token and self.headers.get("authorization") != f"Bearer {repo.token}":
                return self._json(401, {"error": "Invalid credentials"})
            revision = (api.group(3) if api else resolve.group(2)) if (api or resolve) else ""
            commit = repo.branches.get(revision, revision)
            if commit != repo.commit:
                self.send_response(404)
                self.send_header("X-Error-Code", "RevisionNotFound")
                self.send_header("Content-Length", "0")
                return self.end_headers()
            if api and api.group(2) == "revision":
                return self._json(200, {"id": repo_id, "sha": repo.commit, "siblings": []})
            if api:
                return self._json(200, _tree(repo))
            assert resolve is not None
            return self._resolve(repo, resolve.group(3), head)

        def _resolve(self, repo: FakeRepo, name: str, head: bool) -> None:
            data = repo.files.get(name)
            if data is None:
                return self._json(404, {"error": "Entry not found"})
            headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{git_blob_id(data)}"'}
            if repo.lfs(name):
                headers["X-Linked-Etag"] = f'"{hashlib.sha256(data).hexdigest()}"'
                headers["X-Linked-Size"] = str(len(data))
            if not head and name in hub.failing:
                return self._json(500, {"error": "storage unavailable"})
            self._file(name, hub.corrupt.get(name, data), headers, head)

        def _file(self, name: str, data: bytes, headers: dict[str, str], head: bool) -> None:
            start = 0
            asked = re.fullmatch(r"bytes=(\d+)-", self.headers.get("range") or "")
            if asked and not head:
                start = int(asked.group(1))
                if start >= len(data):
                    return self._reply(416, b"", {}, head)
                headers = {**headers, "Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"}
            status = 206 if start else 200
            if not head and name in hub.cut_once:
                hub.cut_once.discard(name)
                self.send_response(status)
                for key, value in {**headers, "Content-Length": str(len(data) - start)}.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data[start : start + (len(data) - start) // 2])
                self.wfile.flush()
                self.close_connection = True
                return None
            return self._reply(status, data[start:], headers, head)

    return Handler


@contextmanager
def running(hub: FakeHub) -> Iterator[FakeHub]:
    """Serves ``hub`` on 127.0.0.1 (a free port) in a thread; ``hub.url`` is its address."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
