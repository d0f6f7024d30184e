"""The teacher-cache job through a served teacher (``--teacher-server``, `served_handler`).

Against the session's one vLLM server (the ``served_teacher`` fixture: a tiny teacher saved
with SmolLM2's tokenizer), the same shard rows are cached twice on the FnApiRunner: by the
teacher's weights in the worker, and through the server. The served cache is the same format
and passes the same checks (COMPLETED, checksums, the trainer's reader with the teacher's
fingerprints); its values are the local teacher's: per position the same top-k set (but for
near-ties at its boundary), the log-probs and realised-token log-probs within 1e-4 (relative
past |log p| = 1), the tail bucket's probability within 1e-5. What a server cannot give, or a
server that must not be used, is refused in one line (exit 2) before the pipeline starts; an
unreachable one stops the job (exit 1) naming it, at the preflight or once the workers send
their rows; a row answered with a NaN goes to the dead letters (both faults through a real
HTTP hop, `tests.served_proxy`).
"""

from __future__ import annotations

import io
import json
import re
import socket

import numpy as np
import pytest

from bench.common import shakespeare_docs
from pipelines.teacher_cache import job, score_dofns
from tests.served_proxy import FaultyProxy
from tokenbridge import cli
from tokenbridge.alignment.text_shards import write_text_shards
from tokenbridge.commands import verify
from tokenbridge.formats import shard_schema, shards
from tokenbridge.formats.fingerprints import weights_fingerprint
from tokenbridge.formats.teacher_cache_reader import Expected, open_cache
from tokenbridge.tokenizers import load_tokenizer

pytestmark = pytest.mark.slow
K = 32
# another engine's kernels, fp32 both: its logits differ by ~1e-5 relative, so a log-prob is
# compared within 1e-4, relative past |log p| = 1 (the ids far down a peaked top-k)
TOL = 1e-4
TAIL_ATOL = 1e-5  # the tail bucket's probability
NEAR_TIE = 2 * TOL  # a top-k set may differ only at its boundary: both sides' errors apart
PROG = "tokenbridge teacher_cache:"


@pytest.fixture(scope="module")
def caches(tmp_path_factory, served_teacher, student_dir) -> dict:
    url, model, teacher, _ = served_teacher
    tmp = tmp_path_factory.mktemp("served_cache")
    d = write_text_shards(tmp / "shards", shakespeare_docs(6, chars=500),
                          student_dir=student_dir, teacher_dirs=[teacher])  # fmt: skip
    base = ["--shards", str(d), "--teacher", teacher, "--k", str(K), "--threads", "1",
            "--logprob-dtype", "float32", "--rows-per-task", "8", "--batch-tokens", "1024",
            "--direct_num_workers", "1"]  # fmt: skip
    served = [*base, "--teacher-server", url, "--served-model", model, "--rows-per-request", "4"]
    return {
        "shards": d, "teacher": teacher, "base": base, "served_args": served, "tmp": tmp,
        "local": job.run([*base, "--out", str(tmp / "local")]),
        "served": job.run([*served, "--out", str(tmp / "served")]),
    }  # fmt: skip


def _close(got, want, tol: float = TOL):
    return np.abs(np.subtract(got, want)) <= tol * np.maximum(1.0, np.abs(want))


def _open(d, inputs):
    """The cache as the trainer opens it (`cached_teacher.open_teacher_cache`'s checks)."""
    ss = shards.open_shards(inputs["shards"])
    exp = Expected(ss, 0, tokenizer=load_tokenizer(inputs["teacher"]).info(),
                   weights=weights_fingerprint(inputs["teacher"]), dtype="float32",
                   where="teachers[0].cache")  # fmt: skip
    return ss, open_cache(d, exp, verify="first_open")


def test_a_cache_built_through_the_server_is_the_local_teachers(caches):
    local, served = caches["local"], caches["served"]
    assert served["cache"] == local["cache"]  # same promise: fingerprints, k, dtype, target
    assert served["rows"] == local["rows"] > 0 and served["dead_letters"] == 0
    assert served["teacher_tokens"] == local["teacher_tokens"]
    assert served["teacher_server"]["model"] == "tiny" and "teacher_server" not in local
    out = io.StringIO()
    assert verify.verify_path(caches["tmp"] / "served", out) == 0, out.getvalue()
    ss, a = _open(caches["tmp"] / "local", caches)
    _, b = _open(caches["tmp"] / "served", caches)
    positions = differ = 0
    for row in range(ss.num_rows):
        x, y = a.read(row), b.read(row)
        assert x.topk_ids.shape == y.topk_ids.shape == (x.tail_logprob.shape[0], K)
        # the tail is 1 - (a sum of K probabilities), its log-prob amplifies their 1e-5
        # differences by 1 / tail mass: compared as the probability the loss weighs it by
        tail_x, tail_y = np.exp(x.tail_logprob.astype(np.float64)), np.exp(y.tail_logprob)
        np.testing.assert_allclose(tail_y, tail_x, atol=TAIL_ATOL, rtol=0)
        assert _close(y.target_logprob, x.target_logprob).all(), row
        for t in range(x.topk_ids.shape[0]):
            positions += 1
            ours = dict(zip(x.topk_ids[t].tolist(), x.topk_logprobs[t].tolist()))
            theirs = dict(zip(y.topk_ids[t].tolist(), y.topk_logprobs[t].tolist()))
            for i in ours.keys() & theirs.keys():
                assert _close(theirs[i], ours[i]), (row, t, i, ours[i], theirs[i])
            if ours.keys() != theirs.keys():
                differ += 1
                # only a swap at the boundary: each id one side alone holds sits at its k-th
                for side, only in ((ours, ours.keys() - theirs.keys()),
                                   (theirs, theirs.keys() - ours.keys())):  # fmt: skip
                    kth = min(side.values())
                    assert all(_close(side[i], kth, NEAR_TIE) for i in only), (row, t, only)
    assert positions == local["teacher_tokens"]
    assert differ <= 0.01 * positions, (differ, positions)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_or_flag_that_must_not_be_used_is_refused_in_one_line(
    caches, served_teacher, capsys
):
    """Through the command (the flags alone: tests/unit/test_cache_server_flags.py)."""
    url = served_teacher[0]
    served = caches["served_args"]
    dead = f"http://127.0.0.1:{_free_port()}"
    cases = {
        "samples": ([*served, "--samples", "2"], 2,
                    r"--samples 2: --teacher-server returns top-k log-probs, not draws"),
        "model": ([*served, "--served-model", "other"], 2,
                  rf"--teacher-server: {re.escape(url)} serves \['tiny'\], not 'other'"),
        "k": ([*served, "--k", "65"], 2, r"greater than max allowed: 64.* \(restart the server "
              r"with K>=65\)"),
        "down": ([*_through(served, dead), "--server-timeout-s", "1"], 1,
                 rf"TeacherServerError: teacher server {re.escape(dead)}/v1/models: no answer "
                 r"for 1 s \(--server-timeout-s\).*; restart the server"),
    }  # fmt: skip
    for case, (argv, code, pattern) in cases.items():
        out = caches["tmp"] / f"refused-{case.replace(' ', '-')}"
        capsys.readouterr()
        got = cli.run(job.main, [*argv, "--out", str(out)], prog="teacher_cache", rules=job.RULES)
        lines = _said(capsys)
        assert got == code and len(lines) == 1, (case, got, lines)
        assert re.search(pattern, lines[0]), (case, lines[0])
        assert not out.exists(), case  # refused before anything was written


def _said(capsys) -> list[str]:
    """The command's own lines (Beam logs a failed DoFn's traceback as well, at ERROR)."""
    return [x for x in capsys.readouterr().err.splitlines() if x.startswith(PROG)]


def _through(argv: list[str], url: str) -> list[str]:
    return [url if a.startswith("http://") else a for a in argv]


def test_a_nan_answer_is_a_dead_letter_and_a_server_gone_stops_the_job(caches, capsys):
    ss = shards.open_shards(caches["shards"])
    poison = ss.table().column(shard_schema.teacher_ids_column(0))[0].as_py()  # file 0, row 0
    url, tmp = caches["served"]["teacher_server"]["server"], caches["tmp"]
    with FaultyProxy(url, poison=poison) as proxy:
        argv = [*_through(caches["served_args"], proxy.url), "--max-dead-fraction", "0.5"]
        stats = job.run([*argv, "--out", str(tmp / "poisoned")])
    assert stats["rows"] == caches["served"]["rows"] - 1
    assert stats["drops_by_reason"] == {score_dofns.INFERENCE_ERROR: 1}
    dead = (tmp / "poisoned" / shard_schema.DEAD_LETTER_FILE).read_text().splitlines()
    rec = json.loads(dead[0])
    assert (rec["shard_file"], rec["row"]) == (ss.files[0].name, 0), rec
    assert re.search(r"BadAnswerError: .* position 0: non-finite", rec["detail"]), rec
    # the server gone once the preflight passed: the workers' requests stop the job
    out = tmp / "gone"
    with FaultyProxy(url, healthy=1) as proxy:
        argv = [*_through(caches["served_args"], proxy.url), "--server-timeout-s", "1"]
        capsys.readouterr()
        code = cli.run(job.main, [*argv, "--out", str(out)], prog="teacher_cache",
                       rules=job.RULES)  # fmt: skip
    lines = _said(capsys)
    assert code == 1 and len(lines) == 1, (code, lines)
    assert re.match(
        rf"tokenbridge teacher_cache: TeacherServerError: teacher server {re.escape(proxy.url)}"
        r"/v1/completions: no answer for 1 s \(--server-timeout-s\): HTTP 503: the engine went "
        r"away.*; restart the server", lines[0],
    ), lines[0]  # fmt: skip
    assert not (out / shard_schema.COMPLETED_MARKER).exists()
