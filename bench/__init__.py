"""The benchmarks: `make bench` runs each section of BENCHMARKS.md (`run_all`), one folder per what
the sections measure. Nothing in the product imports this package; docs/bench.md says how the
sections measure.
"""
