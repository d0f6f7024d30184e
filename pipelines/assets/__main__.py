"""`python -m pipelines.assets all|models|fixtures|corpus` (see `pipelines.assets.steps`)."""

import sys

from pipelines.assets.steps import main

sys.exit(main())
