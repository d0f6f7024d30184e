"""``python -m pipelines.align``: the align job (`pipelines.align.job`, ``make align``)."""

import sys

from pipelines.align.job import main
from tokenbridge import cli

if __name__ == "__main__":
    sys.exit(cli.run(main, sys.argv[1:], prog="align"))
