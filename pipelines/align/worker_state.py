"""What the align job's workers share within one process, beyond the tokenizers: how many
`AlignWindowsDoFn` bundles run (the threads runner's tail leaves a core idle, `SpareCores`), and
the collector settings for a process whose long-lived objects outnumber its per-batch ones
(`settle_long_lived`). Pure process state, no Beam: the DoFns and the launcher call it.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from concurrent.futures import ThreadPoolExecutor

GC_YOUNG = 20_000  # container allocations between young-generation collections (Python: 700)


class SpareCores:
    """Bundles of `AlignWindowsDoFn` in progress in this process, and the most there ever were.

    The threads runner hands each worker its share of the read tasks up front, so one finishes
    first (seconds before the other on KJV x16, 2 workers). While fewer bundles run than have run
    at once, a core is idle: a worker then encodes its teachers on a helper thread beside its
    student (same encodings, so the same bytes out). A process that ran one bundle at a time
    (processes runner, in-process runner) never uses the helper.
    """

    def __init__(self):
        self.now = self.peak = 0
        self.lock = threading.Lock()
        self._helper: ThreadPoolExecutor | None = None

    def started(self) -> None:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def finished(self) -> None:
        with self.lock:
            self.now -= 1

    def spare(self) -> bool:
        return self.now < self.peak

    def helper(self) -> ThreadPoolExecutor:
        with self.lock:
            if self._helper is None:
                self._helper = ThreadPoolExecutor(1, thread_name_prefix="encode-beside")
            return self._helper


BUNDLES = SpareCores()


def settle_long_lived() -> None:
    """Keep the cyclic garbage collector off what lives as long as the worker. A worker holds
    ~240k container objects (Beam, Numba, the tokenizers' tables) that every full collection
    rescanned and interpreter exit walked again (KJV x4, 2 busy cores: 3.5 s of collections and
    2 s of exit; 0.4 s and 0.2 s frozen). `gc.freeze` moves them to the permanent generation;
    the per-batch objects (a list of ids per document) die by reference count, so young
    collections can be rarer. Cycles made later are still collected."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])


@contextlib.contextmanager
def settled_while_running():
    """`settle_long_lived` for the length of a job run in the launcher's process (the threads
    runner's workers are that process), then the collector as it was: a caller that goes on
    after the job (a notebook, the tests) keeps its own objects collectable."""
    threshold = gc.get_threshold()
    settle_long_lived()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
