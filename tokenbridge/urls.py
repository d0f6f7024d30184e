"""Paths that are object-store URLs: how to tell them apart, which a command can use, and where
their connection settings come from.

A URL must never fall through to ``pathlib`` (``Path("s3://b/x")`` is the local path
``s3:/b/x``, which a writer would create), so each command states per argument the schemes it
takes (`check`), and any other ``scheme://`` is refused in one line (`UnsupportedURLError`, exit
2). The settings are the standard AWS variables, which boto3, pyarrow and s3fs read alike;
`s3_settings` gathers them for the clients that do not read them all. Pure apart from the
environment.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
from pathlib import Path

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
OBJECT_STORES = ("s3",)  # the schemes this repository reads and writes, and tests (SeaweedFS)


class UnsupportedURLError(ValueError):
    """A URL whose scheme the command cannot read or write (one line, exit 2)."""


class StorageAccessError(ValueError):
    """The object store refused the request (wrong credentials, no access to the bucket)."""


def scheme(path: str | os.PathLike | None) -> str | None:
    """``"s3"`` for ``s3://b/k``; None for a local path (``file://`` included: it is local)."""
    if path is None or isinstance(path, Path):
        return None
    m = _URL.match(str(path))
    if m is None:
        return None
    s = m.group(1).lower()
    return None if s == "file" else s


def is_url(path: str | os.PathLike | None) -> bool:
    return scheme(path) is not None


def local(path: str | os.PathLike) -> Path:
    """A local path argument as a Path (``file://`` stripped); refuses a URL (use `check`)."""
    p = str(path)
    if p.startswith("file://"):
        p = p[len("file://") :]
    if is_url(p):
        raise UnsupportedURLError(f"{path}: expected a local path here")
    return Path(p)


def check(
    value: str | os.PathLike | None, *, where: str, schemes: tuple[str, ...] = (), doing: str = ""
) -> str | None:
    """`value` (a command's path argument, named `where`) if it is local or its scheme is one
    of `schemes`; else `UnsupportedURLError` in one line, before anything is written."""
    if value is None:
        return None
    s = scheme(value)
    if s is None or s in schemes:
        return str(value)
    what = f"{doing} " if doing else ""
    allowed = (
        f"a local path or a URL of {', '.join(f'{x}://' for x in schemes)}"
        if schemes
        else "a local path"
    )
    raise UnsupportedURLError(
        f"{where}={value}: {what}{s}:// is not supported here; expected {allowed}"
    )


def join(base: str | os.PathLike, *names: str) -> str:
    """`base` / names, for a URL (posix separators, never normalised away) or a local path."""
    if is_url(base):
        return posixpath.join(str(base).rstrip("/"), *names)
    return str(Path(base).joinpath(*names))


def store_key(url: str) -> str:
    """``bucket/key`` of ``s3://bucket/key``: how s3fs names an object (other text unchanged)."""
    return url[len("s3://") :] if url.startswith("s3://") else url


def name(path: str | os.PathLike) -> str:
    """The last component of a path or URL (``s3://b/x/y/`` -> ``y``)."""
    return posixpath.basename(str(path).rstrip("/")) if is_url(path) else Path(path).name


def s3_settings(env: dict[str, str] | None = None) -> dict[str, str]:
    """The S3 connection settings in the environment: ``endpoint_url``, ``region``, and, only
    where given, ``key`` / ``secret`` / ``token`` (otherwise each client's own credential chain
    applies: profiles, instance roles). Unset ones are absent."""
    env = os.environ if env is None else env
    out = {
        "endpoint_url": env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"),
        "region": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
        "key": env.get("AWS_ACCESS_KEY_ID"),
        "secret": env.get("AWS_SECRET_ACCESS_KEY"),
        "token": env.get("AWS_SESSION_TOKEN"),
    }
    return {k: v for k, v in out.items() if v}


def retry_config(env: dict[str, str] | None = None) -> dict:
    """How every S3 client here retries: botocore's ``standard`` mode (exponential backoff with
    jitter, at most 20 s between attempts, on throttling, 5xx and dropped connections), 8
    attempts; ``AWS_RETRY_MODE`` / ``AWS_MAX_ATTEMPTS`` override them as they do for boto3."""
    env = os.environ if env is None else env
    return {
        "mode": env.get("AWS_RETRY_MODE") or "standard",
        "max_attempts": int(env.get("AWS_MAX_ATTEMPTS") or 8),
    }


def fsspec_options(settings: dict[str, str] | None = None, *, retries: dict | None = None) -> dict:
    """`s3_settings` as s3fs / fsspec storage options (``endpoint_url``, ``key``, ..., and the
    botocore retries of `retry_config`)."""
    s = s3_settings() if settings is None else settings
    out: dict = {k: s[k] for k in ("endpoint_url", "key", "secret", "token") if k in s}
    if "region" in s:
        out["client_kwargs"] = {"region_name": s["region"]}
    out["config_kwargs"] = {"retries": retry_config() if retries is None else retries}
    return out


# what an S3 error says when it refused the credentials (not a bare "403": a key may hold one)
_DENIED = re.compile(
    r"\(403\)|code 403\b|InvalidAccessKeyId|SignatureDoesNotMatch|AccessDenied|Forbidden"
)


def denied(text: str) -> bool:
    """Whether an object-store error's text says the credentials were refused."""
    return _DENIED.search(text) is not None


def _details(e: BaseException) -> str:
    """An error's text, with Beam's per-path exceptions (BeamIOError.exception_details) and an
    HTTP code where the exception carries one."""
    parts = [f"{type(e).__name__}: {e}"]
    details = getattr(e, "exception_details", None)
    if isinstance(details, dict):
        parts += [f"{type(x).__name__}: {x}" for x in details.values()]
    code = getattr(e, "code", None)
    return " ".join(parts) + (f" code {code}" if code is not None else "")


@contextlib.contextmanager
def store_errors(url: str, *, doing: str, keep: tuple[type[BaseException], ...] = ()):
    """An object store's failures on `url` as one line: refused credentials
    (`StorageAccessError`: exit 2), a missing object (FileNotFoundError), no answer
    (ConnectionError); `keep` and anything else as they are. Every client here (boto3 under
    Beam's S3 I/O, s3fs) says these in its own words."""
    try:
        yield
    except (StorageAccessError, FileNotFoundError, *keep):
        raise
    except Exception as e:
        text = _details(e)
        if isinstance(e, PermissionError) or denied(text):
            raise StorageAccessError(
                f"{url}: the object store refused {doing} (access denied); check "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL"
            ) from None
        if any(m in text for m in ("NoSuchKey", "NoSuchBucket", "Not Found", "code 404")):
            raise FileNotFoundError(f"{url}: no such object ({doing})") from None
        if "Could not connect" in text:
            raise ConnectionError(
                f"{url}: the object store did not answer ({doing}); is AWS_ENDPOINT_URL "
                "right and the server up?"
            ) from None
        raise
