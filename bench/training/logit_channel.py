"""Transfer of teacher outputs: the logit channel vs pickling the same tensors through a pipe.

Both in the same process layout, a producer holding the payload and a consumer that reads it;
each method runs in its own consumer process (``--method``), so its peak RSS is its own.
``--device cuda`` measures the GPU path, CUDA IPC (the ``channel_cuda`` section).
"""

from __future__ import annotations

import json
import pickle
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.multiprocessing

from trainer.teacher.channel import ChannelConfig, TeacherChannel
from trainer.teacher.ring import TensorSpec

# the code these figures depend on (`bench.provenance.measured_paths`): a later change
# to any of it marks the kept section stale
MEASURES = (
    "trainer/teacher",
    "bench/training/logit_channel.py",
)


SIZES = (4 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20)  # bytes per microbatch


def _reps(nbytes: int) -> int:
    return 20 if nbytes <= 1 << 20 else (5 if nbytes <= 64 << 20 else 3)


def _touch(t: torch.Tensor) -> float:
    """CPU: read one float per 4 KiB page (every page faulted in, almost no arithmetic). GPU:
    read every element (a bandwidth-bound pass); ``float`` waits for it either way."""
    if t.is_cuda:
        return float(t.sum())
    return float(t.view(-1)[::1024].sum())


@dataclass
class PayloadTeacher:
    """A teacher program whose outputs are a fixed float32 payload held in its own memory."""

    nbytes: int
    _payload: Any = field(default=None, init=False, repr=False)

    def input_spec(self) -> dict[str, TensorSpec]:
        return {"step": TensorSpec((1,), torch.int64)}

    def output_spec(self) -> dict[str, TensorSpec]:
        return {"payload": TensorSpec((self.nbytes // 4,), torch.float32)}

    def setup(self, ctx) -> None:
        self._payload = torch.ones(self.nbytes // 4, device=ctx.device)

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"payload": self._payload}


def _pipe_producer(conn, nbytes: int, device: str) -> None:
    payload = {"payload": torch.ones(nbytes // 4, device=device)}
    conn.send("ready")
    while conn.recv() == "go":
        conn.send_bytes(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))


def _time_pipe(nbytes: int, device: str) -> list[float]:
    ctx = torch.multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_pipe_producer, args=(child, nbytes, device), daemon=True)
    proc.start()
    child.close()
    assert conn.recv() == "ready"
    times = []
    for i in range(_reps(nbytes) + 2):
        t0 = time.perf_counter()
        conn.send("go")
        got = pickle.loads(conn.recv_bytes())["payload"]
        _touch(got)
        if i >= 2:  # warm-up, as for the channel
            times.append(time.perf_counter() - t0)
        del got
    conn.send("stop")
    proc.join()
    return times


def _time_channel(nbytes: int, device: str) -> list[float]:
    times = []
    config = ChannelConfig(depth=2, worker_threads=1)
    with TeacherChannel(PayloadTeacher(nbytes), device=device, config=config) as ch:
        ch.wait_ready()
        for i in range(_reps(nbytes) + 4):
            t0 = time.perf_counter()
            ch.submit({"step": torch.tensor([i])})
            with ch.receive() as r:
                _touch(r.outputs["payload"])
            if i >= 4:  # warm-up: fault in both slots, both processes' first-call paths
                times.append(time.perf_counter() - t0)
    return times


def _run_method(method: str, device: str = "cpu") -> None:
    """Consumer process: one JSON line per size, with this process's and the producer's peaks."""
    torch.set_num_threads(1)
    if device != "cpu":
        # the CUDA context and the reduction kernels' RSS are not counted as the method's
        _touch(torch.ones(1 << 10, device=device))
    base_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    timer = _time_pipe if method == "pipe" else _time_channel
    for nbytes in SIZES:
        if device != "cpu":
            torch.cuda.reset_peak_memory_stats()  # per size: the GPU memory is given back
        times = timer(nbytes, device)
        row = {
            "gpu_peak_bytes": torch.cuda.max_memory_allocated() if device != "cpu" else 0,
            "nbytes": nbytes,
            "median_s": statistics.median(times),
            "consumer_peak_delta_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            - base_kib,
            "producer_peak_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
        }
        print(json.dumps(row), flush=True)


def _measure(method: str, device: str = "cpu") -> dict[int, dict]:
    cmd = [sys.executable, "-m", "bench.training.logit_channel", "--method", method,
           "--device", device]  # fmt: skip
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{method} on {device} failed:\n{out.stderr[-4000:]}")
    rows = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
    return {r["nbytes"]: r for r in rows}


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _rows(pipe: dict, chan: dict, extra, *, rss_last: bool = False) -> list[str]:
    """Table rows: payload, both times, their ratio, the student's RSS growth and ``extra``."""
    out = []
    for n in SIZES:
        p, c = pipe[n], chan[n]
        rss = f"{p['consumer_peak_delta_kib'] >> 10} / {c['consumer_peak_delta_kib'] >> 10} MiB"
        cells = [extra(p, c), rss] if rss_last else [rss, extra(p, c)]
        out.append(
            f"| {_size(n)} | {_ms(p['median_s'])} | {_ms(c['median_s'])} | "
            f"{p['median_s'] / c['median_s']:.1f}x | " + " | ".join(cells) + " |"
        )
    return out


def _cpu_section(pipe: dict, chan: dict) -> str:
    lines = [
        "## Logit channel: transfer vs pickling through a pipe",
        "",
        "One microbatch of float32 teacher outputs from a worker process to the student, "
        "received and read once (every page). Baseline: `pickle` through a `multiprocessing` "
        "pipe. Channel: the worker copies into a shared-memory slot (allocated once, depth 2), "
        "the student gets a zero-copy view; only slot/shape metadata crosses the pipe. Median "
        "per microbatch; peak RSS growth of the consumer (student) and peak RSS of the producer, "
        "sizes run in ascending order in one consumer process per method.",
        "",
        "| payload | pickle + pipe | channel | pipe / channel | student peak +RSS "
        "(pipe / channel) | producer peak RSS (pipe / channel) |",
        "|---|---|---|---|---|---|",
    ]
    lines += _rows(
        pipe,
        chan,
        lambda p, c: f"{p['producer_peak_kib'] >> 10} / {c['producer_peak_kib'] >> 10} MiB",
    )
    lines += [
        "",
        "The channel's time at 4 KiB is its fixed cost per microbatch (two pipe messages and "
        "the liveness poll); at large sizes it is the worker's copy into the slot plus the "
        "student's page faults, and the worker makes that copy while the student is still on "
        "the previous microbatch (depth 2), so in a training step it overlaps. The student's "
        "RSS under the channel counts the shared slot pages it read (shared with the worker, "
        "not a second copy).",
    ]
    return "\n".join(lines)


def _cuda_section(pipe: dict, chan: dict) -> str:
    props = torch.cuda.get_device_properties(0)
    lines = [
        "## Logit channel on a GPU (CUDA IPC): transfer vs pickling through a pipe",
        "",
        f"Measured on one {props.name} ({props.total_memory >> 30} GiB) with "
        "`python -m bench.run_all channel_cuda`; CI never runs it (no GPU there), and "
        "`make bench` on a machine without CUDA keeps these cached figures. The same processes "
        "as the CPU section, with the payload on the GPU. Baseline: `pickle` of the CUDA tensor "
        "through a pipe (device -> host in the worker, the pipe, host -> device when the student "
        "unpickles it). Channel: one CUDA allocation (depth 2) shared with the worker by IPC "
        "handle once, at start; per microbatch the worker copies device to device into a slot "
        "and records an interprocess event the student's stream waits on. The student reads "
        "every element (`sum`, which also waits for the GPU). Median per microbatch; the "
        "student's CUDA allocator peak at that size (the channel's is its ring: two slots) and "
        "its peak RSS growth (sizes ascending, one consumer process per method).",
        "",
        "| payload | pickle + pipe | channel | pipe / channel | student CUDA peak "
        "(pipe / channel) | student peak +RSS (pipe / channel) |",
        "|---|---|---|---|---|---|",
    ]
    lines += _rows(
        pipe,
        chan,
        lambda p, c: f"{_size(p['gpu_peak_bytes'])} / {_size(c['gpu_peak_bytes'])}",
        rss_last=True,
    )
    lines += [
        "",
        "The channel's small-payload time is its fixed cost per microbatch (two pipe messages, "
        "the event, the liveness poll); the payload itself never leaves the GPU. The pickle "
        "path moves it through host memory twice and through the pipe, so its cost grows with "
        "the payload at host-copy speed.",
    ]
    return "\n".join(lines)


def main(device: str = "cpu") -> str:
    """The Markdown section for `device` ("cpu": shared memory; "cuda": CUDA IPC)."""
    pipe, chan = _measure("pipe", device), _measure("channel", device)
    return _cuda_section(pipe, chan) if device == "cuda" else _cpu_section(pipe, chan)


def _arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


if __name__ == "__main__":
    if "--method" in sys.argv:
        _run_method(_arg("--method", "channel"), _arg("--device", "cpu"))
    else:
        print(main(_arg("--device", "cpu")))
