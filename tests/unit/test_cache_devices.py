"""The GPU a teacher-cache worker picks (`pipelines.teacher_cache.devices.choose_device`, pure,
checked on CPU; not run on GPUs here): one model per GPU, never all on GPU 0."""

from __future__ import annotations

from pipelines.teacher_cache.devices import choose_device, worker_index


def test_each_worker_picks_its_own_gpu():
    pick = lambda requested, worker_id, visible, count=4: choose_device(  # noqa: E731
        requested, worker_id=worker_id, visible=visible, device_count=count
    )
    # Beam's SDK workers (WORKER_ID) and named Dask workers, round robin over the GPUs
    assert [pick("cuda", f"worker_{i}", None) for i in range(6)] == [
        "cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:0", "cuda:1"
    ]  # fmt: skip
    assert pick("cuda", "gpu-3", None) == "cuda:3" and pick("cuda", 2, None) == "cuda:2"
    # a process started with its own GPU visible takes it; a visible list is picked from
    assert pick("cuda", "worker_3", "5") == "cuda:0"
    assert pick("cuda", "worker_3", "4,5") == "cuda:1"
    assert pick("cuda", "worker_3", "") == "cuda:0"  # none visible: torch will say so
    # a GPU the user named, or the CPU, is kept; no index known: the first GPU
    assert pick("cuda:2", "worker_1", None) == "cuda:2" and pick("cpu", "worker_1", None) == "cpu"
    assert pick("cuda", None, None) == "cuda:0" and pick("cuda", "worker_1", None, 1) == "cuda:0"
    # a Dask worker's default name is its address: its port is no index
    assert worker_index("tcp://127.0.0.1:40123") is None and worker_index("w") is None
