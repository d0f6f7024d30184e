"""Where the jobs write: a local directory or an object store, one set of verbs for both.

A local path: temporary name, fsync, rename. A URL (``s3://bucket/prefix``): Beam's S3 I/O on
every runner; an object appears whole when its upload completes, so `write_bytes` writes the
final name directly and `rename` is copy then delete. Connection settings come from the AWS
variables (`tokenbridge.urls`); errors of the store become one line naming the URL.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import shutil
import threading
from pathlib import Path

from tokenbridge import atomic, urls

Location = str | Path  # a local directory or file (Path) or a URL (str)
_ENV_FLAGS = {"endpoint_url": "--s3_endpoint_url", "region": "--s3_region_name"}
_local = threading.local()
# the jobs log at INFO; boto's INFO records ("Found credentials in environment variables.")
# would print on every run, between the job's own lines
for _name in ("boto3", "botocore", "s3transfer"):
    logging.getLogger(_name).setLevel(logging.WARNING)


def location(path: str | os.PathLike) -> Location:
    """A path argument as the jobs keep it: a Path when local, the URL string otherwise."""
    return str(path) if urls.is_url(path) else Path(path)


def join(base: Location, *names: str) -> Location:
    """`base` / names: a Path for a local base, a URL string for a URL."""
    return urls.join(base, *names) if urls.is_url(base) else Path(base).joinpath(*names)


def beam_args(args: list[str]) -> list[str]:
    """`args` plus the S3 options of the environment that `args` does not set; and this
    process's `FileSystems` configured with them (the launcher lists and writes too)."""
    from apache_beam.io.filesystems import FileSystems
    from apache_beam.options.pipeline_options import PipelineOptions

    out = list(args)
    settings = urls.s3_settings()
    for key, flag in _ENV_FLAGS.items():
        given = any(a == flag or a.startswith(flag + "=") for a in args)
        if key in settings and not given:
            out += [flag, settings[key]]
    FileSystems.set_options(PipelineOptions(out))
    return out


def _s3():
    """This thread's client of Beam's S3 I/O, made once per settings. Beam's `FileSystems`
    builds a new boto3 session for every call (0.4 s each on these machines: a 3 s job took
    17 s); the pipeline options are the ones `FileSystems` has in this process (Beam sets them
    in the launcher and its SDK workers), else, on a worker that was handed none (Dask's), the
    environment's (`urls.s3_settings`). Beam is imported here, not at the top: a local-only
    job (the projection on a bare GPU image) runs without it."""
    from apache_beam.io.filesystems import FileSystems
    from apache_beam.options.pipeline_options import PipelineOptions

    opts = getattr(FileSystems, "_pipeline_options", None)
    env = urls.s3_settings()
    retries = urls.retry_config()
    key = (None if opts is None else id(opts), tuple(sorted(env.items())), tuple(retries.items()))
    cached = getattr(_local, "s3", None)
    if cached is None or cached[0] != key:
        if opts is None:
            opts = PipelineOptions([f"{f}={env[k]}" for k, f in _ENV_FLAGS.items() if k in env])
        _local.s3 = (key, _retrying_s3io(opts, retries))
    return _local.s3[1]


def _retrying_s3io(opts, retries: dict):
    """Beam's S3 I/O whose boto3 client retries as `urls.retry_config` says (Beam builds it
    with botocore's defaults: the legacy mode's 5 attempts)."""
    import boto3
    from apache_beam.io.aws import s3io
    from apache_beam.options.pipeline_options import S3Options
    from botocore.config import Config

    io = s3io.S3IO(options=opts)
    o = opts.view_as(S3Options)
    io.client.client = boto3.session.Session().client(
        "s3",
        region_name=o.s3_region_name,
        api_version=o.s3_api_version,
        use_ssl=not o.s3_disable_ssl,
        verify=o.s3_verify,
        endpoint_url=o.s3_endpoint_url,
        aws_access_key_id=o.s3_access_key_id,
        aws_secret_access_key=o.s3_secret_access_key,
        aws_session_token=o.s3_session_token,
        config=Config(retries=retries),
    )
    return io


def _url(path: Location) -> str:
    """`path` as an ``s3://`` URL (the object store the jobs write to), else an error."""
    urls.check(path, where="path", schemes=urls.OBJECT_STORES)
    return str(path)


def errors(url: str, *, doing: str):
    """The object store's failures on `url` as one line (`urls.store_errors`)."""
    return urls.store_errors(url, doing=doing)


def create(path: Location):
    """A new binary file to write (parent directories made for a local path). On an object
    store the object exists only once the stream is closed without error."""
    if not urls.is_url(path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return open(path, "wb")  # noqa: SIM115 - the caller closes it
    with errors(_url(path), doing="a write"):
        return _s3().open(str(path), "wb")


def open_read(path: Location):
    """A seekable binary stream of `path` (pyarrow reads Arrow IPC footers through it)."""
    if not urls.is_url(path):
        return open(path, "rb")  # noqa: SIM115 - the caller closes it
    with errors(_url(path), doing="a read"):
        return _s3().open(str(path), "rb")


def read_bytes(path: Location) -> bytes:
    if not urls.is_url(path):
        return Path(path).read_bytes()
    with errors(_url(path), doing="a read"), open_read(path) as f:
        return f.read()


def write_bytes(path: Location, data: bytes) -> None:
    """`data` as the file `path`, whole or not at all: a local file through a temporary name,
    fsync and rename; an object in one upload (it appears only when complete)."""
    if urls.is_url(path):
        bucket, key = _url(path)[len("s3://") :].split("/", 1)
        with errors(str(path), doing="a write"):  # one PUT: Beam's multipart writer cannot
            _s3().client.client.put_object(Bucket=bucket, Key=key, Body=data)  # write 0 bytes
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic.write(path, data, fsync=True)


def upload(local: Path, path: Location) -> None:
    """Copy the local file `local` to `path` (an object: streamed in parts, whole when done)."""
    with open(local, "rb") as src, errors(_url(path), doing="a write"):
        dst = create(path)
        shutil.copyfileobj(src, dst, 8 << 20)
        dst.close()


def exists(path: Location) -> bool:
    if not urls.is_url(path):
        return Path(path).is_file()
    with errors(_url(path), doing="a lookup"):
        return _s3().exists(str(path))


def size(path: Location) -> int:
    if not urls.is_url(path):
        return Path(path).stat().st_size
    with errors(_url(path), doing="a lookup"):
        return _s3().size(str(path))


def rename(src: Location, dst: Location) -> None:
    """Move a file: a rename on a local disk, copy then delete on an object store."""
    if not urls.is_url(src):
        atomic.replace(src, dst)
        return
    with errors(_url(src), doing="a copy"):
        _s3().rename(str(src), _url(dst))


def delete(paths: list[Location]) -> None:
    """Delete files (a missing one is no error)."""
    for p in paths:
        if not urls.is_url(p):
            Path(p).unlink(missing_ok=True)
            continue
        with errors(_url(p), doing="a delete"):
            _s3().delete(str(p))


def list_files(directory: Location) -> list[str]:
    """Every file under `directory`, as paths relative to it (sorted; nested ones too)."""
    if not urls.is_url(directory):
        d = Path(directory)
        return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
    base = _url(directory).rstrip("/") + "/"
    with errors(base, doing="a listing"):
        return sorted(path[len(base) :] for path, _ in _s3().list_files(base))


def rmtree(directory: Location) -> None:
    """Remove `directory` and everything under it (best effort, as for a temporary one)."""
    if not urls.is_url(directory):
        shutil.rmtree(directory, ignore_errors=True)
        return
    with contextlib.suppress(Exception):
        delete([join(directory, n) for n in list_files(directory)])


def matching(directory: Location, patterns: list[str]) -> list[str]:
    """The relative paths of files under `directory` that match any of the glob `patterns`
    (``fnmatch``; ``*`` also crosses ``/``)."""
    return [n for n in list_files(directory) if any(fnmatch.fnmatch(n, p) for p in patterns)]
