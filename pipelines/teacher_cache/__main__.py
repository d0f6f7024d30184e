"""``python -m pipelines.teacher_cache``: the teacher-cache job (`pipelines.teacher_cache.job`)."""

import sys

from pipelines.teacher_cache.job import RULES, main
from tokenbridge import cli

sys.exit(cli.run(main, sys.argv[1:], prog="teacher_cache", rules=RULES))
