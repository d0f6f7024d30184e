"""Which torch build `make setup` installs: CUDA on a machine with an NVIDIA GPU, CPU otherwise.

Run by the Makefile before the package is installed, so standard library only, as a script: it
prints the extra pip arguments on stdout and says what it chose on stderr; ``--device cpu|cuda``
(``make setup TORCH_BUILD=...``) overrides the detection.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

# Both locks pin torch without a local label: on a GPU machine that is PyPI's default Linux
# wheel, the CUDA build (CUDA_LOCK adds its nvidia-* and triton pins); on a CPU machine the same
# spec takes PyTorch's CPU wheel ("2.13.0+cpu" sorts above "2.13.0") once its index is named,
# unless pip already finds a wheel without any index (a find-links folder, as on our CI).
TORCH = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_LOCK = "requirements-cuda.lock"


def gpus_present(nvidia_smi_output: str | None) -> bool:
    """True when ``nvidia-smi -L`` listed at least one GPU (None: the command is missing or
    failed, as on a machine without the driver)."""
    if not nvidia_smi_output:
        return False
    return any(line.startswith("GPU ") for line in nvidia_smi_output.splitlines())


def pip_args(*, device: str, local_torch_url: str | None) -> list[str]:
    """The pip arguments beside ``-c requirements.lock`` for ``device`` ("cpu" or "cuda").
    ``local_torch_url``: where pip finds ``torch==2.13.0`` with no index at all, or None."""
    if device == "cuda":
        return ["-c", CUDA_LOCK]
    if device != "cpu":
        raise ValueError(f"device must be cpu or cuda, not {device!r}")
    if local_torch_url is not None:
        return []
    return ["--extra-index-url", CPU_INDEX]


def _nvidia_smi() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _local_torch() -> str | None:
    """The URL of the torch wheel pip resolves without an index (find-links), or None."""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-deps",
           "--ignore-installed", "-q", "--report", "-", TORCH]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return None
    try:
        return json.loads(done.stdout)["install"][0]["download_info"]["url"]
    except (ValueError, KeyError, IndexError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    device = ap.parse_args(argv).device
    if device == "auto":
        device = "cuda" if gpus_present(_nvidia_smi()) else "cpu"
    local = _local_torch() if device == "cpu" else None
    args = pip_args(device=device, local_torch_url=local)
    where = local or (CPU_INDEX if device == "cpu" else "PyPI (CUDA build) + " + CUDA_LOCK)
    print(f"setup: {TORCH} for {device} from {where}", file=sys.stderr)
    print(" ".join(args))
    return 0


if __name__ == "__main__":
    # run by path before `pip install -e .`: import the repo's package, not this folder's modules
    sys.path[0] = str(Path(__file__).resolve().parents[2])
    from tokenbridge import cli

    sys.exit(cli.run(main, sys.argv[1:], prog="setup"))
