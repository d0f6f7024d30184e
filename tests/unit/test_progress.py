"""Progress: worker processes add counts to files of their own; the launcher sums and prints."""

from __future__ import annotations

import io
import time

from pipelines.plumbing import progress


def test_sinks_sum_and_the_line_reads_well(tmp_path):
    a, b = progress.ProgressSink(str(tmp_path)), progress.ProgressSink(str(tmp_path))
    a.add(bytes=30_000_000, documents=1000, tokens=2_000_000)  # the first add writes at once
    b.add(bytes=10_000_000, documents=500, tokens=1_000_000)
    b.add(bytes=5_000_000)  # within FLUSH_S: kept until the next flush
    assert progress.read_totals(tmp_path) == {
        "bytes": 40_000_000,
        "documents": 1500,
        "tokens": 3_000_000,
    }
    b.flush()
    totals = progress.read_totals(tmp_path)
    line = progress.progress_line(totals, total_bytes=90_000_000, elapsed=10.0)
    assert line == ("align: 45.0/90.0 MB (50%), 1,500 documents, 0.30M tokens/s, ETA 0m10s")
    assert progress.sink_for(None) is None
    assert progress.sink_for(str(tmp_path)) is progress.sink_for(str(tmp_path))


def test_reporter_prints_periodically_and_never_goes_backwards(tmp_path):
    sink = progress.ProgressSink(str(tmp_path))
    sink.add(bytes=50, documents=2, tokens=10)
    out = io.StringIO()
    with progress.ProgressReporter(tmp_path, total_bytes=100, interval=0.05, stream=out) as rep:
        deadline = time.monotonic() + 0.3  # polled: at most as long as it used to sleep
        while len(out.getvalue().splitlines()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        sink.path.unlink()  # the finalize step removes the directory at the end
        last = rep.report()
    lines = out.getvalue().splitlines()
    assert len(lines) >= 2 and all(x.startswith("align: 0.0/0.0 MB (50%)") for x in lines)
    assert "(50%)" in last and "2 documents" in last
