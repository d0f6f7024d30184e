"""How a CPU rank's cores are shared by the student and its teacher workers
(`trainer.parallel.cpus`): threads that add up to the cores where both compute at once, all of
them where they take turns, an explicit ``parallel.threads`` as it is; OpenMP's spin bound
only where the user did not say how threads wait; the environment and thread count restored."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from trainer.config.checks import ConfigError
from trainer.config.sections import ParallelConfig
from trainer.parallel.cpus import (
    OPENMP_ENV,
    CpuPlan,
    child_env,
    openmp_env,
    plan,
    plan_for,
    torch_threads,
)


@pytest.mark.parametrize(
    "kw,want",
    [
        # on-policy lag 1 on 2 cores: the student samples on 1 core next to the worker, and
        # updates alone on both
        ({"cores": 2, "workers": 1, "lag_one": True}, CpuPlan(None, 1, 1)),
        # off-policy: the worker runs a microbatch ahead of the student's whole step
        ({"cores": 2, "workers": 1, "pipelined": True}, CpuPlan(1, 1, 1)),
        ({"cores": 16, "workers": 2, "pipelined": True}, CpuPlan(6, 6, 5)),
        ({"cores": 16, "workers": 1, "lag_one": True}, CpuPlan(None, 8, 8)),
        # one core (torchrun's OMP_NUM_THREADS=1 for several local ranks): one thread each
        ({"cores": 1, "workers": 1, "pipelined": True}, CpuPlan(1, 1, 1)),
        ({"cores": 2, "workers": 3, "pipelined": True}, CpuPlan(1, 1, 1)),
        # taking turns (on-policy lag 0), no worker, or off: torch's default everywhere
        ({"cores": 2, "workers": 1}, CpuPlan(None, None, None)),
        ({"cores": 2, "workers": 0, "pipelined": True}, CpuPlan(None, None, None)),
        ({"cores": 2, "workers": 1, "lag_one": True, "split": "off"}, CpuPlan(None, None, None)),
        # an explicit parallel.threads wins
        ({"cores": 2, "workers": 1, "lag_one": True, "threads": 3}, CpuPlan(3, 3, 3)),
    ],
)
def test_plan(kw, want):
    args = {"threads": 0, "split": "auto", "pipelined": False, "lag_one": False, **kw}
    assert plan(**args) == want


def _cfg(
    *, lag=0, onpolicy=True, placement="worker", weights=(1.0,), split="auto", threads=0,
    servers=None,
):  # fmt: skip
    servers = servers or [None] * len(weights)
    return SimpleNamespace(
        parallel=SimpleNamespace(teacher_placement=placement, cpu_split=split, threads=threads),
        onpolicy=SimpleNamespace(enabled=onpolicy, lag=lag),
        teachers=[SimpleNamespace(weight=w, server=s) for w, s in zip(weights, servers)],
    )


def test_plan_for_a_run(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    cpu, none = torch.device("cpu"), CpuPlan(None, None, None)
    # on-policy lag 0: the student waits for the teacher and the teacher for rollouts
    assert plan_for(_cfg(lag=0), device=cpu, live_teachers=0) == none
    assert plan_for(_cfg(lag=1), device=cpu, live_teachers=0) == CpuPlan(None, 1, 1)
    # a teacher of weight 0 has no worker
    assert plan_for(_cfg(lag=1, weights=(1.0, 0.0)), device=cpu, live_teachers=0) == CpuPlan(
        None, 1, 1
    )
    # a served teacher scores on its server: no worker to share the cores with
    served = _cfg(lag=1, weights=(1.0, 1.0), servers=["http://h:1", None])
    assert plan_for(served, device=cpu, live_teachers=0) == CpuPlan(None, 1, 1)
    served.teachers[1].server = "http://h:2"
    assert plan_for(served, device=cpu, live_teachers=0) == none
    # off-policy KD by a live worker (alone, or in the off-policy steps of an on-policy run)
    assert plan_for(_cfg(onpolicy=False), device=cpu, live_teachers=1) == CpuPlan(1, 1, 1)
    assert plan_for(_cfg(lag=1), device=cpu, live_teachers=1) == CpuPlan(1, 1, 1)
    # no worker process, or not a CPU: only an explicit parallel.threads
    assert plan_for(_cfg(lag=1, placement="inprocess"), device=cpu, live_teachers=1) == none
    assert plan_for(_cfg(lag=1), device=torch.device("cuda", 0), live_teachers=1) == none
    cuda = plan_for(_cfg(lag=1, threads=2), device=torch.device("cuda", 0), live_teachers=1)
    assert cuda == CpuPlan(2, 2, 2)
    assert plan_for(_cfg(lag=1, threads=1), device=cpu, live_teachers=0) == CpuPlan(1, 1, 1)


def test_cpu_split_is_validated():
    with pytest.raises(ConfigError, match="parallel.cpu_split"):
        ParallelConfig(cpu_split="pinned")


def test_openmp_env_keeps_the_users_choice():
    assert openmp_env({}) == OPENMP_ENV
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        assert openmp_env({key: "x"}) == {}


def test_child_env_and_torch_threads_restore(monkeypatch):
    monkeypatch.setenv("TB_TEST_KEPT", "a")
    monkeypatch.delenv("TB_TEST_NEW", raising=False)
    with child_env({"TB_TEST_KEPT": "b", "TB_TEST_NEW": "c"}):
        assert os.environ["TB_TEST_KEPT"] == "b" and os.environ["TB_TEST_NEW"] == "c"
    assert os.environ["TB_TEST_KEPT"] == "a" and "TB_TEST_NEW" not in os.environ
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with torch_threads(None):
        assert torch.get_num_threads() == before
