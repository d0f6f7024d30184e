"""A real HTTP hop in front of a test vLLM server that passes requests on, with two faults a
served teacher can have: it stops answering (503 for every completion request after the first
`healthy` ones: the preflight's pass) and it answers one prompt with a NaN log-prob. The tests
of the cache job through a server use it to show what a worker does with each (the job stops,
naming the URL; the row goes to the dead letters)."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.error
import urllib.request


class FaultyProxy:
    def __init__(self, target: str, *, healthy: int | None = None, poison: list[int] | None = None):
        self.target, self.healthy, self.poison = target.rstrip("/"), healthy, poison
        self.completions = 0
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FaultyProxy:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, path: str, body: bytes | None) -> tuple[int, bytes]:
        if path == "/v1/completions":
            with self._lock:
                self.completions += 1
                down = self.healthy is not None and self.completions > self.healthy
            if down:
                return 503, json.dumps({"error": {"message": "the engine went away"}}).encode()
        req = urllib.request.Request(self.target + path, data=body,
                                     method="GET" if body is None else "POST")  # fmt: skip
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                code, data = r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        if path == "/v1/completions" and self.poison is not None:
            prompts, got = json.loads(body)["prompt"], json.loads(data)
            for c in got["choices"]:
                if prompts[c["index"]] == self.poison:  # position 0's answer: a NaN
                    entry = c["prompt_logprobs"][1]
                    entry[next(iter(entry))]["logprob"] = float("nan")
            data = json.dumps(got).encode()
        return code, data

    def _handler(self):
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _reply(self, body: bytes | None) -> None:
                code, data = proxy._answer(self.path, body)
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._reply(None)

            def do_POST(self):
                self._reply(self.rfile.read(int(self.headers["Content-Length"])))

            def log_message(self, *args):  # quiet
                pass

        return Handler
