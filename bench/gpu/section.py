"""`make bench`'s section of the GPU check: run it where there is CUDA, else keep its last GPU run."""

from __future__ import annotations

import json

import torch

from bench.gpu import check
from bench.gpu.channel_cuda import CACHED_NOTE, cached_section
from bench.gpu.check import RESULTS

CACHE = RESULTS / "gpu_check.md"
JSON = RESULTS / "gpu_check.json"


def main() -> str:
    if torch.cuda.is_available():
        check.main(["--out", str(RESULTS)])
        return CACHE.read_text()
    if JSON.is_file() and not json.loads(JSON.read_text())["dry_run"]:
        # re-rendered from the last GPU run's figures: the section's wording follows the code
        text = check.render(json.loads(JSON.read_text()))
    else:
        text = cached_section(CACHE.read_text()) if CACHE.is_file() else "## GPU check\n\nNot run."
    return text if "_(cached:" in text else text + "\n\n" + CACHED_NOTE


if __name__ == "__main__":
    print(main())
