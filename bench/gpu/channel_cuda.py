"""The logit channel's GPU path (CUDA IPC) vs pickling CUDA tensors through a pipe.

`bench.training.logit_channel` with the payload on the GPU. Without CUDA this returns the last
GPU run's section, marked cached, so ``make bench`` on a CPU machine keeps it
(``python -m bench.run_all channel_cuda`` on a GPU measures it again).
"""

from __future__ import annotations

import re

import torch

from bench import provenance
from bench.training import logit_channel

# the code these figures depend on (`bench.provenance.measured_paths`): a later change
# to any of it marks the kept section stale
MEASURES = (
    "trainer/teacher",
    "bench/training/logit_channel.py",
    "bench/gpu/channel_cuda.py",
)


CACHE = provenance.RESULTS / "channel_cuda.md"
FOOTER = re.compile(r"\n*_\(section ran in [^)]*\)_\s*$")
CACHED_NOTE = "_(cached: figures from the last run on a GPU machine; this machine has no CUDA)_"


def cached_section(text: str) -> str:
    """The cached section without run_all's timing footer or an earlier cached note."""
    text = FOOTER.sub("", text.rstrip())
    return text.replace(CACHED_NOTE, "").rstrip()


def main() -> str:
    if torch.cuda.is_available():
        return logit_channel.main(device="cuda")
    if CACHE.is_file():
        text = cached_section(CACHE.read_text())
        if provenance.MARK not in text:  # recorded before sections named their commit
            title, _, body = text.partition("\n")
            line = provenance.recorded_line(CACHE, device="NVIDIA H100 80GB HBM3")
            text = f"{title}\n\n{line}\n{body}"
        return text + "\n\n" + CACHED_NOTE
    return (
        "## Logit channel on a GPU (CUDA IPC)\n\nNot measured yet: needs a CUDA device "
        "(`python -m bench.run_all channel_cuda` on a GPU machine)."
    )


if __name__ == "__main__":
    print(main())
