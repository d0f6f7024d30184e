"""Multi-process tests of the teacher worker behind the logit channel (CPU, spawn, gloo).

A tiny random-init Llama with the real SmolLM2 tokenizer's vocabulary, fed with that tokenizer's
ids of real text (a small vocabulary keeps 24 top-k steps cheap; the unit tests cover the
262k-wide Gemma head): outputs through the worker equal in-process ones; slots are reused with no
growth of shared memory or open files; a killed, hung or failing worker gives a clear error in
bounded time; a student killed by SIGTERM / Ctrl-C / SIGKILL or failing on a dead worker exits
non-zero with one line (its traceback only with TOKENBRIDGE_DEBUG=1) and leaves no process, no
/dev/shm segment and nothing for Python's resource tracker to report behind (the segment's name
is unlinked as soon as the worker has mapped it). The CUDA IPC twin is marked
``cuda`` (skipped without a GPU). Worker starts are the cost here (~3 s
each on 2 cores), so each test starts its workers together.

Run as a module (``python -m tests.dist.test_teacher_worker student DIR``) this file is the
student process the signal tests launch.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch

from tests.tiny import save_tiny_llama
from tokenbridge.paths import REPO_ROOT
from tokenbridge.teacher.outputs import TeacherOutputSpec
from trainer.config.schema import TeacherConfig
from trainer.parallel.cpus import openmp_env
from trainer.teacher.channel import ChannelConfig, TeacherChannel
from trainer.teacher.model_program import TeacherModelProgram
from trainer.teacher.ring import (
    SHM_PREFIX,
    ChannelError,
    TeacherTimeoutError,
    TeacherWorkerError,
    shm_mappings,
)
from trainer.teacher.worker import TeacherContext, TeacherGroup

MAX_B, MAX_T, K = 3, 32, 8
VOCAB = 49_152  # SmolLM2's tokenizer (the fixture checks it against the real config)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, student_dir):
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(student_dir).vocab_size == VOCAB
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-teacher"), VOCAB)


@pytest.fixture(scope="module")
def batches(student_dir, corpus_dir):
    """Microbatches of real text through the real SmolLM2 tokenizer, varied B and T."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(student_dir / "tokenizer.json"))
    text = sorted((corpus_dir / "shakespeare").glob("*.txt"))[0].read_text()[:20_000]
    lines = [ln.strip() for ln in text.splitlines() if len(ln.strip()) > 20]
    out = []
    for i in range(24):
        rows, length = 1 + i % MAX_B, 8 + (5 * i) % (MAX_T - 7)
        ids = torch.zeros(rows, length, dtype=torch.int64)  # pad id 0, right padding
        mask = torch.zeros(rows, length, dtype=torch.int64)
        for r in range(rows):
            enc = [1] + tok.encode(lines[(i * MAX_B + r) % len(lines)]).ids[: length - 1]
            ids[r, : len(enc)] = torch.tensor(enc)
            mask[r, : len(enc)] = 1
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


@pytest.fixture(autouse=True)
def one_thread():
    """Student and workers share 2 cores: one intra-op thread each (spinning OpenMP threads
    of two processes on shared cores made steps ~8x slower here), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def config(**kw) -> ChannelConfig:
    return ChannelConfig(**{"depth": 2, "timeout_s": 60, "worker_threads": 1, **kw})


def program(model_dir: str) -> TeacherModelProgram:
    """The trainer's teacher program on a pretrained directory (loaded where it runs)."""
    spec = TeacherOutputSpec(vocab_size=VOCAB, topk=K, target=True)
    return TeacherModelProgram(TeacherConfig(path=model_dir), spec, max_batch=MAX_B, max_len=MAX_T)


def our_shm() -> set[str]:
    """Our segments still named in /dev/shm (none once the worker has mapped them)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"{SHM_PREFIX}{os.getpid()}_")}


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


_BEFORE: set[int] = set()  # our children when the test began (see `children_before`)


@pytest.fixture(autouse=True)
def children_before():
    """The session's servers an earlier test in this pytest process started (object store,
    Dask cluster, vLLM, `tests.zygote`) are no worker of this test's."""
    _BEFORE.clear()
    _BEFORE.update(p.pid for p in psutil.Process().children())


def workers_left() -> list[psutil.Process]:
    """Child processes this test started that still run, except multiprocessing's resource
    tracker (lives as long as we do) and the session's servers."""
    kids = psutil.Process().children()
    keep = ("resource_tracker", "weed", "tests.zygote")
    return [
        k for k in kids
        if k.pid not in _BEFORE and not any(w in " ".join(k.cmdline()) for w in keep)
    ]  # fmt: skip


def shm_maps(pid: int) -> int:
    return sum(SHM_PREFIX in m.path for m in psutil.Process(pid).memory_maps(grouped=False))


def test_round_trip_equals_inprocess_slots_reused_then_worker_killed(tiny_dir, batches):
    ch = TeacherChannel(program(tiny_dir), config=config())
    reference = program(tiny_dir)
    reference.setup(TeacherContext(torch.device("cpu")))  # loads while the worker loads
    try:
        me = psutil.Process()
        ptrs: dict[int, set[int]] = {0: set(), 1: set()}
        ch.submit(batches[0])
        for i, batch in enumerate(batches):
            if i + 1 < len(batches):
                ch.submit(batches[i + 1])  # the worker computes i+1 while we use i
            with ch.receive() as r:
                want = reference(batch)
                for name, t in r.outputs.items():
                    assert torch.equal(t, want[name]), (i, name)
                ptrs[r.slot].add(r.outputs["topk_logprobs"].data_ptr())
            if i == 2:
                worker = psutil.Process(ch.worker_pid)
                base = (me.num_fds(), worker.num_fds(), shm_maps(ch.worker_pid), shm_mappings())
                # its idle OpenMP threads spin briefly, then sleep (trainer.parallel.cpus): set
                # in its environment before it imported torch, not left in ours
                env = worker.environ()
                assert all(env.get(k) == v for k, v in openmp_env().items())
                assert all(os.environ.get(k) != v for k, v in openmp_env().items())
        # 24 steps: one buffer per slot, the same segment, no new files or mappings.
        assert all(len(p) == 1 for p in ptrs.values()) and ptrs[0] != ptrs[1]
        now = (me.num_fds(), worker.num_fds(), shm_maps(ch.worker_pid), shm_mappings())
        assert now == base and set(base[3]) == {ch.shm_name} and base[2] >= 1
        assert not our_shm()  # mapped by both: its name is gone

        # done() never waits: false while the worker cannot compute (stopped), true once both
        # microbatches are in; what it took early is received in order, unchanged
        os.kill(ch.worker_pid, signal.SIGSTOP)
        ch.submit(batches[3])
        ch.submit(batches[4])
        time.sleep(0.2)
        assert not ch.done()
        os.kill(ch.worker_pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not ch.done():
            assert time.monotonic() < deadline, "done() never became true"
            time.sleep(0.01)
        for batch in (batches[3], batches[4]):
            with ch.receive() as r:
                want = reference(batch)
                assert all(torch.equal(t, want[name]) for name, t in r.outputs.items())
        assert ch.done()  # nothing in flight

        # Kill the worker while it computes: a clear error, well inside the 60 s timeout.
        ch.submit(batches[5])
        os.kill(ch.worker_pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TeacherWorkerError, match=r"pid \d+\) was killed by signal SIGKILL"):
            ch.receive()
        assert time.monotonic() - t0 < 5
        with pytest.raises(ChannelError, match="broken"):
            ch.submit(batches[0])
    finally:
        pid, name = ch.worker_pid, ch.shm_name
        ch.close()
    assert gone(pid) and not workers_left() and not os.path.exists(f"/dev/shm/{name}")


def test_teacher_group_then_load_error_compute_error_and_hang(tiny_dir, batches, monkeypatch):
    # As under torchrun: the workers must not see (or join) the student's rendezvous.
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fast = config(start_timeout_s=60, poll_s=0.02)
    group = [TeacherGroup(f"tcp://127.0.0.1:{port}", world_size=2, rank=r) for r in range(2)]
    failing = TeacherChannel(program(tiny_dir), config=fast, group=group[0])
    hanging = TeacherChannel(program(tiny_dir), config=fast, group=group[1])
    broken = TeacherChannel(program("/nonexistent/teacher-dir"), config=fast)
    chans = [failing, hanging, broken]
    pids, names = [c.worker_pid for c in chans], [c.shm_name for c in chans]
    try:
        # Two workers formed their own process group (an all_reduce ran in it), apart from us.
        infos = [failing.wait_ready(), hanging.wait_ready()]
        assert [(i["group_rank"], i["group_size"]) for i in infos] == [(0, 2), (1, 2)]
        assert [i["group_handshake"] for i in infos] == [2.0, 2.0]
        assert [i["launcher_env"] for i in infos] == [[], []]
        assert not torch.distributed.is_initialized()
        for r, c in enumerate((failing, hanging)):
            c.submit(batches[r])
            with c.receive() as got:
                assert got.outputs["topk_ids"].shape == (*batches[r]["input_ids"].shape, K)

        # The teacher cannot load: the worker's own traceback comes back.
        with pytest.raises(TeacherWorkerError) as e:
            broken.wait_ready()
        msg = str(e.value)
        assert "failed while loading the teacher" in msg and "Traceback" in msg
        assert "/nonexistent/teacher-dir" in msg

        # An error inside the forward (an id outside the embedding) -> its traceback.
        bad = {k: v.clone() for k, v in batches[0].items()}
        bad["input_ids"][0, 1] = 10**7
        failing.submit(bad)
        with pytest.raises(
            TeacherWorkerError, match=r"(?s)computing microbatch 1.*Traceback.*index"
        ):
            failing.receive()

        # A hung worker (stopped): a timeout error after `timeout`, and the worker is killed.
        os.kill(hanging.worker_pid, signal.SIGSTOP)
        hanging.submit(batches[1])
        t0 = time.monotonic()
        with pytest.raises(TeacherTimeoutError, match=r"no answer in 1.0 s while computing"):
            hanging.receive(timeout=1.0)
        assert 1.0 <= time.monotonic() - t0 < 4
        assert gone(pids[1])  # killed by the channel, before close()
    finally:
        for c in chans:
            c.close()
    assert all(gone(p) for p in pids) and not workers_left()
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)


def _launch(model_dir: str, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.dist.test_teacher_worker", "student", model_dir],
        cwd=REPO_ROOT,
        env={**os.environ, "TOKENBRIDGE_DEBUG": "", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal job would be
    )
    return proc


def test_student_exits_cleanly_on_dead_worker_sigterm_ctrl_c_and_sigkill(tiny_dir):
    cases = ("kill_worker", "kill_worker_debug", "sigterm", "ctrl_c", "sigkill")
    debug = {"TOKENBRIDGE_DEBUG": "1"}
    procs = {case: _launch(tiny_dir, debug if "debug" in case else None) for case in cases}
    try:
        ready = {}
        for case, p in procs.items():
            line = p.stdout.readline()  # "READY <worker pid> <shm name>" once it is stepping
            assert line.startswith("READY"), (case, line, p.stderr.read() if p.poll() else "")
            ready[case] = (int(line.split()[1]), line.split()[2])
        os.kill(ready["kill_worker"][0], signal.SIGKILL)
        os.kill(ready["kill_worker_debug"][0], signal.SIGKILL)
        procs["sigterm"].send_signal(signal.SIGTERM)
        os.killpg(procs["ctrl_c"].pid, signal.SIGINT)  # Ctrl-C reaches student and worker
        procs["sigkill"].kill()  # no cleanup code runs in the student at all
        results = {case: (p.wait(timeout=30), p.stderr.read()) for case, p in procs.items()}
    finally:  # a student that did not end (the test failed) must not step on, nor its worker
        for p in procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    # killed mid-forward, the student's wait sees it; killed idle (a fast worker has already
    # answered: the usual case on many cores), the student's next submit does
    killed = (
        r"tokenbridge student: TeacherWorkerError: teacher worker \(pid \d+\) was killed by "
        r"signal SIGKILL while (computing|receiving) microbatch \d+; .*out-of-memory killer"
    )
    code, err = results["kill_worker"]
    # the worker's "Loading weights" progress bar is output, not an error
    lines = [ln for ln in err.splitlines() if ln.strip() and "Loading weights" not in ln]
    assert code == 1 and len(lines) == 1 and re.match(killed, lines[0]), err[-3000:]
    code, err = results["kill_worker_debug"]
    assert code == 1 and "Traceback" in err and re.match(killed, err.splitlines()[-1]), err
    assert results["sigterm"][0] == 128 + signal.SIGTERM
    code, err = results["ctrl_c"]
    assert code == 130 and err.splitlines()[-1] == "tokenbridge student: interrupted", err
    assert results["sigkill"][0] == -signal.SIGKILL
    for case, (_, err) in results.items():  # the resource tracker had nothing to report
        assert "resource_tracker" not in err and "leaked" not in err, (case, err[-3000:])
        assert ("Traceback" in err) == (case == "kill_worker_debug"), (case, err[-3000:])
    for case, (pid, name) in ready.items():
        # SIGKILL of the student: the worker follows it (PR_SET_PDEATHSIG) and Python's
        # resource tracker unlinks the segment; both take a moment.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (
            gone(pid) and not os.path.exists(f"/dev/shm/{name}")
        ):
            time.sleep(0.05)
        assert gone(pid), f"{case}: worker {pid} outlived its student"
        assert not os.path.exists(f"/dev/shm/{name}"), f"{case}: {name} left in /dev/shm"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ipc_round_trip_reuse_and_kill(tiny_dir, batches):
    """The GPU twin of the first test: one CUDA allocation shared by IPC handle, ordered by
    interprocess events; outputs equal in-process ones and land on the student's device."""
    device = torch.device("cuda", torch.cuda.current_device())
    ch = TeacherChannel(program(tiny_dir), device=device, config=config())
    reference = program(tiny_dir)
    reference.setup(TeacherContext(device))
    try:
        assert ch.shm_name is None
        ptrs: dict[int, set[int]] = {0: set(), 1: set()}
        ch.submit(batches[0])
        for i, batch in enumerate(batches):
            if i + 1 < len(batches):
                ch.submit(batches[i + 1])
            with ch.receive() as r:
                want = reference({k: v.to(device) for k, v in batch.items()})
                for name, t in r.outputs.items():
                    assert t.device == device
                    torch.testing.assert_close(t, want[name], rtol=1e-5, atol=1e-5)
                ptrs[r.slot].add(r.outputs["topk_logprobs"].data_ptr())
        assert all(len(p) == 1 for p in ptrs.values()) and ptrs[0] != ptrs[1]
        ch.submit(batches[3])
        os.kill(ch.worker_pid, signal.SIGKILL)
        with pytest.raises(TeacherWorkerError, match="was killed by signal SIGKILL"):
            ch.receive()
    finally:
        pid = ch.worker_pid
        ch.close()
    assert gone(pid) and not workers_left()


def _student(model_dir: str) -> None:
    """A student loop stepping forever (until a signal or a worker failure ends it)."""
    # Ctrl-C as a terminal's foreground job gets it: a suite started in the background of a
    # non-interactive shell hands its children SIGINT ignored, and Python then keeps it so
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(1)
    ch = TeacherChannel(program(model_dir), config=config(timeout_s=30, start_timeout_s=60))
    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, 1000, (2, 16), generator=g),
        "attention_mask": torch.ones(2, 16, dtype=torch.int64),
    }
    ch.submit(batch)
    ch.submit(batch)
    step = 0
    while True:
        with ch.receive() as r:
            r.outputs["topk_logprobs"].sum()
        if step == 1:
            print("READY", ch.worker_pid, ch.shm_name, flush=True)
        ch.submit(batch)
        step += 1
        time.sleep(0.02)


if __name__ == "__main__" and sys.argv[1:2] == ["student"]:
    from tokenbridge import cli
    from trainer.main import RULES

    # as trainer/main.py does: a failure is one line (the traceback with TOKENBRIDGE_DEBUG=1)
    sys.exit(cli.run(lambda argv: _student(sys.argv[2]), prog="student", rules=RULES))
