"""A small stand-in for the Hugging Face Hub HTTP API, enough for `create_repo` + `upload_folder`.

It answers the routes a push uses (repo creation, preupload, commit, branch creation, pull requests, YAML validation),
checks the bearer token, refuses repositories whose name contains "forbidden", and records every commit
(its files decoded) so tests can inspect exactly what was pushed.

Large and binary files take the Git LFS path, as on the Hub: preupload answers "lfs" for them (weights suffixes,
or LFS_THRESHOLD bytes and more), then the LFS batch API hands out an upload URL (PUT, sha256 and size checked)
and a verify URL, and the commit names the object by oid. Xet is not spoken: the Xet token route is refused with
a 501 that says so; a client with `hf_xet` installed must run with Xet disabled (HF_HUB_DISABLE_XET).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = "hf_test_token_not_real"
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".npy", ".npz",
                ".zip", ".gz", ".tar", ".parquet", ".arrow", ".png", ".jpg")
LFS_THRESHOLD = 10 * 1024 * 1024  # the Hub stores files from 10 MB in LFS whatever their name
XET_REFUSED = "this Hub stand-in does not speak Xet; set HF_HUB_DISABLE_XET=1 to upload large files through LFS"


def upload_mode(path: str, size: int) -> str:
    """What the Hub's preupload answers for a file: "lfs" for weights and large files, "regular" for the rest."""
    return "lfs" if path.lower().endswith(LFS_SUFFIXES) or size >= LFS_THRESHOLD else "regular"


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.commits: list[dict] = []
        self.unknown: list[str] = []
        self.pull_requests = 0
        self.lfs_objects: dict[str, bytes] = {}  # sha256 hex -> content, filled by the LFS upload URLs
        self.lfs_batches: list[dict] = []  # every LFS batch request, as sent
        self.lfs_verified: list[dict] = []  # every verify call ({"oid", "size"})
        self.xet_requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def _reply(self, status: int, payload: dict | None = None):
                body = json.dumps(payload or {}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if status >= 400:
                    self.send_header("X-Error-Message", (payload or {}).get("error", ""))
                self.end_headers()
                self.wfile.write(body)

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            self.rfile.readline()
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _authorised(self) -> bool:
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self._reply(401, {"error": "Invalid credentials in Authorization header"})
                    return False
                return True

            def do_GET(self):
                if "/xet-write-token/" in self.path or "/xet-read-token/" in self.path:
                    hub.xet_requests.append(self.path)
                    return self._reply(501, {"error": XET_REFUSED})
                match = re.fullmatch(r"/api/models/(.+?/.+?)/discussions/(\d+)", self.path.split("?")[0])
                if match and self._authorised():
                    repo_id, num = match.group(1), int(match.group(2))
                    return self._reply(200, {
                        "title": "Upload", "num": num, "status": "open", "createdAt": "2026-01-01T00:00:00.000Z",
                        "repo": {"name": repo_id, "type": "model"}, "isPullRequest": True, "events": [],
                        "changes": {"base": "refs/heads/main"}, "filesWithConflicts": [],
                    })
                if not match:
                    hub.unknown.append(f"GET {self.path}")
                    self._reply(404, {"error": "not found"})

            def do_PUT(self):
                """An LFS upload URL (pre-signed, so no token, as on the Hub's storage)."""
                body = self._body()
                match = re.fullmatch(r"/lfs-storage/([0-9a-f]{64})", self.path.split("?")[0])
                if not match:
                    hub.unknown.append(f"PUT {self.path}")
                    return self._reply(404, {"error": "not found"})
                oid = match.group(1)
                if hashlib.sha256(body).hexdigest() != oid:
                    return self._reply(400, {"error": f"uploaded content does not match sha256 {oid}"})
                hub.lfs_objects[oid] = body
                return self._reply(200, {})

            def _lfs_batch(self, repo_id: str, request: dict):
                hub.lfs_batches.append({"repo_id": repo_id, **request})
                if repo_id not in hub.repos:
                    return self._reply(404, {"message": f"Repository {repo_id} not found"})
                if request.get("operation") != "upload" or "basic" not in request.get("transfers", ["basic"]):
                    return self._reply(422, {"message": "only basic LFS uploads are supported"})
                objects = []
                for obj in request["objects"]:
                    oid, size = obj["oid"], obj["size"]
                    entry = {"oid": oid, "size": size, "authenticated": True}
                    if oid not in hub.lfs_objects:  # already stored: no actions, the client skips the upload
                        entry["actions"] = {
                            "upload": {"href": f"{hub.endpoint}/lfs-storage/{oid}?X-Amz-Signature=stand-in"},
                            "verify": {"href": f"{hub.endpoint}/{repo_id}.git/info/lfs/objects/verify"},
                        }
                    objects.append(entry)
                return self._reply(200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"})

            def _lfs_verify(self, request: dict):
                hub.lfs_verified.append(request)
                stored = hub.lfs_objects.get(request.get("oid"))
                if stored is None or len(stored) != request.get("size"):
                    return self._reply(404, {"error": f"LFS object {request.get('oid')} was not uploaded"})
                return self._reply(200, {})

            def do_POST(self):
                body = self._body()
                path = self.path.split("?")[0]
                query = self.path.split("?")[1] if "?" in self.path else ""
                if path == "/api/validate-yaml":
                    return self._reply(200, {"errors": [], "warnings": []})
                if not self._authorised():
                    return None
                match = re.fullmatch(r"/(.+?/.+?)\.git/info/lfs/objects/(batch|verify)", path)
                if match:
                    repo_id, route = match.groups()
                    request = json.loads(body)
                    return self._lfs_batch(repo_id, request) if route == "batch" else self._lfs_verify(request)
                if path == "/api/repos/create":
                    request = json.loads(body)
                    repo_id = f"{request.get('organization') or 'user'}/{request['name']}"
                    if "forbidden" in repo_id:
                        return self._reply(403, {"error": "You don't have the rights to create a model under this namespace"})
                    hub.repos.setdefault(repo_id, {"private": request.get("visibility") == "private", "branches": {"main"}})
                    return self._reply(200, {"url": f"{hub.endpoint}/{repo_id}", "name": repo_id, "id": repo_id})
                if re.fullmatch(r"/api/models/.+?/.+?/discussions", path):
                    hub.pull_requests += 1
                    return self._reply(200, {"num": hub.pull_requests})
                match = re.fullmatch(r"/api/models/(.+?/.+?)/(preupload|commit|branch)/(.+)", path)
                if not match:
                    hub.unknown.append(f"POST {self.path}")
                    return self._reply(404, {"error": "not found"})
                repo_id, action, revision = match.groups()
                if repo_id not in hub.repos:
                    return self._reply(404, {"error": f"Repository {repo_id} not found"})
                if action == "branch":
                    hub.repos[repo_id]["branches"].add(revision)
                    return self._reply(200, {})
                if action == "preupload":
                    files = json.loads(body)["files"]
                    return self._reply(200, {"files": [
                        {"path": f["path"], "uploadMode": upload_mode(f["path"], f["size"]), "shouldIgnore": False}
                        for f in files]})
                lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                header = next(line["value"] for line in lines if line["key"] == "header")
                files = {line["value"]["path"]: base64.b64decode(line["value"]["content"])
                         for line in lines if line["key"] == "file"}
                lfs_files = {line["value"]["path"]: line["value"] for line in lines if line["key"] == "lfsFile"}
                for name, pointer in lfs_files.items():
                    content = hub.lfs_objects.get(pointer["oid"])
                    if content is None or len(content) != pointer.get("size", len(content)):
                        return self._reply(422, {"error": f"{name}: LFS object {pointer['oid']} was not uploaded"})
                    files[name] = content
                create_pr = "create_pr=1" in query or revision.startswith("refs%2Fpr") or revision.startswith("refs/pr")
                hub.commits.append({"repo_id": repo_id, "revision": revision, "summary": header["summary"],
                                    "files": files, "lfs_files": lfs_files, "create_pr": create_pr})
                oid = f"{len(hub.commits):040x}"
                return self._reply(200, {
                    "commitUrl": f"{hub.endpoint}/{repo_id}/commit/{oid}", "commitOid": oid,
                    "pullRequestUrl": f"{hub.endpoint}/{repo_id}/discussions/1" if create_pr else None,
                })

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
