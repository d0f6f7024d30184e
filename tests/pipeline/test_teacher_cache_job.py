"""The teacher-cache job on Beam: the trainer's teacher program inside RunInference.

On the FnApiRunner and on a Dask cluster started from the command line (two worker processes
sharing no disk with the launcher: the shards and the teacher's directory come from the test
S3 server, `bench.storage.seaweed`, where the cache is written) it writes the same cache (rows
keyed by shard file and row; the files' split follows the runner's bundles), whose fp32 values
are the teacher program's outputs on each row alone; rows with ids outside the teacher's
vocabulary go to the dead letters; a complete directory is not overwritten unless asked. The
tiny random-init teacher keeps SmolLM2's real tokenizer (the shards' teacher column).
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
import torch

from bench.common import shakespeare_docs
from bench.daskcluster import upload_model_dir
from pipelines.teacher_cache import job
from pipelines.teacher_cache.handler import Sampler, sample_keys
from tests.dist.test_trainer_cases import TINY
from tests.pipeline.conftest import local_paths
from tokenbridge import cli
from tokenbridge.alignment.text_shards import write_text_shards
from tokenbridge.formats import shard_schema, shards
from tokenbridge.teacher.outputs import TeacherOutputSpec
from trainer.config.schema import TeacherConfig
from trainer.teacher.model_program import TeacherModelProgram
from trainer.teacher.worker import TeacherContext

pytestmark = pytest.mark.slow
SKIP_STATS = {"wall_s", "wall_tokens_per_s", "inference_s", "teacher_tokens_per_s", "started",
              "files", "bytes", "bytes_per_token", "launch_s", "out", "batches"}  # fmt: skip


def teacher_args(student_dir) -> list[str]:
    args = ["--teacher", str(student_dir), "--init", "random", "--seed", "2"]
    for k, v in TINY.items():
        args += ["--override", f"{k}={v}"]
    return args


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, student_dir) -> dict:
    tmp = tmp_path_factory.mktemp("teacher_cache")
    docs = shakespeare_docs(10, chars=700)
    d = write_text_shards(tmp / "shards", docs, student_dir=student_dir, teacher_dirs=[student_dir])
    base = ["--shards", str(d), *teacher_args(student_dir), "--k", "8", "--threads", "1"]
    base += ["--logprob-dtype", "float32", "--samples", "4", "--rows-per-task", "12"]
    base += ["--batch-tokens", "256", "--cache-mb", "0.02"]
    return {"tmp": tmp, "shards": d, "base": base}


@pytest.fixture(scope="module")
def fn_cache(inputs) -> tuple:
    out = inputs["tmp"] / "fn"
    stats = job.run([*inputs["base"], "--out", str(out), "--direct_num_workers", "1"])
    return out, stats


def _rows(d) -> pa.Table:
    files = sorted(d.glob("cache-*.arrow"))
    tables = [pa.ipc.open_file(pa.memory_map(str(p))).read_all() for p in files]
    return pa.concat_tables(tables).sort_by([("shard_file", "ascending"), ("row", "ascending")])


def test_dask_local_cluster_reads_and_writes_the_same_cache_in_s3(
    inputs, fn_cache, s3_server, s3_bucket, tmp_path, dask_cluster, student_dir
):
    """Entirely against the store: the shards read from s3:// (the launcher plans on a verified
    copy, each worker reads its tasks' objects), the teacher's directory (config and tokenizer
    of the random-init teacher) fetched by each worker into its own cache, the cache written
    there; the workers' arguments hold only URLs."""
    fn_dir, fn_stats = fn_cache
    shards_url = s3_server.upload(inputs["shards"], s3_bucket, "shards")
    teacher = upload_model_dir(tmp_path / "up", f"s3://{s3_bucket}/models/{student_dir.name}", {
        n: student_dir / n for n in ("config.json", "tokenizer.json", "tokenizer_config.json")})  # fmt: skip
    remote = {str(inputs["shards"]): shards_url, str(student_dir): teacher}
    argv = [*[remote.get(a, a) for a in inputs["base"]], "--out", f"s3://{s3_bucket}/cache",
            "--runner=apache_beam.runners.dask.dask_runner.DaskRunner",
            f"--dask_client_address={dask_cluster.address}", "--dask_npartitions=2"]  # fmt: skip
    assert local_paths(argv) == []  # the workers are handed URLs only
    dask_stats = job.run([*argv, "--cache-dir", str(tmp_path / "copies")])  # the launcher's
    ss = shards.open_shards(inputs["shards"])
    assert fn_stats["rows"] == ss.num_rows and fn_stats["dead_letters"] == 0
    assert fn_stats["files"] > 1  # rolled
    where = {"shards_dir", "teacher_path"}
    strip = lambda st: {k: v for k, v in st.items() if k not in SKIP_STATS | where}  # noqa: E731
    assert strip(dask_stats) == strip(fn_stats)
    assert dask_stats["shards_dir"] == shards_url  # the URLs, not the launcher's copies
    assert dask_stats.get("teacher_path", teacher) == teacher
    copy = s3_server.download(s3_bucket, "cache", inputs["tmp"] / "dask")
    assert (copy / "COMPLETED").is_file() and not list(copy.glob(".align-tmp-*"))
    assert _rows(copy).equals(_rows(fn_dir))


def test_auto_teacher_dtype_is_recorded_as_the_dtype_its_device_ran(inputs):
    """--teacher-dtype auto (the default) is resolved by --device, as a run's teachers[i].dtype
    is by its device: the cache records the dtype used, never auto (nothing is run here)."""
    for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16"), ("cuda:1", "bfloat16")):
        cfg, _ = job.configure([*inputs["base"], "--device", device])
        assert cfg.meta.teacher["dtype"] == cfg.teacher_dtype == dtype, device
    cfg, _ = job.configure([*inputs["base"], "--device", "cuda", "--teacher-dtype", "float32"])
    assert cfg.meta.teacher["dtype"] == "float32"  # a named dtype is kept


def test_cached_values_are_the_teacher_programs_outputs(inputs, fn_cache, student_dir):
    fn_dir, stats = fn_cache
    meta = stats["cache"]
    assert meta["id_bits"] == 16 and meta["k"] == 8 and meta["target"]
    assert meta["teacher"]["dtype"] == "float32"  # --teacher-dtype auto on --device cpu
    assert meta["teacher"]["weights"].startswith("random:")
    t_cfg = TeacherConfig(path=str(student_dir), init="random", seed=2, overrides=TINY)
    spec = TeacherOutputSpec(49152, topk=8, target=True)
    program = TeacherModelProgram(t_cfg, spec, max_batch=1, max_len=1)
    program.setup(TeacherContext(torch.device("cpu")))
    table = _rows(fn_dir)
    ss = shards.open_shards(inputs["shards"])
    ids = {p.name: [np.asarray(x) for b in ss.iter_batches(files=[p])
                    for x in b.column(shard_schema.teacher_ids_column(0)).to_pylist()] for p in ss.files}  # fmt: skip
    for i in range(0, table.num_rows, 5):  # every 5th row alone through the program
        name, r = table.column("shard_file")[i].as_py(), table.column("row")[i].as_py()
        x = torch.from_numpy(ids[name][r]).long()[None]
        u = x.shape[1]
        # the row alone, its R = 4 draws taken from the same logits by the job's sampler
        draws = Sampler(sample_keys(0, name, np.asarray([r])), u, r=4, vocab_size=49152,
                        temperature=1.0)  # fmt: skip
        live = program({"input_ids": x, "attention_mask": torch.ones_like(x)}, on_logits=draws)
        lp = np.asarray(table.column("topk_logprobs")[i].as_py(), np.float32).reshape(u, 8)
        raw = np.frombuffer(table.column("topk_ids")[i].as_buffer(), "<u2").reshape(u, 8)
        torch.testing.assert_close(
            torch.from_numpy(lp), live["topk_logprobs"][0], rtol=1e-6, atol=1e-6
        )
        assert np.array_equal(raw, live["topk_ids"][0].numpy())
        tail = np.asarray(table.column("tail_logprob")[i].as_py(), np.float32)
        torch.testing.assert_close(
            torch.from_numpy(tail), live["tail_logprob"][0], rtol=1e-6, atol=1e-6
        )
        n = np.asarray(table.column("sample_n")[i].as_py())
        counts = np.asarray(table.column("sample_counts")[i].as_py())
        assert n.shape == (u,) and counts.sum() == 4 * u and n.sum() == counts.size
        packed = np.frombuffer(table.column("sample_ids")[i].as_buffer(), "<u2")
        assert np.array_equal(np.repeat(packed, counts), np.sort(draws.ids[0], -1).ravel())


def _with_bad_ids(inputs, name: str, bad_rows: list[int]) -> list[str]:
    """The job's arguments over a copy of the first 3 shard rows whose teacher column holds an
    id past SmolLM2's 49,152 in `bad_rows`."""
    ss = shards.open_shards(inputs["shards"])
    rows = ss.table().slice(0, 3).to_pylist()
    for i in bad_rows:
        rows[i][shard_schema.teacher_ids_column(0)] = [5, 60_000, 7]
        rows[i][shard_schema.teacher_chunk_column(0)] = [0, 1, 2]
    d = inputs["tmp"] / name
    d.mkdir()
    schema = shard_schema.shard_schema(ss.meta.student, ss.meta.teachers)
    with shards.ShardWriter(d / shards.shard_name(0, 1), schema) as w:
        w.write_rows([{k: (np.asarray(v, np.int32) if isinstance(v, list) else v)
                       for k, v in r.items()} for r in rows])  # fmt: skip
    shards.write_completed(d, json.loads((inputs["shards"] / "stats.json").read_text()),
                           files={shards.shard_name(0, 1): 3})  # fmt: skip
    return [a if a != str(inputs["shards"]) else str(d) for a in inputs["base"]]


def test_bad_rows_go_to_dead_letters_and_a_complete_cache_is_kept(
    inputs, fn_cache, student_dir, capsys
):
    fn_dir, _ = fn_cache
    with pytest.raises(FileExistsError, match="--overwrite"):
        job.run([*inputs["base"], "--out", str(fn_dir)])
    stats = job.run([*_with_bad_ids(inputs, "bad", [1]), "--out", str(inputs["tmp"] / "badcache")])
    assert stats["rows"] == 2 and stats["drops_by_reason"] == {"id_out_of_range": 1}
    dead = (inputs["tmp"] / "badcache" / shard_schema.DEAD_LETTER_FILE).read_text().splitlines()
    assert json.loads(dead[0])["row"] == 1 and "60000" in json.loads(dead[0])["detail"]
    # every row bad: the command exits 2 with one line naming the reason, stats.json says why,
    # no COMPLETED (even with the limit at 1), the cache files stay to look at
    out = inputs["tmp"] / "worsecache"
    argv = [*_with_bad_ids(inputs, "worse", [0, 1, 2]), "--out", str(out)]
    capsys.readouterr()
    assert cli.run(job.main, [*argv, "--max-dead-fraction", "1"], prog="teacher_cache") == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("tokenbridge")]
    assert len(err) == 1 and err[0].startswith(
        f"tokenbridge teacher_cache: TooManyDeadLetters: {out}: 3 of 3 rows went to the dead "
        "letters (every one); top reasons: id_out_of_range 3; no COMPLETED written"
    ), err
    refused = json.loads((out / "stats.json").read_text())["refused"]
    assert not (out / "COMPLETED").exists() and "id_out_of_range 3" in refused
    assert len((out / shard_schema.DEAD_LETTER_FILE).read_text().splitlines()) == 3


def test_sampled_ids_follow_the_teacher_and_not_the_batching():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0]))[None, None].repeat(3, 40, 1)
    keys = sample_keys(7, "shard-00000-of-00001.arrow", np.arange(3))
    whole = Sampler(keys, 40, r=200, vocab_size=5, temperature=1.0)
    whole(0, logits)
    freq = np.bincount(whole.ids.ravel(), minlength=5) / whole.ids.size
    assert np.allclose(freq, [0.5, 0.25, 0.125, 0.125, 0.0], atol=0.01)
    # the same rows in other batches and chunks of positions draw the same ids
    parts = Sampler(keys[1:], 40, r=200, vocab_size=5, temperature=1.0)
    parts(0, logits[1:, :16])
    parts(16, logits[1:, 16:])
    assert np.array_equal(parts.ids, whole.ids[1:])


def test_a_worker_refuses_a_shard_object_that_changed(inputs, s3_server, s3_bucket):
    """A task names its object and the marker's checksum: an object rewritten after the
    launcher planned is refused by name, not scored."""
    from pipelines.teacher_cache.score_dofns import ReadRowBatchesDoFn
    from tokenbridge.formats import checksums

    ss = shards.open_shards(inputs["shards"])
    url = s3_server.upload(inputs["shards"], s3_bucket, "changed")
    tasks = job.plan_tasks(ss, 12, url=url)
    assert tasks[0].path == f"{url}/{ss.files[0].name}" and tasks[0].expected is not None
    fn = ReadRowBatchesDoFn(teacher_index=0, vocab_size=10**6, budget=256, max_rows=8)
    fn.setup()
    assert sum(1 for _ in fn.process(tasks[0])) > 0
    key = f"changed/{ss.files[0].name}"
    s3_server.client().put_object(Bucket=s3_bucket, Key=key, Body=b"not the shard")
    fn.setup()  # a fresh worker: nothing read yet
    with pytest.raises(checksums.DamagedFileError, match=rf"^{tasks[0].path}: damaged"):
        list(fn.process(tasks[0]))
