"""The benchmarks: `make bench` runs each section of BENCHMARKS.md (`run_all`, its table of
sections) and states where it ran (`provenance`); `child` measures in a fresh interpreter;
`common` holds the inputs several sections and the tests share (the demo pair's projection,
corpus text, trainer runs, step figures). The sections live in a folder per what they measure:
`align`, `training`, `onpolicy`, `teacher`, `gpu` (`make gpu-check`), `science`
(`make science`), `storage`. Nothing in the product imports this package.
"""
