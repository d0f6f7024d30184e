"""The run report on run folders written here (the real one from a `conf=debug` run is checked
in tests/e2e): its numbers equal metrics.jsonl, it builds from a run killed early, several runs
share the axes, the page opens offline, and the trainer never imports matplotlib at start-up.
"""

from __future__ import annotations

import base64
import json
import math
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.e2e.helpers import REPO
from trainer.report.__main__ import main as report_main
from trainer.report.build import after_run, write_report
from trainer.report.panels import ema
from trainer.report.runs import load_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_run(path: Path, *, steps: int, teachers=("gemma",), shards: Path | None = None) -> Path:
    """A run folder as the trainer writes it: eval records at step 0, mid-way and the end, a train
    record per step (kd/coverage per teacher when there are teachers), bpb.json, summary.json."""
    path.mkdir(parents=True)
    recs = [{"kind": "eval", "step": 0, "bpb": 2.0}]
    recs += [{"kind": "eval", "step": 0, f"bpb/{t}": 1.5 + i / 10} for i, t in enumerate(teachers)]
    for s in range(1, steps + 1):
        r = {"kind": "train", "step": s, "ce": 5.0 / s + 0.01 * (s % 3), "lr": 1e-3,
             "grad_norm": 1.0 + (s % 4) / 10, "tokens_per_s": 100.0 + s, "step_s": 0.5,
             "teacher_s": 0.2 if teachers else 0.0, "tokens": 64, "memory_gib": 1.0 + s / 100,
             "tokens_per_s_per_device": 50.0 + s / 2, "tflops_per_device": 0.1 + s / 1000,
             "mfu": 0.25 if s <= steps // 2 else 0.3}  # fmt: skip
        if teachers:
            r["teacher_mfu"] = 0.125
        for t in teachers:
            r[f"kd/{t}"] = 1.0 / s
            r[f"coverage/{t}"] = 0.9
        r["loss"] = r["ce"] + sum(r.get(f"kd/{t}", 0.0) for t in teachers)
        recs.append(r)
        if s == steps // 2:  # an eval during the run (eval.interval)
            recs.append({"kind": "eval", "step": s, "bpb": 1.9})
    recs.append({"kind": "eval", "step": steps, "bpb": 1.8})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    bpb = {"student_before": 2.0, "teachers": {t: 1.5 + i / 10 for i, t in enumerate(teachers)},
           "student_after": 1.8}  # fmt: skip
    (path / "bpb.json").write_text(json.dumps(bpb))
    precision = {"device": "cuda", "param_dtype": "bfloat16", "reduce_dtype": "float32",
                 "master_dtype": "float32", "fused_optimizer": True,
                 "teacher_dtypes": {t: "bfloat16" for t in teachers}}  # fmt: skip
    summary = {"name": path.name, "steps": steps, "tokens": 64 * steps, "bpb": bpb,
               "teachers": list(teachers), "shards": str(shards) if shards else None,
               "precision": precision}  # fmt: skip
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def fake_shards(path: Path) -> Path:
    path.mkdir(parents=True)
    stats = {"teachers": [{"name": "gemma-tok"}], "documents": 3, "windows": 9,
             "tokens": {"student": 500, "teachers": [450]}, "chunks": [400],
             "chunk_kinds": [{"1:1": 300, "1:N": 40, "N:1": 50, "N:M": 10}],
             "exact_chunk_fraction": [0.7], "fallback_rate": [0.0], "dead_letters": 0}  # fmt: skip
    (path / "stats.json").write_text(json.dumps(stats))
    return path


def jsonl_series(run_dir: Path, key: str, kind: str = "train") -> tuple[list[int], list[float]]:
    """The series as metrics.jsonl holds it, read independently of the report (last wins)."""
    by_step: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("kind") == kind and key in r:
            by_step[r["step"]] = r[key]
    return sorted(by_step), [by_step[s] for s in sorted(by_step)]


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs, self.tags, self.external = [], [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        if tag == "img":
            self.imgs.append(a["src"])
        for k in ("src", "href"):
            if k in a and a[k].startswith(("http:", "https:", "//")):
                self.external.append(a[k])


def check_page(html_path: Path) -> _Page:
    """Valid enough to open offline: parses, every image an embedded PNG, no script or link."""
    page = _Page()
    page.feed(html_path.read_text(encoding="utf-8"))
    assert page.imgs and not page.external and "script" not in page.tags
    for src in page.imgs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG_MAGIC)
    return page


def check_numbers(report_json: Path, runs: dict[str, Path]) -> int:
    """Every plotted line equals its metrics.jsonl series; returns how many were compared."""
    data = json.loads(report_json.read_text())
    compared = 0
    for panel in data["panels"].values():
        for line in panel.get("lines", []):
            if not line["run"] or line["level"] is not None:
                continue
            kind = "eval" if panel["name"] == "bpb" else "train"
            steps, values = jsonl_series(runs[line["run"]], line["key"], kind)
            assert line["steps"] == steps, (panel["name"], line["label"])
            assert line["values"] == pytest.approx(values, rel=0, abs=0), line["label"]
            compared += 1
    return compared


def test_report_numbers_equal_metrics_jsonl(tmp_path):
    run = fake_run(tmp_path / "runs" / "demo", steps=30, shards=fake_shards(tmp_path / "shards"))
    # a resume from step 20 re-logged 21..30 with other values, and a kill cut a line
    with open(run / "metrics.jsonl", "a") as f:
        for s in range(21, 31):
            f.write(json.dumps({"kind": "train", "step": s, "loss": 9.0 + s, "ce": 1.0}) + "\n")
        f.write('{"kind": "train", "step": 31, "lo')
    html = write_report([run])
    assert html == run / "report" / "report.html"
    page = check_page(html)
    pngs = sorted(p.name for p in html.parent.glob("*.png"))
    assert len(page.imgs) == len(pngs)
    assert {"loss.png", "ce.png", "kd.png", "bpb.png", "coverage.png", "chunk_kinds.png"} <= set(
        pngs
    )
    assert check_numbers(html.parent / "report.json", {"demo": run}) >= 8
    loss = json.loads((html.parent / "report.json").read_text())["panels"]["loss"]["lines"][0]
    assert loss["values"][-1] == 39.0 and loss["smoothed"] is not None  # last record wins
    bpb = json.loads((html.parent / "report.json").read_text())["panels"]["bpb"]["lines"][0]
    assert (bpb["steps"], bpb["values"]) == ([0, 15, 30], [2.0, 1.9, 1.8])  # before/during/after
    text = html.read_text()
    assert "1 unreadable line(s) in metrics.jsonl skipped" in text
    assert "2.0000" in text and "1.8000 (-0.2000)" in text  # BPB before / after
    # precision and per-device throughput: medians over the steps, the largest memory
    assert {"tokens_per_s_per_device.png", "mfu.png"} <= set(pngs)
    mfu = json.loads((html.parent / "report.json").read_text())["panels"]["mfu"]["lines"]
    assert [(x["key"], x["style"]) for x in mfu] == [("mfu", "-"), ("teacher_mfu", "--")]
    table = text.split("<h2>Precision and throughput</h2>")[1].split("</table>")[0]
    cells = [c.rsplit(">", 1)[1] for c in table.split("</tr>")[1].split("</td>")[:-1]]
    assert cells == ["demo", "cuda", "bfloat16 (master float32, reduce float32)",
                     "gemma bfloat16", "yes", "57.75", "0.1155", "27.5%", "12.5%", "1.3"]  # fmt: skip


def test_report_of_a_run_killed_early(tmp_path):
    run = tmp_path / "killed"
    run.mkdir()
    recs = [
        {"kind": "train", "step": s, "loss": 3.0 - s / 10, "ce": 3.0, "lr": 1e-3} for s in (1, 2)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"kind"')
    html = write_report([run], out=tmp_path / "out")
    check_page(html)
    assert sorted(p.name for p in html.parent.glob("*.png")) == ["ce.png", "loss.png", "lr.png"]
    text = html.read_text()
    for missing in ("no summary.json", "no bpb.json", "not recorded: held-out bits/byte"):
        assert missing in text
    assert check_numbers(html.parent / "report.json", {"killed": run}) == 3


def test_several_runs_share_the_axes(tmp_path, capsys):
    shards = fake_shards(tmp_path / "shards")
    kd = fake_run(tmp_path / "runs" / "demo", steps=12, shards=shards)
    ce = fake_run(tmp_path / "runs" / "demo-ce", steps=12, teachers=(), shards=shards)
    assert report_main([str(kd), str(ce)]) == 0
    html = Path(capsys.readouterr().out.split("run report: ")[1].strip())
    assert html == kd / "report-vs-demo-ce" / "report.html"
    check_page(html)
    data = json.loads((html.parent / "report.json").read_text())
    loss = data["panels"]["loss"]["lines"]
    assert [(x["label"], x["color"]) for x in loss] == [("demo", "C0"), ("demo-ce", "C1")]
    assert {x["run"] for x in data["panels"]["kd"]["lines"]} == {"demo"}  # CE-only has no KD
    bpb = data["panels"]["bpb"]["lines"]
    assert [x["label"] for x in bpb if x["level"] is not None] == ["demo · teacher gemma"]
    bars = data["panels"]["chunk_kinds"]
    assert len(bars["groups"]) == 1 and bars["groups"][0][2] == [300, 40, 50, 10]  # shards once
    assert check_numbers(html.parent / "report.json", {"demo": kd, "demo-ce": ce}) >= 10


def test_not_a_run_folder_and_a_failed_plot(tmp_path, capsys, monkeypatch):
    assert report_main([str(tmp_path)]) == 2
    assert "not a run folder" in capsys.readouterr().err
    run = fake_run(tmp_path / "r", steps=3)

    def broken(p):
        raise RuntimeError("no fonts")

    monkeypatch.setattr("trainer.report.plots.render", broken)
    lines: list[str] = []
    assert after_run(run, log=lines.append) is None  # the run goes on
    assert len(lines) == 1 and "RuntimeError: no fonts" in lines[0]


def test_ema_and_teacher_order(tmp_path):
    assert ema([2.0] * 5, weight=0.9) == pytest.approx([2.0] * 5)  # debiased: no ramp from 0
    assert math.isnan(ema([math.nan, 1.0], weight=0.5)[0])
    run = fake_run(tmp_path / "r", steps=2, teachers=("zeta", "alpha"))
    assert load_run(run).teachers == ["zeta", "alpha"]  # config order, not alphabetical


def test_trainer_start_up_does_not_import_matplotlib():
    code = ("import sys, trainer.report, trainer.report.build, trainer.eval.chart; "
            "print('matplotlib' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def eval_payload() -> dict:
    """Two models' results as `trainer.eval` writes them: COPA (multiple choice, primary acc)
    for both, a held-out text (primary bpb) for the first only."""
    from trainer.eval.estimates import summarize

    def result(kind: str, primary: str, samples: dict) -> dict:
        n = len(samples["id"])
        return {"kind": kind, "primary": primary, "n": n, "samples": samples,
                "metrics": summarize(kind, samples)}  # fmt: skip

    def mc(acc: list[int]) -> dict:
        n = len(acc)
        return result("mc", "acc", {"id": list(range(n)), "acc": acc, "acc_norm": acc[::-1],
                                    "acc_per_token": acc, "bits": [8.0 + i for i in range(n)],
                                    "bytes": [10] * n})  # fmt: skip

    text = result("text", "bpb", {"id": [0, 1], "bits": [900.0, 1100.0], "bytes": [1000, 1000],
                                  "tokens": [250, 260]})  # fmt: skip
    return {
        "models": {
            "demo/export": {"results": {"copa": mc([1, 0, 1, 1]), "text:/x/held_out.txt": text}},
            "smollm2-135m": {"results": {"copa": mc([0, 0, 1, 0])}},
        },
        "tasks": ["copa", "text:/x/held_out.txt"],
        "options": {"limit": 4},
        "created": "now",
    }


def test_eval_chart_bars_are_the_primary_metric_with_its_standard_error(tmp_path):
    from trainer.eval.chart import bars, write_eval_report

    payload = eval_payload()
    got = bars(payload)
    assert [b["title"] for b in got] == ["copa: acc ↑  (n=4)", "text:held_out.txt: bpb ↓  (n=2)"]
    for b, task in zip(got, payload["tasks"]):
        for i, info in enumerate(payload["models"].values()):
            res = info["results"].get(task)
            want = (math.nan, math.nan) if res is None else (
                res["metrics"][res["primary"]]["value"], res["metrics"][res["primary"]]["stderr"])  # fmt: skip
            assert (b["values"][i], b["errors"][i]) == pytest.approx(want, nan_ok=True)
    assert got[0]["values"] == [0.75, 0.25] and got[0]["errors"][0] == pytest.approx(0.25)
    png, page = write_eval_report(payload, tmp_path / "r.json")
    assert (png, page) == (tmp_path / "r.png", tmp_path / "r.html")
    assert png.read_bytes().startswith(PNG_MAGIC)
    parsed = check_page(page)
    assert len(parsed.imgs) == 1
    text = page.read_text()
    assert "0.750 ± 0.250" in text and "LIMIT=4" in text  # the table's cells beside the chart
