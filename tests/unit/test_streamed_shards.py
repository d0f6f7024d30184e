"""``data.stream``: shards in the test S3 server read one file at a time. The streamed reader
gives the same held-out split and the same rows in the same order as the local reader over two
epochs, with at most ``stream_files`` shard files on disk at any row and each file downloaded
once per epoch; a changed object is refused by name; the trainer's config refuses streaming a
local directory or beside a teacher cache."""

from __future__ import annotations

import numpy as np
import pytest

from bench.common import shakespeare_docs
from tokenbridge.alignment.text_shards import write_text_shards
from tokenbridge.formats import checksums, shards, streamed_shards
from trainer.config.sections import DataConfig
from trainer.data.shard_reader import ShardReader, ShardStream

FILES, KEEP = 5, 2


@pytest.fixture(scope="module")
def local_shards(tmp_path_factory, student_dir):
    docs = shakespeare_docs(10, chars=600)
    out = tmp_path_factory.mktemp("stream") / "shards"
    return write_text_shards(out, docs, student_dir=student_dir, teacher_dirs=[student_dir],
                        num_files=FILES)  # fmt: skip


def _stream(reader: ShardReader) -> ShardStream:
    data = DataConfig(shards="unused", seed=3, shuffle_buffer=0, eval_fraction=0.2,
                      eval_split="document")  # fmt: skip
    return ShardStream(reader, data=data, dp_rank=0, dp_size=1)


def test_streamed_rows_equal_the_local_rows_with_a_window_of_files(
    local_shards, s3_server, s3_bucket, tmp_path
):
    url = s3_server.upload(local_shards, s3_bucket, "stream")
    entry = streamed_shards.prepare(url, tmp_path / "cache", keep_files=KEEP)
    assert not [p for p in entry.iterdir() if p.name.endswith(".arrow")]  # index only
    streamed = shards.open_shards(entry)
    local = shards.open_shards(local_shards)
    assert (streamed.num_rows, streamed.file_rows, streamed.meta) == (
        local.num_rows, local.file_rows, local.meta)  # fmt: skip
    a, b = ShardReader(streamed, max_student_tokens=64), ShardReader(local, max_student_tokens=64)
    sa, sb = _stream(a), _stream(b)
    assert np.array_equal(sa.rows, sb.rows) and np.array_equal(sa.eval_rows, sb.eval_rows)
    assert a.max_lengths() == (64, [64])  # the window limits of stats.json
    most = 0
    for _ in range(2 * len(sa.rows)):  # two epochs
        r, r_local = sa.next_row(), sb.next_row()
        assert r == r_local
        assert np.array_equal(a.row(r)["student_ids"], b.row(r)["student_ids"])
        most = max(most, len(streamed.stream.local_files()))
    assert most <= KEEP
    streamed.stream.close()
    # each file this stream reads once per epoch (in file order), plus the first one again,
    # fetched ahead at the end of the second epoch; a file of held-out rows only is not read
    wanted = len({a.locate(int(r))[0] for r in sa.rows})
    assert streamed.stream.order == sorted({a.locate(int(r))[0] for r in sa.rows})
    assert 2 * wanted <= streamed.stream.downloads <= 2 * wanted + 1
    log = (entry / streamed_shards.DOWNLOADS).read_text().splitlines()
    assert len(log) == streamed.stream.downloads  # the node's record of every download


def test_a_changed_object_is_refused_by_name(local_shards, s3_server, s3_bucket, tmp_path):
    url = s3_server.upload(local_shards, s3_bucket, "changed")
    entry = streamed_shards.prepare(url, tmp_path / "cache", keep_files=KEEP)
    name = sorted(p.name for p in local_shards.glob("*.arrow"))[0]
    s3_server.client().put_object(Bucket=s3_bucket, Key=f"changed/{name}", Body=b"not it")
    reader = ShardReader(shards.open_shards(entry), max_student_tokens=64)
    with pytest.raises(checksums.DamagedFileError, match=rf"^{url}/{name}: damaged"):
        reader.row(0)


def test_stream_is_refused_where_it_cannot_work(tmp_path):
    """A local directory, or a teacher cache beside the stream: one config error each."""
    from trainer.config.checks import ConfigError
    from trainer.config.compose import compose_config

    with pytest.raises(ConfigError, match=r"data.stream: data.shards=.* is local"):
        compose_config(["experiment=debug", f"data.shards={tmp_path}", "data.stream=true"])
    with pytest.raises(ConfigError, match=r"data.stream: a teacher cache"):
        compose_config(["experiment=debug", "data.shards=s3://b/shards", "data.stream=true",
                        f"teachers.0.cache={tmp_path}"])  # fmt: skip
