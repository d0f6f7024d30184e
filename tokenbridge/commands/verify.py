"""``python -m tokenbridge.commands.verify DIR [DIR ...]`` (``make verify DIR=...``): is what was written intact?

DIR is any directory a tokenbridge writer completes with a checksummed marker, recognised by
its ``kind`` (shards, whose values are checked too; a teacher cache; a checkpoint, a folder of
them or a run directory), or an ``s3://`` URL of one. One line per file, exit code 2 on any
damage (docs/integrity.md). ``--mark DIR [--upload URL]`` writes a model or tokenizer
directory's marker instead (and uploads it, marker last), so the jobs and the trainer can take
the URL and fetch it verified (`tokenbridge.remote_models`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import pyarrow as pa

from tokenbridge import cli, urls
from tokenbridge.formats import checksums, shard_schema, value_checks

MARKER = "COMPLETED"
STEP_PREFIX = "step-"  # the trainer's checkpoint directories (trainer.checkpoint.checkpointer)


def _shard_values(d: Path, name: str) -> str | None:
    """None when every batch of shard `name` is in range, else the first error."""
    try:
        with pa.memory_map(str(d / name), "r") as src:
            reader = pa.ipc.open_file(src)
            meta = shard_schema.read_meta(reader.schema, where=str(d / name))
            row = 0
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                value_checks.check_batch(batch, meta, where=str(d / name), first_row=row)
                row += batch.num_rows
    except (pa.ArrowException, OSError, ValueError) as e:
        return str(e).splitlines()[0]
    return None


def verify_marked(
    d: Path, marker: dict, *, hashed: frozenset[str] = frozenset()
) -> list[checksums.FileReport]:
    """Reports for every file of a directory with a marker (plus its unlisted files).
    ``hashed``: files whose checksum already matched as they were written here (`verify_url`'s
    streamed copies): not read again for it."""
    sums = marker.get("checksums", {})
    reports = checksums.verify_listed(d, {k: v for k, v in sums.items() if k not in hashed})
    reports += [
        checksums.FileReport(k, int(v["bytes"]), note=checksums.describe(v) + ", while streamed")
        for k, v in sums.items()
        if k in hashed
    ]
    reports.sort(key=lambda r: r.name)
    listed = set(marker.get("files", {})) | set(sums)
    for name in sorted(set(marker.get("files", {})) - set(sums)):
        reports.append(
            checksums.FileReport(name, None, note="no checksum recorded (marker version 1)")
        )
    # Shard markers of version 2 had no kind; every other writer names its own.
    if marker.get("kind", "shards") == "shards" and "schema_version" in marker:
        by_name = {r.name: r for r in reports}
        for name in sorted(marker.get("files", {})):
            r = by_name[name]
            if r.ok and (d / name).is_file():
                r.error = _shard_values(d, name)
    for p in sorted(d.iterdir()):
        if p.name not in listed and p.name != MARKER and not p.name.startswith("."):
            reports.append(checksums.FileReport(p.name, None, note="not listed: readers ignore it"))
    return reports


def _print(d: Path, reports: list[checksums.FileReport], out) -> int:
    damaged = 0
    for r in reports:
        if r.ok:
            print(f"  OK       {r.name}" + (f"  ({r.note})" if r.note else ""), file=out)
        else:
            damaged += 1
            print(f"  DAMAGED  {r.name}: {r.error}", file=out)
    print(f"{d}: {len(reports) - damaged} OK, {damaged} damaged", file=out)
    return damaged


def verify_path(d: Path, out=None) -> int:
    """Verify one directory (recognising its kind); returns the number of damaged things."""
    out = out or sys.stdout
    if (d / MARKER).is_file():
        try:
            marker = checksums.read_marker(d, MARKER)
        except checksums.IntegrityError as e:
            print(f"{d}: DAMAGED marker: {e}", file=out)
            return 1
        print(
            f"{d}: {marker.get('kind', 'shards')} (marker version {marker.get('version', 1)})",
            file=out,
        )
        return _print(d, verify_marked(d, marker), out)
    if (d / "checkpoints").is_dir():
        d = d / "checkpoints"
    steps = sorted(p for p in d.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX))
    if not steps:
        if (d / ".metadata").is_file():
            print(f"{d}: a checkpoint without {MARKER}: written before checksums, or cut", file=out)
        else:
            print(f"{d}: no {MARKER} marker: not a complete tokenbridge directory", file=out)
        return 1
    damaged = 0
    for p in steps:
        if p.name.endswith(".tmp"):
            print(f"{p}: a save that did not finish (resume ignores it)", file=out)
        elif ".damaged" in p.name:
            print(f"{p}: moved aside by a resume that found it damaged", file=out)
        elif not (p / MARKER).is_file():
            print(f"{p}: no {MARKER}: written before checksums (not verifiable)", file=out)
        else:
            damaged += verify_path(p, out)
    return damaged


def verify_url(url: str, out=None) -> int:
    """Verify a marked directory in an object store (shards, a teacher cache, one checkpoint
    step): each listed object streamed once through its hash into a temporary copy (the shards'
    values are checked on that copy), then deleted; a folder of checkpoints is not walked."""
    from tokenbridge.remote_cache import download, read_marker_url

    out = out or sys.stdout
    try:
        raw, marker = read_marker_url(url, MARKER)
    except FileNotFoundError:
        print(f"{url}: no {MARKER} marker: not a complete tokenbridge directory (a folder of "
              "checkpoints: name one step-N)", file=out)  # fmt: skip
        return 1
    print(f"{url}: {marker.get('kind', 'shards')} (marker version {marker.get('version', 1)})",
          file=out)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tokenbridge-verify-") as tmp:
        d, errors, hashed = Path(tmp), {}, set()
        for name, expected in sorted(marker.get("checksums", {}).items()):
            try:
                download(urls.join(url, name), d / name, expected=expected)
                hashed.add(name)  # its hash checked on the way in: not read a second time
            except (checksums.DamagedFileError, FileNotFoundError) as e:
                errors[name] = str(e).removeprefix(f"{urls.join(url, name)}: ")
        (d / MARKER).write_bytes(raw)
        reports = verify_marked(d, marker, hashed=frozenset(hashed))
        for r in reports:
            r.error = errors.get(r.name, r.error)
        return _print(url, reports, out)


def _mark(args) -> int:
    """``--mark [--upload URL]``: mark each DIR (and upload the one DIR)."""
    from tokenbridge import remote_models

    if args.upload is not None and (not args.mark or len(args.dirs) != 1):
        raise cli.UsageError("--upload URL takes --mark and exactly one DIR")
    for d in args.dirs:
        d = urls.local(urls.check(d, where="DIR", doing="marking"))
        marker = remote_models.mark(d)
        size = sum(int(e["bytes"]) for e in marker["checksums"].values())
        print(f"{d}: marked {len(marker['checksums'])} files ({size / 1e6:.1f} MB)")
        if args.upload is not None:
            print(f"{d}: uploaded to {remote_models.upload(d, args.upload, marker=marker)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tokenbridge.commands.verify", description=__doc__.split("\n")[0]
    )
    ap.add_argument("dirs", nargs="+", help="shard, cache or checkpoint directories")
    ap.add_argument("--mark", action="store_true", help="write a model directory's marker")
    ap.add_argument("--upload", default=None, help="with --mark: copy the one DIR to this URL")
    args = ap.parse_args(argv)
    if args.mark or args.upload:
        return _mark(args)
    damaged = 0
    for d in [
        urls.check(d, where="DIR", schemes=urls.OBJECT_STORES, doing="verifying") for d in args.dirs
    ]:
        if urls.is_url(d):
            damaged += verify_url(d)
            continue
        d = urls.local(d)
        if not d.is_dir():
            print(f"{d}: no such directory", file=sys.stderr)
            damaged += 1
            continue
        damaged += verify_path(d)
    return 2 if damaged else 0


if __name__ == "__main__":
    sys.exit(cli.run(main, sys.argv[1:], prog="verify"))
