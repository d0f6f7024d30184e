"""The teacher-cache job through a served teacher (``--teacher-server URL``): RunInference whose
"model" is a client of vLLM's OpenAI-compatible server, so a fleet of inference servers behind
one URL builds the cache of a teacher no Beam worker could hold.

Rows go out as token-id prompts (many a request, a few requests in flight) and come back as the
fields the local teacher writes (top-k, tail, realised token: `tokenbridge.teacher.served`), so
the cache, its checks and its reader are unchanged. What a server cannot give is refused by
flag (`server_spec`); the server is checked as the trainer checks one (`check`) before the
pipeline starts. A row answered badly is a dead letter; a server gone stops the job.

Legend: B rows, U teacher positions (the batch's longest row), K top-k.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

import numpy as np

from pipelines.teacher_cache.handler import RowBatch, RowBatchHandler
from tokenbridge.teacher import served
from tokenbridge.teacher.outputs import TeacherOutputSpec

FLAG = "--teacher-server"


@dataclass(frozen=True)
class ServerSpec:
    """Where the teacher is served and how to ask it (the API key travels by its variable's
    name only: each worker reads its own environment)."""

    url: str
    model: str
    server_timeout_s: float = 120.0
    api_key_env: str = ""
    rows_per_request: int = 8
    in_flight: int = 4

    def connect(self) -> served.ServerClient:
        return served.connect(
            self.url, model=self.model, server_timeout_s=self.server_timeout_s,
            api_key_env=self.api_key_env, rows_per_request=self.rows_per_request,
            in_flight=self.in_flight, retry_name="--server-timeout-s",
        )  # fmt: skip


# the flags that only mean something with a server, and their defaults (the spec's)
SERVER_DEFAULTS = {
    "served_model": "",
    **{f.name: f.default for f in dataclasses.fields(ServerSpec) if f.name not in ("url", "model")},
}


def add_server_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(FLAG, default=None, metavar="URL",
                    help="score through vLLM's OpenAI-compatible server at URL (make "
                    "teacher-server) instead of loading --teacher's weights")  # fmt: skip
    ap.add_argument("--served-model", default=None,
                    help="the model name the server serves (default: --teacher's name)")  # fmt: skip
    ap.add_argument("--server-timeout-s", type=float, default=None,
                    help="requests are retried this long before the job stops (default 120)")  # fmt: skip
    ap.add_argument("--api-key-env", default=None,
                    help="an environment variable holding the server's API key (Bearer)")  # fmt: skip
    ap.add_argument("--rows-per-request", type=int, default=None, help="default 8")
    ap.add_argument("--in-flight", type=int, default=None, help="requests at once (default 4)")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def server_spec(args: argparse.Namespace, *, name: str) -> ServerSpec | None:
    """`args`' server, or None without ``--teacher-server``; ValueError (one line, naming the
    flag) for what a server cannot give or a server flag without a server. `name`: the
    teacher's name, the served model's by default."""
    given = {k: getattr(args, k) for k in SERVER_DEFAULTS if getattr(args, k) is not None}
    url = getattr(args, "teacher_server", None)
    if url is None:
        if given:
            raise ValueError(f"{_flag(next(iter(given)))}: only with {FLAG} URL")
        return None
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{FLAG}: expected http(s)://host:port, got {url!r}")
    why = _unservable(args)
    if why:
        raise ValueError(f"{why}; drop it, or build the cache from the teacher's weights "
                         f"(without {FLAG})")  # fmt: skip
    opts = {**SERVER_DEFAULTS, **given}
    for key in ("server_timeout_s", "rows_per_request", "in_flight"):
        if not opts[key] > 0:
            raise ValueError(f"{_flag(key)}: expected > 0, got {opts[key]}")
    if opts["api_key_env"] and not os.environ.get(opts["api_key_env"]):
        raise ValueError(f"--api-key-env {opts['api_key_env']}: that variable is not set here")
    return ServerSpec(url.rstrip("/"), opts.pop("served_model") or name, **opts)


def _unservable(args: argparse.Namespace) -> str:
    """Why the cache `args` ask for is more than a server returns (its top-k log-probs,
    normalised at temperature 1, and the realised token's), or ""."""
    if args.samples:
        return (f"--samples {args.samples}: {FLAG} returns top-k log-probs, not draws from the "
                "teacher's whole distribution")  # fmt: skip
    if args.temperature != 1.0:
        return f"--temperature {args.temperature}: {FLAG} returns log-probs at temperature 1"
    if args.init != "pretrained" or args.override:
        flag = "--override" if args.init == "pretrained" else f"--init {args.init}"
        return f"{flag}: {FLAG} serves saved weights, not a random-init recipe"
    return ""


def check(spec: ServerSpec, tokenizer, *, k: int, max_len: int) -> dict:
    """The trainer's preflight of a served teacher (`served.check_server`: model, context for
    `max_len`, tokenizer, vocabulary size, k); what it reports, for stats.json."""
    client = spec.connect()
    try:
        return served.check_server(client, tokenizer, k=k, max_len=max_len, where=FLAG)
    finally:
        client.close()


class ServedCacheHandler(RowBatchHandler):
    """RunInference's view of a served teacher: `RowBatch` in, `ScoredBatch` out. A batch the
    server answers badly (`BadAnswerError`) is retried row by row, its bad rows dead letters;
    a server that stops answering for ``server_timeout_s`` (`TeacherServerError`) fails the
    job, in one line naming the URL."""

    ROW_ERRORS = (served.BadAnswerError,)

    def __init__(self, server: ServerSpec, spec: TeacherOutputSpec):
        super().__init__()
        if spec.columns or spec.rest_sorted or spec.temperature != 1.0:
            raise ValueError(f"{FLAG}: a server returns top-k and target log-probs at "
                             f"temperature 1, the cache asks for {spec}")  # fmt: skip
        self.server, self.spec = server, spec

    def load_model(self) -> served.ServerClient:
        return self.server.connect()

    def _score(self, client: served.ServerClient, batch: RowBatch) -> dict[str, np.ndarray]:
        lens = batch.lengths
        b, u, k = len(lens), int(lens.max(initial=0)), self.spec.topk
        if u == 0:
            return {}
        rows = [[int(i) for i in x] for x in batch.ids]
        got = client.score(rows, k=k, vocab_size=self.spec.vocab_size)
        ids_BUK = np.full((b, u, k), -1, np.int32)
        lp_BUK = np.full((b, u, k), -np.inf, np.float32)
        tail_BU = np.zeros((b, u), np.float32)
        target_BU = np.zeros((b, u), np.float32)
        for i, r in enumerate(got):
            n = int(lens[i])
            ids_BUK[i, :n], lp_BUK[i, :n] = r.topk_ids, r.topk_logprobs
            tail_BU[i, :n], target_BU[i, :n] = r.tail_logprob, r.target_logprob
        out = {"topk_ids": ids_BUK, "topk_logprobs": lp_BUK, "tail_logprob": tail_BU}
        if self.spec.target:
            out["target_logprob"] = target_BU
        return out
