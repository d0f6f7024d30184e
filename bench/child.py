"""A benchmark measurement in a fresh Python process, its result read back as JSON.

Why: a run measured in its own interpreter starts cold (imports, tokenizer caches, peak RSS are
its own, not the previous run's), so alternating runs compare fairly. The measuring function is
a module's ``_child(*args)``, returning a JSON-able dict that the child prints as its last line.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

from tokenbridge import paths


def run_child(module: str, *args, env: dict[str, str] | None = None) -> dict:
    """``module._child(*args)`` in a fresh interpreter at the repo root (tokenizers kept
    single-threaded, `env` added to the environment); its printed dict. Raises with the child's
    stderr if it fails."""
    call = ", ".join(map(repr, args))
    code = f"import json, {module}; print(json.dumps({module}._child({call})))"
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=paths.REPO_ROOT,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})},
    )
    if r.returncode != 0:
        raise RuntimeError(f"bench child failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def tree_rss(proc) -> int:
    """Resident bytes of a `psutil.Process` and all its descendants now."""
    import psutil

    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def tree_pss(proc) -> int:
    """Proportional set size of a process tree now (Linux smaps): each shared page counted
    once over the processes that map it, where a sum of RSS counts it in each (two processes
    with torch's libraries loaded count those pages twice). Slower to read than RSS."""
    import psutil

    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error, AttributeError):
            total += p.memory_full_info().pss
    return total


def run_measured(
    cmd: list[str], *, env: dict | None = None, peaks: dict | None = None
) -> tuple[str, float, float]:
    """Run `cmd` at the repo root: (stdout, wall seconds, peak RSS GiB of its whole process
    tree, sampled every 0.2 s). With `peaks` (a dict), the tree's peak PSS is sampled too and
    stored there as ``pss_gib`` (and the RSS peak as ``rss_gib``). Output goes through files,
    so a chatty child never blocks on a full pipe while it is sampled. Raises with its stderr
    if it fails."""
    import psutil

    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=paths.REPO_ROOT, env=full_env, stdout=out, stderr=err,
                                text=True)  # fmt: skip
        ps, peak, pss = psutil.Process(proc.pid), 0, 0
        while proc.poll() is None:
            peak = max(peak, tree_rss(ps))
            if peaks is not None:
                pss = max(pss, tree_pss(ps))
            time.sleep(0.2)
        wall = time.perf_counter() - t0
        if peaks is not None:
            peaks.update(rss_gib=peak / 2**30, pss_gib=pss / 2**30)
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(map(str, cmd[:4]))}... failed:\n{err.read()[-4000:]}")
        return out.read(), wall, peak / 2**30
