"""A Hugging Face Hub for tests, offline: `hub_cache` writes a repo into huggingface_hub's cache layout
(`models--owner--name/snapshots/<sha>/...`, `refs/<revision>`), and `FakeHub` serves repos on 127.0.0.1 with just
the routes huggingface_hub 2.x calls: repo info and the file tree (`/api/{models,datasets}/<repo>/revision|tree/`),
file downloads (HEAD and GET `[/datasets]/<repo>/resolve/<rev>/<file>`), and an upload (`/api/repos/create`,
`preupload`, `commit` with the files inline as NDJSON). `downloads` and `pushed` record what went over the wire;
`fail_pushes` answers the upload routes with a 500. `use(monkeypatch)` points huggingface_hub at it."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

SHA = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(cache: Path, repo: str, files: dict[str, bytes | Path], kind: str = "models", revision: str = "main",
              sha: str = SHA) -> Path:
    """Write `files` ({path in repo: bytes, or a file to copy}) as `repo`'s snapshot `sha` at `revision` into the
    huggingface_hub cache `cache`; the snapshot directory."""
    root = cache / f"{kind}--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / sha
    for name, content in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_bytes(content.read_bytes() if isinstance(content, Path) else content)
    (root / "refs" / revision).parent.mkdir(parents=True, exist_ok=True)
    (root / "refs" / revision).write_text(sha)
    return snapshot


def directory_files(directory: Path) -> dict[str, bytes]:
    """{relative path: bytes} of every file under `directory`."""
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


class FakeHub:
    """repos: {(kind, repo, revision): {path: bytes}}, kind "models" or "datasets"."""

    def __init__(self, repos: dict[tuple[str, str, str], dict[str, bytes]]):
        self.repos = repos
        self.downloads: list[str] = []  # "kind/repo/path" of each file GET
        self.pushed: dict[str, dict[str, bytes]] = {}  # repo -> {path: bytes} committed
        self.fail_pushes = False
        self.requests: list[str] = []  # the API GETs
        self.cards: list[str] = []  # the README.md texts sent to /api/validate-yaml
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def use(self, monkeypatch, cache: Path) -> None:
        """Downloads on (HF_HUB_OFFLINE off), from this server, into `cache`, with a token."""
        from huggingface_hub import constants
        from huggingface_hub.utils import _detect_agent

        monkeypatch.setattr(_detect_agent, "_registry", _detect_agent._EMPTY_REGISTRY)  # no telemetry fetch or file
        monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(cache / ".agent_harnesses.json"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", self.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            self.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
        monkeypatch.setenv("HF_TOKEN", "hf_test")

    def resolve(self, kind: str, repo: str, revision: str) -> tuple[str, dict[str, bytes]] | None:
        """(commit sha, files) of a repo at a revision (a branch name or the commit sha), None if absent."""
        for (k, r, rev), files in self.repos.items():
            sha = hashlib.sha1(f"{k}/{r}@{rev}".encode()).hexdigest()
            if (k, r) == (kind, repo) and unquote(revision) in (rev, sha):
                return sha, files
        return None


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, content: bool = True):
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if content:
                self.wfile.write(body)

        def _json(self, value, status: int = 200):
            self._send(status, json.dumps(value).encode(), {"Content-Type": "application/json"})

        def _missing(self, content: bool = True):
            self._send(404, b'{"error": "not found"}', {"X-Error-Code": "RepoNotFound"}, content)

        def _file(self, content: bool):
            parts = urlparse(self.path).path.strip("/").split("/")
            kind = "datasets" if parts[0] == "datasets" else "models"
            parts = parts[1:] if kind == "datasets" else parts
            repo, rev, name = "/".join(parts[:2]), parts[3], unquote("/".join(parts[4:]))
            found = hub.resolve(kind, repo, rev)
            if found is None:
                return self._missing(content)
            sha, files = found
            if name not in files:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha}, content)
            if content:
                hub.downloads.append(f"{kind}/{repo}/{name}")
            body = files[name]
            self._send(200, body, {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha1(body).hexdigest()}"'}, content)

        def do_HEAD(self):
            self._file(content=False)

        def do_GET(self):
            path = urlparse(self.path).path
            if not path.startswith("/api/"):
                return self._file(content=True)
            hub.requests.append(path)
            parts = [unquote(p) for p in path.removeprefix("/api/").split("/")]
            if len(parts) < 3:  # anything else huggingface_hub asks for (its agent-harness list): nothing
                return self._missing()
            kind, repo, route, rest = parts[0], "/".join(parts[1:3]), (parts[3:4] or ["revision"])[0], parts[4:]
            found = hub.resolve(kind, repo, rest[0] if rest else "main")
            if found is None:
                return self._missing()
            sha, files = found
            if route == "revision":
                return self._json({"id": repo, "sha": sha, "siblings": [{"rfilename": f} for f in files]})
            if route == "tree":
                return self._json([{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                                   for f, b in files.items()])
            self._missing()

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            path = urlparse(self.path).path
            if hub.fail_pushes:
                return self._send(500, b'{"error": "the Hub is down"}')
            if path == "/api/repos/create":
                repo = json.loads(body)
                repo_id = f"{repo.get('organization') or 'me'}/{repo['name']}"
                hub.pushed.setdefault(repo_id, {})
                return self._json({"url": f"{hub.url}/{repo_id}", "name": repo_id, "id": repo_id})
            if path == "/api/validate-yaml":  # a README.md's front matter, checked before a commit: accepted
                hub.cards.append(json.loads(body)["content"])
                return self._json({})
            _, _, kind, owner, name, route, *_ = path.split("/")
            if route == "preupload":
                files = json.loads(body)["files"]
                return self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                             for f in files]})
            if route == "commit":
                for line in body.decode().splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        hub.pushed.setdefault(f"{owner}/{name}", {})[item["value"]["path"]] = base64.b64decode(
                            item["value"]["content"])
                return self._json({"commitUrl": f"{hub.url}/{owner}/{name}/commit/{SHA}", "commitOid": SHA})
            self._missing()

    return Handler
