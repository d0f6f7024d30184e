"""A teacher behind vLLM's OpenAI-compatible server: requests, and answers turned into outputs.

Rows go out as token ids (the aligned ids, never text) to ``/v1/completions`` with
``prompt_logprobs=k``; the server normalises over its whole vocabulary, so its top-k log-probs
are the worker's, and the tail is the complement of the top-k mass (float64). Position t's
distribution (predicting token t + 1) is the server's prompt entry t + 1; the last position's is
the one generated token's ``top_logprobs`` (``max_tokens=1``, ids as ``token_id:N``). A wrong
shape or a non-finite log-prob is refused by name (`BadAnswerError`), never trained on. The
client is the standard library's urllib: timeouts, retries with backoff for
``server_timeout_s``, one-line errors naming the URL (`TeacherServerError`).

Legend: n row tokens, K top-k.
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

# a text every tokenizer splits into many tokens (words, digits, punctuation, a non-ASCII word):
# the server's ``/tokenize`` of it must equal the local tokenizer's ids (`check_server`)
PROBE = "The quick brown fox, in 1611, said: «Thou shalt not» — naïve café 42!"
REQUEST_TIMEOUT_S = 60.0  # one request's socket timeout (retried until server_timeout_s)


class TeacherServerError(RuntimeError):
    """The server did not answer (down, refusing, timing out) within the allowed time."""


class BadAnswerError(ValueError):
    """The server answered, but not with what was asked (shapes, ids, non-finite values)."""


@dataclass
class RowOutputs:
    """One row's teacher outputs at its n positions (numpy, as the loss reads them)."""

    topk_ids: np.ndarray  # int32 [n, K], descending log-prob
    topk_logprobs: np.ndarray  # float32 [n, K]
    tail_logprob: np.ndarray  # float32 [n]: log(1 - sum exp(topk)), float64 inside
    target_logprob: np.ndarray  # float32 [n]: log p(token t + 1), 0 at the last position


def tail_logprob(topk_lp: np.ndarray) -> np.ndarray:
    """log(1 - sum_k p_k) per row of [n, K] log-probs, in float64 (-inf when the top-k holds
    all the mass to float64 precision)."""
    mass = np.exp(topk_lp.astype(np.float64)).sum(-1)
    with np.errstate(divide="ignore"):
        return np.log1p(-np.minimum(mass, 1.0))


def _top(entry: dict, k: int, *, where: str) -> tuple[list[int], list[float]]:
    """The k best (id, log-prob) of one position's dict, best first."""
    if len(entry) < k:
        raise BadAnswerError(f"{where}: {len(entry)} log-probs, expected at least k={k}")
    best = sorted(entry.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
    return [i for i, _ in best], [lp for _, lp in best]


def row_outputs(answer: dict, ids: list[int], *, k: int, vocab_size: int, where: str) -> RowOutputs:
    """One completion ``choice`` of a row of `ids` -> its `RowOutputs` (module docstring)."""
    n = len(ids)
    prompt = answer.get("prompt_logprobs")
    if not isinstance(prompt, list) or len(prompt) != n:
        got = len(prompt) if isinstance(prompt, list) else type(prompt).__name__
        raise BadAnswerError(f"{where}: prompt_logprobs of {got} positions, expected {n}")
    gen = (answer.get("logprobs") or {}).get("top_logprobs") or []
    if len(gen) != 1 or not isinstance(gen[0], dict):
        raise BadAnswerError(f"{where}: expected the generated token's top_logprobs")
    top_ids = np.empty((n, k), np.int64)
    top_lp = np.empty((n, k), np.float64)
    target = np.zeros(n, np.float64)
    for t in range(n):
        at = f"{where} position {t}"
        if t + 1 < n:
            entry = prompt[t + 1]
            if not isinstance(entry, dict):
                raise BadAnswerError(f"{at}: prompt_logprobs entry is {type(entry).__name__}")
            lps = {int(i): float(v["logprob"]) for i, v in entry.items()}
            nxt = ids[t + 1]
            if nxt not in lps:
                raise BadAnswerError(f"{at}: no log-prob for the row's next token {nxt}")
            target[t] = lps[nxt]
            # the realised token is always listed; it is in the top-k only by its rank
            ranked = {int(i): int(v.get("rank", 0)) for i, v in entry.items()}
            lps = {i: lp for i, lp in lps.items() if ranked[i] <= k} if len(lps) > k else lps
        else:
            lps = {int(s.removeprefix("token_id:")): float(v) for s, v in gen[0].items()}
        top_ids[t], top_lp[t] = _top(lps, k, where=at)
    bad = ~np.isfinite(top_lp) | (top_lp > 0)
    if bad.any() or not np.isfinite(target).all():
        t = int(np.argwhere(bad.any(-1) | ~np.isfinite(target))[0, 0])
        raise BadAnswerError(f"{where} position {t}: non-finite or positive log-probs")
    if (top_ids < 0).any() or (top_ids >= vocab_size).any():
        raise BadAnswerError(f"{where}: token ids outside [0, {vocab_size})")
    return RowOutputs(
        top_ids.astype(np.int32),
        top_lp.astype(np.float32),
        tail_logprob(top_lp).astype(np.float32),
        target.astype(np.float32),
    )


def _one_line(raw: bytes) -> str:
    try:
        msg = json.loads(raw).get("error", {}).get("message", "")
    except (ValueError, AttributeError):
        msg = raw.decode("utf-8", "replace")
    return " ".join(str(msg).split())[:300]


class ServerClient:
    """Batched, concurrent requests to one server (`url`, its `model`). A request that fails
    to connect or gets a 5xx is retried with backoff until `retry_s` has passed since the first
    try (`retry_name`: the setting that says so, named in the error); a 4xx is the caller's
    error and raised at once."""

    def __init__(
        self, url: str, *, model: str, timeout_s: float = 60.0, retry_s: float = 60.0,
        api_key: str | None = None, rows_per_request: int = 8, in_flight: int = 4,
        retry_name: str = "teachers[i].server_timeout_s",
    ):  # fmt: skip
        self.url, self.model = url.rstrip("/"), model
        self.timeout_s, self.retry_s, self.api_key = timeout_s, retry_s, api_key
        self.retry_name = retry_name
        self.rows_per_request, self.in_flight = rows_per_request, in_flight
        self._pool = ThreadPoolExecutor(in_flight, thread_name_prefix="served-teacher")
        self.latency_s: list[float] = []  # per scoring request, for the run log

    def _send(self, path: str, body: dict | None) -> dict:
        req = urllib.request.Request(self.url + path, method="GET" if body is None else "POST")
        if body is not None:
            req.data = json.dumps(body).encode()
            req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            return json.loads(r.read())

    def request(self, path: str, body: dict | None = None) -> dict:
        start, wait = time.monotonic(), 0.5
        while True:
            try:
                return self._send(path, body)
            except urllib.error.HTTPError as e:
                if e.code < 500:
                    raise BadAnswerError(
                        f"teacher server {self.url}{path}: HTTP {e.code}: {_one_line(e.read())}"
                    ) from None
                why = f"HTTP {e.code}: {_one_line(e.read())}"
            except (urllib.error.URLError, OSError, ValueError) as e:
                why = " ".join(str(getattr(e, "reason", e)).split())
            if time.monotonic() - start + wait > self.retry_s:
                raise TeacherServerError(
                    f"teacher server {self.url}{path}: no answer for {self.retry_s:.0f} s "
                    f"({self.retry_name}): {why}"
                )
            time.sleep(wait)
            wait = min(2 * wait, 5.0)

    def completions(self, rows: list[list[int]], *, k: int) -> list[dict]:
        """One request for `rows`: each row's completion choice, in row order."""
        body = {
            "model": self.model, "prompt": rows, "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": k, "logprobs": k, "return_tokens_as_token_ids": True,
        }  # fmt: skip
        t0 = time.perf_counter()
        got = self.request("/v1/completions", body)
        self.latency_s.append(time.perf_counter() - t0)
        choices = sorted(got.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != len(rows):
            raise BadAnswerError(
                f"teacher server {self.url}: {len(choices)} choices for {len(rows)} prompts"
            )
        return choices

    def score(self, rows: list[list[int]], *, k: int, vocab_size: int) -> list[RowOutputs]:
        """Every row's outputs: requests of `rows_per_request` rows, `in_flight` at a time."""
        step = self.rows_per_request
        parts = [rows[i : i + step] for i in range(0, len(rows), step)]
        answers = list(self._pool.map(lambda p: self.completions(p, k=k), parts))
        out = []
        for i, (part, choices) in enumerate(zip(parts, answers)):
            for j, (ids, choice) in enumerate(zip(part, choices)):
                where = f"teacher server {self.url}: row {i * step + j}"
                out.append(row_outputs(choice, ids, k=k, vocab_size=vocab_size, where=where))
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def connect(
    url: str, *, model: str, server_timeout_s: float, api_key_env: str = "",
    rows_per_request: int = 8, in_flight: int = 4,
    retry_name: str = "teachers[i].server_timeout_s",
) -> ServerClient:  # fmt: skip
    """The client of a served teacher as a config names it (the trainer's ``teachers[i]`` and
    the cache job's flags alike): requests retried for `server_timeout_s`, each one given
    `REQUEST_TIMEOUT_S` at most, the API key read from the variable `api_key_env` names."""
    key = os.environ.get(api_key_env) if api_key_env else None
    return ServerClient(
        url, model=model, timeout_s=min(REQUEST_TIMEOUT_S, server_timeout_s),
        retry_s=server_timeout_s, api_key=key, rows_per_request=rows_per_request,
        in_flight=in_flight, retry_name=retry_name,
    )  # fmt: skip


def check_server(
    client: ServerClient, tokenizer, *, k: int, max_len: int, where: str, probe: str = PROBE
) -> dict:
    """The served teacher is the one the shards were aligned with, or BadAnswerError (one line):
    its model is served, its context holds the longest row, its ``/tokenize`` of `probe` equals
    `tokenizer`'s ids, its tokenizer has the same vocabulary size (id V - 1 decodes, id V does
    not), and it returns ``prompt_logprobs`` of k. Returns what the run log records."""
    url = client.url
    served = {m.get("id"): m for m in client.request("/v1/models").get("data", [])}
    if client.model not in served:
        raise BadAnswerError(f"{where}: {url} serves {sorted(served)}, not {client.model!r}")
    ctx = int(served[client.model].get("max_model_len") or 0)
    if ctx and ctx < max_len + 1:
        raise BadAnswerError(f"{where}: {url} has max_model_len {ctx}, rows need {max_len + 1}")
    body = {"model": client.model, "prompt": probe, "add_special_tokens": False}
    theirs = client.request("/tokenize", body).get("tokens")
    ours = [int(i) for i in tokenizer.encode(probe).ids]
    if theirs != ours:
        raise BadAnswerError(
            f"{where}: {url} tokenizes the probe text otherwise than {tokenizer.name} "
            f"(first ids {theirs[:6] if theirs else theirs} vs {ours[:6]}): another tokenizer"
        )
    v = tokenizer.vocab_size
    last = client.request("/detokenize", {"model": client.model, "tokens": [v - 1]})["prompt"]
    beyond = client.request("/detokenize", {"model": client.model, "tokens": [v]})["prompt"]
    if not last or beyond:
        raise BadAnswerError(f"{where}: {url}'s tokenizer has another vocabulary size than {v}")
    try:
        choice = client.completions([ours[:2]], k=k)[0]
    except BadAnswerError as e:
        raise BadAnswerError(f"{where}: {e} (restart the server with K>={k})") from None
    row_outputs(choice, ours[:2], k=k, vocab_size=v, where=f"{where}: {url}")
    latency = client.latency_s[-1] if client.latency_s else math.nan
    return {"server": url, "model": client.model, "max_model_len": ctx, "latency_s": latency}
