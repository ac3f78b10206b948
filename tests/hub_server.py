"""A small stand-in for the Hugging Face Hub HTTP API, enough for `create_repo` + `upload_folder`.

It answers the routes a push uses (repo creation, preupload, commit, branch creation, pull requests, YAML validation),
checks the bearer token, refuses repositories whose name contains "forbidden", and records every commit
(its files decoded) so tests can inspect exactly what was pushed.
"""

from __future__ import annotations

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = "hf_test_token_not_real"


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.commits: list[dict] = []
        self.unknown: list[str] = []
        self.pull_requests = 0
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

            def _authorised(self) -> bool:
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self._reply(401, {"error": "Invalid credentials in Authorization header"})
                    return False
                return True

            def do_GET(self):
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

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                path = self.path.split("?")[0]
                query = self.path.split("?")[1] if "?" in self.path else ""
                if path == "/api/validate-yaml":
                    return self._reply(200, {"errors": [], "warnings": []})
                if not self._authorised():
                    return None
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
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})
                lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                header = next(line["value"] for line in lines if line["key"] == "header")
                files = {line["value"]["path"]: base64.b64decode(line["value"]["content"])
                         for line in lines if line["key"] == "file"}
                create_pr = "create_pr=1" in query or revision.startswith("refs%2Fpr") or revision.startswith("refs/pr")
                hub.commits.append({"repo_id": repo_id, "revision": revision, "summary": header["summary"],
                                    "files": files, "create_pr": create_pr})
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
