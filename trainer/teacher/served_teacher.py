"""A teacher served by vLLM (``teachers[i].server``) as a feed source, beside the worker, the
in-process teacher and the cache.

Each microbatch's teacher rows (the aligned ids, unpadded) are sent on `submit`, in a background
thread, so the server scores microbatch i + 1 while the student steps on i, as the worker does;
`receive` waits for them and lays them out as the worker's slot would be: top-k ids and log-probs,
tail, realised-token log-prob, [B, U_max, ...], padding empty. The preflight checks the server
first (`open_served`; the client and the checks: `tokenbridge.teacher.served`).

Legend: B rows, U teacher positions, K top-k.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tokenbridge.teacher.outputs import TeacherOutputSpec, allocate_teacher_outputs
from tokenbridge.teacher.served import ServerClient, check_server, connect
from trainer.config.schema import TeacherConfig
from trainer.teacher.cached_teacher import CachedReceived


def client_for(t_cfg: TeacherConfig) -> ServerClient:
    return connect(t_cfg.server, model=t_cfg.served_model or t_cfg.name,
                   server_timeout_s=t_cfg.server_timeout_s, api_key_env=t_cfg.api_key_env)  # fmt: skip


def open_served(t_cfg: TeacherConfig, *, index: int, tokenizer, k: int, max_len: int) -> dict:
    """Check teacher `index`'s server against the shards' tokenizer and the loss's k (raises
    `BadAnswerError`, a ValueError: exit 2); what it reports, for the run log."""
    client = client_for(t_cfg)
    try:
        return check_server(client, tokenizer, k=max(k, 1), max_len=max_len,
                            where=f"teachers[{index}].server")  # fmt: skip
    finally:
        client.close()


class ServedTeacher:
    """One KD term's teacher outputs, scored by a server in the order microbatches come."""

    kind = "served teacher"

    def __init__(
        self, client: ServerClient, spec: TeacherOutputSpec, *, index: int, device, depth: int
    ):
        if spec.columns or spec.rest_sorted or spec.temperature != 1.0:
            raise ValueError(f"teachers[{index}].server: a server returns top-k and target "
                             f"log-probs at temperature 1, the loss asks for {spec}")  # fmt: skip
        self.client, self.spec, self.index = client, spec, index
        self.device, self.depth = torch.device(device), depth
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="served-feed")
        self._pending: deque[Future] = deque()
        self._seq = 0

    def submit(self, mb, prep=None) -> None:
        a = mb.aligned[self.index]
        self.submit_rows(a.teacher_ids, a.teacher_len)

    def submit_rows(self, ids_BU: torch.Tensor, lens_B: torch.Tensor) -> None:
        """Score rows ``ids_BU[b, :lens_B[b]]`` (right-padded) in the background; their
        outputs come [B, U] from `receive`, in submission order."""
        ids_BU = ids_BU.cpu()
        rows = [ids_BU[b, :n].tolist() for b, n in enumerate(lens_B.tolist())]
        self._pending.append(self._pool.submit(self._score, rows, int(ids_BU.shape[1])))

    def done(self) -> bool:
        """Has every submitted microbatch been scored (`receive` would not wait)? Never waits."""
        return all(f.done() for f in self._pending)

    def _score(self, rows: list[list[int]], u_max: int) -> tuple[dict, float]:
        t0 = time.perf_counter()
        spec = self.spec
        got = self.client.score(rows, k=max(spec.topk, 1), vocab_size=spec.vocab_size)
        out = allocate_teacher_outputs(spec, len(rows), u_max)
        if spec.topk:  # padding: an empty distribution, as a cache reads it; never read
            out.topk_ids.fill_(-1)
            out.topk_logprobs.fill_(float("-inf"))
        for b, r in enumerate(got):
            n = r.target_logprob.shape[0]
            if spec.topk:
                out.topk_ids[b, :n] = torch.from_numpy(r.topk_ids[:, : spec.topk])
                out.topk_logprobs[b, :n] = torch.from_numpy(r.topk_logprobs[:, : spec.topk])
                out.tail_logprob[b, :n] = torch.from_numpy(r.tail_logprob)
            if spec.target:
                out.target_logprob[b, :n] = torch.from_numpy(r.target_logprob)
        return out.tensors(), time.perf_counter() - t0

    def receive(self) -> CachedReceived:
        outs, seconds = self._pending.popleft().result()
        self._seq += 1
        return CachedReceived({k: v.to(self.device) for k, v in outs.items()}, seconds,
                              self._seq - 1)  # fmt: skip

    def close(self) -> None:
        for f in self._pending:
            f.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
