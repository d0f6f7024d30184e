"""A benchmark measurement in a fresh Python process, its result read back as JSON.

Why: a run measured in its own interpreter starts cold (imports, tokenizer caches, peak RSS are
its own, not the previous run's), so alternating runs compare fairly. The measuring function is
a module's ``_child(*args)``, returning a JSON-able dict that the child prints as its last line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tokenbridge import paths


def run_child(module: str, *args, env: dict[str, str] | None = None) -> dict:
    """``module._child(*args)`` in a fresh interpreter at the repo root (tokenizers kept
    single-threaded, `env` added to the environment); its printed dict. Raises with the child's
    stderr if it fails."""
    call = ", ".join(map(repr, args))
    code = f"import json, {module} as b; print(json.dumps(b._child({call})))"
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
