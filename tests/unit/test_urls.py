"""URLs where a path is expected: told apart from local paths, and refused in one line (exit 2)
by every command that cannot use their scheme, before anything is written; never turned into a
local directory named ``s3:``."""

from __future__ import annotations

import re

import pytest

from pipelines.align import job as align_job
from pipelines.projection import __main__ as projection_job
from pipelines.teacher_cache import job as cache_job
from tokenbridge import cli, urls
from tokenbridge.commands import verify
from trainer.config.schema import ConfigError
from trainer.main import load_config
from trainer.report import __main__ as report_main


def test_schemes_joins_and_settings():
    assert urls.scheme("s3://bucket/x") == "s3" and urls.scheme("GS://b/x") == "gs"
    assert urls.scheme("/tmp/x") is None and urls.scheme("file:///tmp/x") is None
    assert urls.scheme("runs/a:b") is None and not urls.is_url("c:/x")
    assert urls.join("s3://b/p/", "x", "y.arrow") == "s3://b/p/x/y.arrow"
    assert urls.join("/tmp/p", "x") == "/tmp/p/x"
    assert urls.name("s3://b/p/q/") == "q" and urls.local("file:///tmp/q").as_posix() == "/tmp/q"
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_DEFAULT_REGION": "eu-west-3"}
    assert urls.s3_settings(env) == {"endpoint_url": "http://127.0.0.1:9", "region": "eu-west-3"}
    env |= {"AWS_REGION": "us-west-2", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": ""}
    assert urls.s3_settings(env) == {
        "endpoint_url": "http://127.0.0.1:9",
        "region": "us-west-2",
        "key": "k",
    }
    assert urls.check("s3://b/x", where="--out", schemes=("s3",)) == "s3://b/x"
    # every S3 client retries with backoff (botocore's standard mode); the AWS variables rule
    assert urls.retry_config({}) == {"mode": "standard", "max_attempts": 8}
    assert urls.retry_config({"AWS_MAX_ATTEMPTS": "2"})["max_attempts"] == 2
    assert urls.fsspec_options({}, retries={"max_attempts": 3})["config_kwargs"] == {
        "retries": {"max_attempts": 3}
    }
    assert urls.denied("An error occurred (403) when calling the HeadObject operation: Forbidden")
    assert urls.denied("S3ClientError: ... code 403") and urls.denied("InvalidAccessKeyId")
    assert not urls.denied("s3://b/shard-00403-of-00500.arrow: code 404")
    with pytest.raises(urls.UnsupportedURLError, match=r"--out=gs://b/x: gs:// is not supported"):
        urls.check("gs://b/x", where="--out", schemes=("s3",))


@pytest.mark.parametrize(
    ("main", "argv", "flag"),
    [
        (align_job.main, ["--data", "x", "--teacher", "t", "--student", "hdfs://nn/s"], "--student"),
        (align_job.main, ["--data", "x", "--teacher", "t", "--student", "s", "--out", "gs://b/o"], "--out"),
        (cache_job.main, ["--shards", "gs://b/shards", "--teacher", "t"], "--shards"),
        (cache_job.main, ["--shards", "s", "--teacher", "t", "--out", "az://b/o"], "--out"),
        (projection_job.main, ["--teacher", "t", "--student", "s", "--out", "gs://b/p"], "--out"),
        (verify.main, ["gs://bucket/shards"], "DIR"),
        (report_main._main, ["runs/a", "--out", "s3://bucket/report"], "--out"),
    ],
)  # fmt: skip
def test_commands_refuse_urls_they_cannot_use_in_one_line(
    main, argv, flag, capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    assert cli.run(main, argv, prog="tool") == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"UnsupportedURLError: {flag}=" in err[0], err
    assert "is not supported here" in err[0]
    assert list(tmp_path.iterdir()) == []  # no local "s3:" / "gs:" directory


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("run_dir=gs://bucket/run", "run_dir"),
        ("data.shards=gs://bucket/shards", "data.shards"),
        ("model.path=gs://bucket/model", "model.path"),  # s3:// models: test_remote_models
        ("teachers.0.cache=hdfs://nn/cache", "teachers[0].cache"),
        ("checkpoint.resume=gs://bucket/run/checkpoints/step-00000002", "checkpoint.resume"),
    ],
)
def test_trainer_config_refuses_urls_it_cannot_use(override, field):
    with pytest.raises(ConfigError, match=rf"^config {re.escape(field)}=\S+: \w+:// is not"):
        load_config(["conf=debug", override])
