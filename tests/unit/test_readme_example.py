"""The README's library example runs as written: a user's own loop on `tokenbridge` alone."""

from __future__ import annotations

import math
import os
import re

import pytest

from tokenbridge import paths

pytestmark = pytest.mark.assets


def _example() -> str:
    text = (paths.REPO_ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- example: own-loop -->\n```python\n(.*?)```", text, re.S)
    assert m, "README.md lost its library example"
    return m.group(1)


def test_the_readme_example_trains_a_student_from_a_cross_tokenizer_teacher(teacher_dir, capsys):
    code = _example()
    assert "pipelines" not in code and "trainer" not in code  # the library alone
    cwd = os.getcwd()
    os.chdir(paths.REPO_ROOT)  # the example names the artifacts by relative path
    try:
        ns: dict = {}
        exec(compile(code, "README.md", "exec"), ns)
    finally:
        os.chdir(cwd)
    out = ns["out"]
    # one term per aligned chunk but the first (no BOS here: nothing predicts the first chunk)
    assert int(out.count) == ns["a"].n_chunks - 1 > 5
    loss = float(ns["loss"].detach())
    assert math.isfinite(loss) and loss > 0
    grads = [p.grad for p in ns["student"].parameters() if p.grad is not None]
    assert grads and all(bool(g.isfinite().all()) for g in grads)
    assert "xtoken KD over" in capsys.readouterr().out
