"""How a CPU rank's cores are shared by the student and its teacher workers (``parallel.threads``,
``parallel.cpu_split``).

Where a student and its teacher workers compute at once (off-policy KD, whose teacher runs a
microbatch ahead; on-policy ``lag: 1``, whose teachers score while the student samples), two
OpenMP teams that each take every core fight for them. `plan` gives them threads that add up to
the cores there, and every core to each process elsewhere; `OPENMP_ENV` keeps idle threads from
spinning long. The figures behind both sit beside them. No torch import at module level:
``trainer/main.py`` reads `OPENMP_ENV` before torch loads.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

# An idle OpenMP thread sleeps after ~0.3 ms (libgomp's GOMP_SPINCOUNT; measured CPU time burnt
# by 2 threads going idle: 5-10 ms by default, 0.3 ms at 10,000) rather than at once:
# OMP_WAIT_POLICY=PASSIVE made a 2-thread decode step of the sampler 2.4x slower (29 -> 70 ms:
# every matmul woke the other thread with a futex). OpenMP reads these when torch is first
# imported, so they are set in a worker's environment before it starts (`trainer.teacher.worker`)
# and by trainer/main.py before it imports torch. KMP_BLOCKTIME (ms) is the same knob for torch
# builds on Intel's OpenMP.
OPENMP_ENV = {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "1"}
# the user's own choice of OpenMP waiting, kept as it is
_USER_WAIT = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def openmp_env(environ=os.environ) -> dict[str, str]:
    """`OPENMP_ENV`, or nothing where the environment already says how OpenMP threads wait."""
    return {} if any(k in environ for k in _USER_WAIT) else dict(OPENMP_ENV)


@dataclass(frozen=True)
class CpuPlan:
    """torch intra-op threads per role (None: leave torch's default, all the rank's cores)."""

    student: int | None  # the student, outside the phase below
    overlap: int | None  # the student while its teacher workers compute (on-policy lag 1: sampling)
    worker: int | None  # each teacher worker


# Why threads that add up: OpenMP's barriers wait for every thread of a team, so a team stalls
# whenever the other process holds one of its cores, and libgomp's idle threads spin 5-10 ms
# after each parallel region, holding a core the other team waits for. Measured (SmolLM2-135M
# student, Gemma-3-270M teacher, conf=onpolicy_demo, 2-core AMD EPYC, torch's default of 2
# threads each): an on-policy step took 9-24 s with lag 1 against 5.6 s with lag 0.
# With lag 1 the overlap is arranged to be the sampling (`trainer.onpolicy.side`: the teachers
# score this step's rollouts while the student samples the next step's; the update runs alone
# on every core), because sampling gains least from a second thread (its decode steps are bound
# by reading the weights) and the update most. Measured there (demo models, one step): lag 0, 2
# threads each, ~5.6 s (sample 1.9 + teacher 1.2 + update 2.3); lag 1 with the update on 1
# thread next to the teacher on 1, 5.9 s (the update, 3.6 s on one thread, was the critical
# path); 2 + 1 threads there (not adding up), 6.8 s.
# The cores are not pinned (os.sched_setaffinity): the thread counts stop the fight, and
# unpinned threads can move away from a core that another job on the machine is using.
def plan(
    *, threads: int, split: str, workers: int, pipelined: bool, lag_one: bool, cores: int
) -> CpuPlan:
    """Threads for the student and each of ``workers`` teacher workers on ``cores`` (torch's
    default for this process: the cores it may use, or ``OMP_NUM_THREADS``, which torchrun sets
    to 1 for several local ranks). ``pipelined``: off-policy workers compute a microbatch ahead
    of the student's whole step; ``lag_one``: on-policy workers score while the student samples
    (the comment above). An explicit ``threads`` is used as it is, everywhere."""
    if threads > 0:
        return CpuPlan(threads, threads, threads)
    if split == "off" or workers == 0 or not (pipelined or lag_one):
        return CpuPlan(None, None, None)
    per = max(1, cores // (workers + 1))
    share = max(1, cores - workers * per)
    return CpuPlan(share if pipelined else None, share, per)


def plan_for(cfg, *, device, live_teachers: int) -> CpuPlan:
    """`plan` for a run: ``live_teachers`` off-policy teachers run by workers (not read from a
    cache), plus the on-policy teachers run by workers (not served) when ``onpolicy`` is on."""
    import torch

    par, op = cfg.parallel, cfg.onpolicy
    if device.type != "cpu" or par.teacher_placement != "worker":
        return CpuPlan(*(3 * [par.threads or None]))
    # on-policy teachers with a worker (a served one computes on its server)
    on = len([t for t in cfg.teachers if t.weight != 0 and not t.server]) if op.enabled else 0
    lag_one = op.enabled and op.lag == 1 and on > 0
    return plan(
        threads=par.threads,
        split=par.cpu_split,
        workers=max(live_teachers, on if lag_one else 0),
        pipelined=live_teachers > 0,
        lag_one=lag_one,
        cores=torch.get_num_threads(),
    )


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` inside the block (None: unchanged)."""
    import torch

    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def child_env(extra: dict[str, str]) -> Iterator[None]:
    """``os.environ`` plus ``extra`` inside the block: what a process spawned in it inherits
    (a spawned Python reads its environment before it imports anything)."""
    before = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
