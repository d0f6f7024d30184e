"""Model and tokenizer directories at URLs (`tokenbridge.remote_models`), against the test S3
server: marked and uploaded by ``python -m tokenbridge.commands.verify --mark DIR --upload URL``, fetched
verified into a cache under their own name (same tokenizer name and fingerprint as the local
directory); a changed file or a directory without a marker refused in one line (exit 2, no
COMPLETED) by the align job; the trainer's ``model.path`` fetched before anything loads."""

from __future__ import annotations

import shutil

import pytest

from pipelines.align import job as align_job
from tokenbridge import cli, remote_models
from tokenbridge.commands.verify import main as verify
from tokenbridge.formats import checksums
from tokenbridge.tokenizers import load_tokenizer
from trainer.data.remote_inputs import localize
from trainer.main import load_config


def _phi3_dir(tmp_path, vocab_fixture):
    d = tmp_path / "src" / "phi-3"
    d.mkdir(parents=True)
    shutil.copyfile(vocab_fixture("phi-3"), d / "phi-3.gguf")
    return d


def test_a_marked_directory_is_fetched_verified_under_its_own_name(
    s3_server, s3_bucket, tmp_path, vocab_fixture, capsys, monkeypatch
):
    d, url = _phi3_dir(tmp_path, vocab_fixture), f"s3://{s3_bucket}/models/phi-3"
    assert verify(["--mark", str(d), "--upload", url]) == 0
    assert f"{d}: uploaded to {url}" in capsys.readouterr().out
    assert s3_server.keys(s3_bucket) == ["models/phi-3/COMPLETED", "models/phi-3/phi-3.gguf"]
    assert verify([url]) == 0  # the generic check reads a model directory's marker too
    copy = remote_models.local_copy(url, cache_dir=tmp_path / "cache")
    assert copy.endswith("/phi-3") and load_tokenizer(copy).info() == load_tokenizer(d).info()
    assert remote_models.local_copy(str(d)) == str(d)  # a local path is itself

    # the align job refuses, before writing anything: a changed file, then a missing marker
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "launcher"))
    (tmp_path / "a.txt").write_text("some text")
    out = tmp_path / "out"
    argv = ["--data", str(tmp_path / "a.txt"), "--student", str(d), "--out", str(out)]
    s3_server.client().put_object(Bucket=s3_bucket, Key="models/phi-3/phi-3.gguf", Body=b"x")
    with pytest.raises(checksums.DamagedFileError, match=rf"^{url}/phi-3.gguf: damaged"):
        remote_models.local_copy(url, cache_dir=tmp_path / "fresh")
    capsys.readouterr()
    assert cli.run(align_job.main, [*argv, "--teacher", url], prog="align") == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{url}/phi-3.gguf: damaged" in err[0], err
    bare = s3_server.upload(d / "phi-3.gguf", s3_bucket, "bare/phi-3.gguf").rsplit("/", 1)[0]
    assert cli.run(align_job.main, [*argv, "--teacher", bare], prog="align") == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{bare}: no COMPLETED marker listing its files' checksums" in err[0]
    assert "--mark DIR --upload" in err[0]
    assert not (out / "COMPLETED").exists()


def test_the_trainers_model_path_at_a_url_is_fetched_before_anything_loads(
    s3_server, s3_bucket, tmp_path, student_dir
):
    d = tmp_path / "src" / student_dir.name
    d.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(student_dir / name, d / name)
    url = remote_models.upload(d, f"s3://{s3_bucket}/models/{student_dir.name}")
    cfg = load_config(["conf=debug", f"model.path={url}", f"data.cache_dir={tmp_path / 'c'}"])
    was = localize(cfg)
    assert was["model.path"] == (url, cfg.model.path)
    assert cfg.model.path.startswith(str(tmp_path / "c")) and cfg.model.path.endswith(d.name)
    assert load_tokenizer(cfg.model.path).info() == load_tokenizer(student_dir).info()
