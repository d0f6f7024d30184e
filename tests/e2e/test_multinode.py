"""Several nodes, rehearsed on this machine: two torchrun agents joined by c10d rendezvous on
loopback (gloo), each in its own working directory with its own input cache, reading the shards
from the test S3 server and checkpointing there (docs/parallelism.md, "Several nodes").

One launch series serves every check (`rehearsal`): a 1-node 2-process reference run; the same
run on 2 nodes x 1 process, one node killed (``kill -9`` of its agent and its rank) once the
step-2 checkpoint is in the store; both nodes restarted, resuming from the store; 2 nodes
whose ``checkpoint.dir`` is a local directory each (not shared), refused before step 1; and
2 nodes x 2 processes with HSDP (``dp_replicate=2``) against one node of 4. The one-node
references are forked from the session's `zygote`; so are the nodes' ranks, through its shim
(`tests.zygote_shim`): the agents, their rendezvous, signals and exit codes stay torchrun's own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.common import shakespeare_docs
from bench.storage.seaweed import free_ports
from tests.e2e import procs
from tests.e2e.helpers import REPO
from tests.zygote import SHIM
from tokenbridge.alignment.text_shards import write_text_shards

pytestmark = pytest.mark.slow

STEPS = 8
KILL_AFTER = 2  # one node is killed once this step's checkpoint is in the store
EXIT_WITHIN_S = 60.0
HSDP_STEPS = 4  # the 2 x 2 run: same losses as one node of 4 (no kill: the 2 x 1 run has it)


def _args(student_dir: Path, shards: str, ckpt: str, *, steps: int = STEPS) -> list[str]:
    """The debug run, distilled from a tiny teacher with the student's tokenizer (kd_topk)."""
    return ["conf=debug", "loss=kd_topk", f"teachers.0.path={student_dir}",
            "teachers.0.projection=null", f"data.shards={shards}", f"checkpoint.dir={ckpt}",
            f"steps={steps}", "checkpoint.interval=2", "checkpoint.export_at_end=false",
            "optim.warmup_steps=1", "eval.max_texts=0", "parallel.teacher_placement=inprocess",
            "parallel.collective_timeout_s=30", "run_dir=run", "data.cache_dir=cache",
            "device=cpu", "parallel.threads=1", "logging.progress=false",
            "logging.tensorboard=false", "logging.report=false"]  # fmt: skip


def _env(s3_server) -> dict[str, str]:
    return {**os.environ, **s3_server.env(), "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


def _node(
    cwd: Path, args: list[str], *, env: dict, port: int, host: bool, nproc: int = 1
) -> subprocess.Popen:
    """One "node": a torchrun agent (through `trainer.launch`) in its own working directory;
    its ranks forked from the session's zygote (`env` holds the shim's socket)."""
    cwd.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "trainer.launch", "--nnodes=2", f"--nproc_per_node={nproc}",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=rehearsal",
           f"--rdzv_conf=is_host={str(host).lower()}", "--max-restarts=0",
           str(SHIM), str(REPO / "trainer" / "main.py"), *args]  # fmt: skip
    env = {**env, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def _two_nodes(root: Path, args: list[str], env: dict, *, nproc: int = 1) -> list[subprocess.Popen]:
    port = free_ports(1)[0]
    first = _node(root / "node0", args, env=env, port=port, host=True, nproc=nproc)
    time.sleep(1.0)  # node 0 hosts the rendezvous store
    return [first, _node(root / "node1", args, env=env, port=port, host=False, nproc=nproc)]


def _records(*run_dirs: Path, kind: str = "train") -> dict[int, dict]:
    """Step -> record over every node's run directory (rank 0 writes the log where it runs)."""
    out = {}
    for d in run_dirs:
        path = d / "metrics.jsonl"
        if path.is_file():
            for line in path.read_text().splitlines():
                r = json.loads(line)
                if r["kind"] == kind:
                    out[r["step"]] = r
    return out


def _finish(launched: list[subprocess.Popen], timeout: float = 600) -> list[tuple[int, str]]:
    out = []
    for p in launched:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in (p.pid, *procs.descendants(p.pid)):
                os.kill(pid, signal.SIGKILL)
            _, err = p.communicate()
        out.append((p.returncode, err))
    return out


@pytest.fixture(scope="module")
def rehearsal(zygote, tmp_path_factory, student_dir, s3_server) -> dict:
    tmp = tmp_path_factory.mktemp("multinode")
    shards = write_text_shards(tmp / "shards", shakespeare_docs(24, chars=700),
                          student_dir=student_dir, teacher_dirs=[student_dir], max_tokens=64)  # fmt: skip
    bucket = s3_server.new_bucket()
    url = s3_server.upload(shards, bucket, "shards")
    env = {**_env(s3_server), **zygote.shim_env()}
    seen: dict = {}

    # the reference: one node, two processes
    ref = tmp / "ref"
    ref.mkdir()
    cmd = [str(REPO / "trainer" / "main.py"), *_args(student_dir, url, f"s3://{bucket}/ref")]
    proc = zygote.run(cmd, nproc=2, cwd=ref, env=env, timeout=600)  # forked: tests/zygote.py
    assert proc.returncode == 0, proc.stderr[-6000:]
    seen["ref"] = _records(ref / "run")

    # two nodes, one killed once a checkpoint is in the store
    root = tmp / "two"
    args = _args(student_dir, url, f"s3://{bucket}/two")
    nodes = _two_nodes(root, args, env)
    runs = [root / "node0" / "run", root / "node1" / "run"]
    deadline = time.monotonic() + 600
    client = s3_server.client()
    marker = f"two/step-{KILL_AFTER:08d}/COMPLETED"
    while not client.list_objects_v2(Bucket=bucket, Prefix=marker).get("Contents"):
        assert all(p.poll() is None for p in nodes), _finish(nodes)
        assert time.monotonic() < deadline, "the two-node run made no progress"
        time.sleep(0.1)
    # kill the node that does not hold rank 0 (rank 0 writes the run log where it runs)
    victim = 1 if (runs[0] / "metrics.jsonl").is_file() else 0
    # the node: its torchrun agent and its rank
    pids = {nodes[victim].pid, *procs.descendants(nodes[victim].pid)}
    pids |= zygote.ranks_of(pids)  # the node's ranks, forked for its shims
    t0 = time.monotonic()
    for pid in pids:  # torchrun starts each rank in a session of its own: kill them one by one
        os.kill(pid, signal.SIGKILL)
    survivor = nodes[1 - victim]
    (code, err), = _finish([survivor], timeout=EXIT_WITHIN_S + 60)  # fmt: skip
    seen["survivor"] = {"code": code, "err": err, "took": time.monotonic() - t0, "pids": pids}
    _finish([nodes[victim]])
    seen["killed"] = _records(*runs)

    # both nodes again: the run resumes from the store
    nodes = _two_nodes(root, args, env)
    seen["restart"] = _finish(nodes)
    seen["resumed"] = _records(*runs)
    seen["summary"] = [json.loads((r / "summary.json").read_text()) for r in runs
                       if (r / "summary.json").is_file()]  # fmt: skip

    # two nodes, a local checkpoint directory each: refused before step 1
    local = tmp / "local"
    args = _args(student_dir, url, "ckpt")
    seen["local"] = _finish(_two_nodes(local, args, env), timeout=300)
    seen["local_steps"] = _records(local / "node0" / "run", local / "node1" / "run")

    # HSDP over the nodes: 2 nodes x 2 processes, sharded within a node, replicated across
    # (dp_replicate=2), against one node of 4 processes with the same mesh
    hsdp = ("parallel.dp_replicate=2",)
    ref4 = tmp / "ref4"
    ref4.mkdir()
    cmd = [str(REPO / "trainer" / "main.py"),
           *_args(student_dir, url, f"s3://{bucket}/ref4", steps=HSDP_STEPS), *hsdp]  # fmt: skip
    proc = zygote.run(cmd, nproc=4, cwd=ref4, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    seen["hsdp_ref"] = _records(ref4 / "run")
    root = tmp / "hsdp"
    args = [*_args(student_dir, url, f"s3://{bucket}/hsdp", steps=HSDP_STEPS), *hsdp]
    seen["hsdp"] = _finish(_two_nodes(root, args, env, nproc=2))
    seen["hsdp_records"] = _records(root / "node0" / "run", root / "node1" / "run")
    return seen


def test_two_nodes_repeat_the_one_node_losses_and_resume_after_kill_9(rehearsal):
    """Every step the two nodes logged, before the kill and after the restart resumed from the
    store, equals the 1-node 2-process run (1e-6)."""
    ref = rehearsal["ref"]
    assert sorted(ref) == list(range(1, STEPS + 1))
    killed, resumed = rehearsal["killed"], rehearsal["resumed"]
    assert min(killed) == 1 and max(killed) >= KILL_AFTER
    assert all(code == 0 for code, _ in rehearsal["restart"]), rehearsal["restart"]
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step, r in resumed.items():
        for k in ("loss", "ce", "kd", "grad_norm"):
            assert r[k] == pytest.approx(ref[step][k], rel=1e-6, abs=1e-6), (step, k)
    (summary,) = rehearsal["summary"]
    assert summary["resumed_from"] and "step-0000000" in summary["resumed_from"]
    assert summary["steps"] == STEPS and summary["steps_this_run"] < STEPS


def test_the_surviving_node_names_the_lost_rank_within_a_minute(rehearsal):
    s = rehearsal["survivor"]
    assert s["code"] != 0 and s["took"] < EXIT_WITHIN_S, s
    lines = s["err"].strip().splitlines()
    line = next((x for x in lines if "LostRankError" in x), None)
    assert line is not None, s["err"][-4000:]
    pid = int(line.split(", pid ")[1].split()[0])
    assert pid in s["pids"], (line, s["pids"])  # a process of the node that was killed
    assert "stopped without a word" in line and "restart" in line


def test_a_local_checkpoint_dir_two_nodes_do_not_share_is_refused_before_step_1(rehearsal):
    """Rank 0's node says it in one line (exit 2), the other node's first rank in its own log
    (its agent may then also say that rank 0's node, which hosted the rendezvous, ended first)."""
    (code0, err0), (code1, err1) = rehearsal["local"]
    assert code0 == 2 and code1 != 0, (err0[-3000:], err1[-3000:])
    for i, err in enumerate((err0, err1)):
        lines = [x for x in err.strip().splitlines() if "Error: " in x]  # not preflight's notes
        refused = [x for x in lines if "NotSharedError: config checkpoint.dir=ckpt" in x]
        assert len(refused) == 1 and len(lines) <= 1 + i, err[-4000:]
        assert "not shared by every node" in refused[0] and "s3://" in refused[0]
    assert rehearsal["local_steps"] == {}


def test_two_nodes_of_two_with_hsdp_repeat_the_one_node_losses(rehearsal):
    """2 x 2 processes with ``parallel.dp_replicate=2`` (FSDP within a node, replicas across
    the nodes): every step equals one node of 4 processes with the same mesh (1e-6)."""
    assert all(code == 0 for code, _ in rehearsal["hsdp"]), rehearsal["hsdp"]
    ref, got = rehearsal["hsdp_ref"], rehearsal["hsdp_records"]
    assert sorted(ref) == sorted(got) == list(range(1, HSDP_STEPS + 1))
    for step, r in got.items():
        for k in ("loss", "ce", "kd", "grad_norm"):
            assert r[k] == pytest.approx(ref[step][k], rel=1e-6, abs=1e-6), (step, k)
