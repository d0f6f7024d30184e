"""`make setup`'s choice of torch build (tokenbridge/assets/torch_build.py) and the two locks."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tokenbridge import paths
from tokenbridge.assets import torch_build

REPO = paths.REPO_ROOT
SMI_TWO = "GPU 0: NVIDIA H200 (UUID: GPU-0b1c)\nGPU 1: NVIDIA H200 (UUID: GPU-7e2f)\n"


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (REPO / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            pkg, version = line.split("==")
            pins[pkg.lower().replace("_", "-")] = version
    return pins


def test_gpus_present_reads_nvidia_smi_listing():
    assert torch_build.gpus_present(SMI_TWO)
    assert not torch_build.gpus_present(None)  # no driver: the command is missing or failed
    assert not torch_build.gpus_present("")
    assert not torch_build.gpus_present("No devices were found\n")


def test_pip_args_per_device():
    assert torch_build.pip_args(device="cuda", local_torch_url=None) == [
        "-c",
        "requirements-cuda.lock",
    ]
    # a CPU machine without a local wheel takes PyTorch's CPU index (2.13.0+cpu sorts above 2.13.0)
    assert torch_build.pip_args(device="cpu", local_torch_url=None) == [
        "--extra-index-url",
        "https://download.pytorch.org/whl/cpu",
    ]
    # ours: the wheel lies in a find-links folder and no other index is reachable
    assert torch_build.pip_args(device="cpu", local_torch_url="file:///opt/wheels/t.whl") == []
    with pytest.raises(ValueError, match="cpu or cuda"):
        torch_build.pip_args(device="rocm", local_torch_url=None)


def test_script_runs_without_the_package_and_honours_the_override():
    # the Makefile runs it by path before `pip install -e .`; --device cuda asks pip nothing
    done = subprocess.run(
        [sys.executable, str(REPO / "tokenbridge/assets/torch_build.py"), "--device", "cuda"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    assert done.stdout.split() == ["-c", "requirements-cuda.lock"]
    assert "for cuda" in done.stderr


def test_locks_pin_one_torch_without_a_local_label():
    cpu, cuda = _pins("requirements.lock"), _pins("requirements-cuda.lock")
    # the public index serves no `+cpu` version: the label would make `make setup` fail there
    assert cpu["torch"] == "2.13.0"
    assert "torch" not in cuda  # one torch pin, in the lock both builds read
    assert {k for k in cuda if k.startswith("nvidia-")} and "triton" in cuda
    clash = {k: (cpu[k], v) for k, v in cuda.items() if k in cpu and cpu[k] != v}
    assert not clash, f"the two locks pin these differently: {clash}"
    assert all(re.fullmatch(r"[0-9][0-9a-z.]*", v) for v in cuda.values())


def test_makefile_setup_uses_the_choice():
    make = (REPO / "Makefile").read_text()
    assert "tokenbridge/assets/torch_build.py --device $(TORCH_BUILD)" in make
    assert "requirements-cuda.lock" in make
