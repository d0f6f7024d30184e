"""`python -m tokenbridge.assets all|models|fixtures|corpus` (see `tokenbridge.assets.steps`).

A failed download or a checksum that differs is one line and exit code 1 (`tokenbridge.cli`)."""

import sys

from tokenbridge import cli
from tokenbridge.assets.steps import main

sys.exit(cli.run(main, prog="assets"))  # AssetError: one of cli.BASE_RULES
