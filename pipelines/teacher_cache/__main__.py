"""``python -m pipelines.teacher_cache``: the teacher-cache job (`pipelines.teacher_cache.job`)."""

import sys

from pipelines import cli
from pipelines.teacher_cache.job import main

sys.exit(cli.run(main, sys.argv[1:], prog="teacher_cache"))
