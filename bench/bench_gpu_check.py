"""`make bench`'s section of the GPU check (`bench.gpu_check`, `make gpu-check`).

On a machine with CUDA this runs the whole check (about 9 minutes) and returns its section; on
any other it returns the section the last GPU run left in ``bench/results/gpu_check.md``, marked
as cached, so `bench/run_all.py` keeps that file as it is (as `bench_channel_cuda` does). Until a
GPU run writes it, that file says the check has not run.
"""

from __future__ import annotations

import torch

from bench.bench_channel_cuda import CACHED_NOTE, cached_section
from bench.gpu_check import RESULTS

CACHE = RESULTS / "gpu_check.md"


def main() -> str:
    if torch.cuda.is_available():
        from bench import gpu_check

        gpu_check.main(["--out", str(RESULTS)])
        return CACHE.read_text()
    text = cached_section(CACHE.read_text()) if CACHE.is_file() else "## GPU check\n\nNot run."
    return text if "_(cached:" in text else text + "\n\n" + CACHED_NOTE


if __name__ == "__main__":
    print(main())
