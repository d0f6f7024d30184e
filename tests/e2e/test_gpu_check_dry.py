"""`make gpu-check`'s CPU dry run (`python -m bench.gpu.check --dry-run`), so the GPU script
cannot rot while no GPU runs it: one process launch runs every part with the tiny shapes, and
the JSON it writes must have every part, each ``ok`` with positive figures.

Also: the carry folder for a GPU machine (`bench.gpu.pack`) holds the tokenizers, the
text and the pure-Python packages, and no weights, within the device tool's limit; and the
check's copies of the teacher-cache job's defaults still equal the job's.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest

from bench.common import ensure_projection

PARTS = ("scale_1b_4b", "teacher_program", "sampler", "cuda_tests", "long_row", "demo_pair")
# a cuda-marked test of each file that holds them (the dry run lists what it would run)
CUDA_TESTS = (
    "tests/dist/test_dist_cuda.py::test_ops_on_cuda_single_process",
    "tests/dist/test_teacher_worker.py::test_cuda_ipc_round_trip_reuse_and_kill",
    "tests/e2e/test_debug_run.py::test_debug_run_on_cuda_with_cuda_ipc_channel",
)


@pytest.fixture(scope="module")
def dry(
    zygote, tmp_path_factory, teacher_dir, student_dir
) -> tuple[subprocess.CompletedProcess, dict]:
    ensure_projection(teacher_dir, student_dir)  # once for the suite, outside the dry run
    out = tmp_path_factory.mktemp("gpu_check")
    proc = zygote.run(["-m", "bench.gpu.check", "--dry-run", "--out", str(out)], timeout=600)
    result = json.loads((out / "gpu_check.json").read_text()) if proc.returncode == 0 else {}
    return proc, {"json": result, "md": (out / "gpu_check.md").read_text() if result else ""}


def test_dry_run_runs_every_part_with_positive_figures(dry):
    proc, got = dry
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = got["json"]
    assert res["dry_run"] and tuple(res["parts"]) == PARTS
    for key, part in res["parts"].items():
        assert part["status"] == "ok", (key, part.get("error"), part.get("traceback"))
        numbers = {k: v for k, v in part["figures"].items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}  # fmt: skip
        assert numbers and all(v > 0 for v in numbers.values()), (key, part["figures"])
    listed = res["parts"]["cuda_tests"]["figures"]["listed"]
    assert set(CUDA_TESTS) <= set(listed), listed
    # the section bench/run_all.py collects: the machine, then every part
    md = got["md"]
    assert md.startswith("## GPU check") and "**Dry run**" in md and res["commit"] in md
    assert all(p["title"] in md for p in res["parts"].values())
    # the tiny shapes ran; a part that grew past its budget (check.DRY_PART_S) is a "timeout"
    # above. No wall-clock bound here: the suite runs beside other work (two xdist workers).
    from bench.gpu.check_cases import DRY

    assert res["sizes"] == dataclasses.asdict(DRY), res["sizes"]


def test_carry_folder_has_what_the_gpu_machine_lacks_and_no_weights(tmp_path):
    from bench.gpu import pack

    folder = tmp_path / "pack"
    sizes = pack.write_pack(folder)
    for model in ("gemma-3-270m", "smollm2-135m"):
        have = {f.name for f in (folder / "artifacts" / "models" / model).iterdir()}
        assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= have, have
        assert not any(n.endswith(pack.WEIGHTS) for n in have), have
    plays = list((folder / "artifacts" / "corpus" / "shakespeare").glob("*.txt"))
    assert len(plays) == pack.CORPUS_FILES
    for name in pack.SITE_PACKAGES:
        assert (folder / "site" / name / "__init__.py").is_file(), name
    assert not list(folder.rglob("__pycache__"))
    assert (folder / "COMMIT").read_text().strip()
    # the device tool carries 64 MiB with the working tree (~3 MiB)
    assert sum(sizes.values()) < 48 * 2**20, sizes


def test_the_checks_copies_of_the_cache_jobs_defaults():
    from bench.gpu import check_cases
    from pipelines.teacher_cache import handler, job

    fields = {f.name: f.default for f in dataclasses.fields(job.JobConfig)}
    assert check_cases.CACHE_ROWS_PER_HEAD == handler.ROWS_PER_HEAD
    assert fields["batch_tokens"] == check_cases.CACHE_BATCH_TOKENS


def test_merge_takes_each_part_from_the_newest_run_that_ran_it(dry, tmp_path):
    """`bench.gpu.check_merge`: a rerun of one part (``--only``) replaces that part only, its
    row names the run; runs from other software are refused."""
    from bench.gpu.check_merge import main as merge_main

    _, got = dry
    first = got["json"]
    rerun = {**first, "date": "2999-01-01T00:00:00+00:00",
             "commit": "later", "parts": {"sampler": {**first["parts"]["sampler"],
                                                      "status": "timeout", "figures": {}}}}  # fmt: skip
    files = []
    for i, r in enumerate((rerun, first)):  # out of order on purpose: merged by date
        files.append(tmp_path / f"run{i}.json")
        files[-1].write_text(json.dumps(r))
    assert merge_main([*map(str, files), "--out", str(tmp_path / "m"), "--note", "why"]) == 0
    merged = json.loads((tmp_path / "m" / "gpu_check.json").read_text())
    assert tuple(merged["parts"]) == PARTS
    assert merged["parts"]["sampler"]["status"] == "timeout"
    assert merged["parts"]["sampler"]["run"] == 2
    assert {p["run"] for k, p in merged["parts"].items() if k != "sampler"} == {1}
    md = (tmp_path / "m" / "gpu_check.md").read_text()
    assert "`later`" in md and first["commit"] in md and "why" in md
    other = {**rerun, "device": {**rerun["device"], "torch": "0.0"}}
    files[0].write_text(json.dumps(other))
    assert merge_main([*map(str, files), "--out", str(tmp_path / "n")]) == 2


def test_peak_meter_refuses_a_reset_before_its_interval_is_read():
    """The whole-step peak was once read after the reset that starts the next step: the
    meter the trainer parts use (here on CPU, where a reset does nothing) refuses that order."""
    import torch

    from bench.gpu.check_cases import PeakMeter

    meter = PeakMeter(torch.device("cpu"))
    meter.reset()  # the interval before the first reset is nobody's
    assert meter.read() > 0
    meter.reset()
    with pytest.raises(RuntimeError, match="peak reset 3 before its interval was read"):
        meter.reset()
    assert (meter.reads, meter.resets) == (1, 2)


def test_headline_names_every_figure_users_compare_or_says_not_run(dry):
    """The section opens with the figures users compare, each from the part that measures it
    (a figure key renamed in a part would show "not run" here, and fail)."""
    from bench.gpu.check import HEADLINE, headline

    _, got = dry
    res = got["json"]
    for what, key, name, _ in HEADLINE:
        if name.startswith("mfu"):  # no peak FLOP/s known on a CPU: no MFU in a dry run
            continue
        assert name in res["parts"][key]["figures"], (what, key, name)
    lines = headline({**res, "parts": {k: v for k, v in res["parts"].items() if k != "sampler"}})
    assert sum("not run (part not run)" in ln for ln in lines) == 2
    assert "Figures users compare" in got["md"]
