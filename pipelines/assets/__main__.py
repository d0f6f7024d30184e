"""`python -m pipelines.assets all|models|fixtures|corpus` (see `pipelines.assets.steps`).

A failed download or a checksum that differs is one line and exit code 1 (`pipelines.cli`)."""

import sys

from pipelines import cli
from pipelines.assets.steps import main

sys.exit(cli.run(main, prog="assets"))  # AssetError: one of cli.BASE_RULES
