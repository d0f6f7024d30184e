"""`python -m pipelines.assets all|models|fixtures|corpus` (see `pipelines.assets.steps`).

A failed download or a checksum that differs is one line and exit code 1 (`pipelines.cli`)."""

import sys

from pipelines import cli
from pipelines.assets.steps import main
from pipelines.assets.store import AssetError

sys.exit(cli.run(main, prog="assets", rules=(cli.Rule((AssetError,), cli.EXIT_RUN),)))
