"""The science table (``make science``): the runs (`experiment`), their statistics (`stats`),
the Markdown (`table`), the BENCHMARKS.md section (`section`), and TRL's GOLD loss inside our
trainer (`trl_gold`, launched by `trl_gold_train`)."""
