"""``python -m pipelines.teacher_cache``: the teacher-cache job (`pipelines.teacher_cache.job`)."""

import sys

from pipelines.teacher_cache.job import main

main(sys.argv[1:])
