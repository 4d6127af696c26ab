"""Store URLs, object keys and the walk over a run directory: the checks that keep every key inside its
prefix.

A key is a relative, '/'-separated path with no empty, '.' or '..' segment, no backslash and no control
character, so `<prefix>/<key>` can never name anything outside `<prefix>`, in S3 or on disk. The walk turns
a run directory into (key, file) pairs and refuses symlinks that leave it.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

MAX_KEY_BYTES = 1024  # S3's limit on a whole key
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,61}[a-z0-9]$")
_DRIVE = re.compile(r"^[A-Za-z]:$")


def check_key(key: str, *, what: str = "artifact key") -> str:
    """Return `key` unchanged if it is a safe relative object key, else raise ValueError naming it."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"{what} is empty; give a relative path such as 'eval/step_000010.json'")
    if "\\" in key:
        raise ValueError(f"{what} {key!r} contains a backslash; keys use '/' separators only")
    if key.startswith("/") or _DRIVE.match(key.split("/")[0]):
        raise ValueError(f"{what} {key!r} is absolute; keys are relative to the store prefix")
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise ValueError(f"{what} {key!r} contains a control character")
    for segment in key.split("/"):
        if segment == "":
            raise ValueError(f"{what} {key!r} has an empty path segment ('//' or a trailing '/')")
        if segment in (".", ".."):
            raise ValueError(f"{what} {key!r} has a {segment!r} segment; keys cannot leave their prefix")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise ValueError(f"{what} {key[:80]!r}... is longer than {MAX_KEY_BYTES} bytes")
    return key


def check_prefix(prefix: str) -> str:
    """A run prefix such as 'runs/2024-06-01-a'; trailing slashes are dropped, anything else must be a key."""
    if not isinstance(prefix, str):
        raise ValueError(f"prefix must be a string, got {type(prefix).__name__}")
    return check_key(prefix.rstrip("/") if prefix.strip("/") else prefix, what="prefix")


def join_key(*parts: str) -> str:
    """'a/b' + 'c.json' -> 'a/b/c.json'; empty parts are skipped (each part is checked by the caller)."""
    return "/".join(p for p in parts if p)


@dataclass(frozen=True)
class StoreLocation:
    """A parsed store URL: `file` with an absolute `path`, or `s3` with a `bucket` and a key `base`."""

    scheme: str
    path: Path | None = None
    bucket: str = ""
    base: str = ""

    @property
    def url(self) -> str:
        if self.scheme == "file":
            return self.path.as_uri()
        return f"s3://{self.bucket}/{self.base}" if self.base else f"s3://{self.bucket}"

    def __str__(self) -> str:
        return self.url


def parse_store_url(url: str | os.PathLike) -> StoreLocation:
    """`file:///abs/path`, a plain path (made absolute) or `s3://bucket[/base/prefix]`.

    URLs that embed credentials (`s3://KEY:SECRET@bucket`) are refused without echoing them: credentials come
    from the environment or a Secret block, never from a URL that ends up in logs and flow parameters.
    """
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url.strip():
        raise ValueError("store URL is empty; use file:///abs/path, a directory path or s3://bucket/prefix")
    if "://" not in url:
        return StoreLocation("file", path=Path(os.path.abspath(os.path.expanduser(url))))
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if "@" in parts.netloc:
        raise ValueError(f"{scheme}:// store URL embeds credentials (user:secret@host); pass credentials through "
                         "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a Prefect Secret block instead")
    if parts.query or parts.fragment:
        raise ValueError(f"store URL {url!r} has a query or fragment; give the endpoint URL separately")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"store URL {url!r}: file:// URLs must be absolute (file:///abs/path), "
                             f"'{parts.netloc}' would be a host name")
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise ValueError(f"store URL {url!r}: file:// URLs must hold an absolute path")
        return StoreLocation("file", path=Path(os.path.normpath(path)))
    if scheme == "s3":
        bucket = parts.netloc
        if not _BUCKET.match(bucket):
            raise ValueError(f"store URL {url!r}: {bucket!r} is not a valid bucket name (3-63 characters of "
                             "a-z, 0-9, '.', '-')")
        base = unquote(parts.path).strip("/")
        if base:
            check_key(base, what=f"key prefix of {url!r}")
        return StoreLocation("s3", bucket=bucket, base=base)
    raise ValueError(f"store URL {url!r}: unsupported scheme {scheme!r}; use file:// or s3://")


@dataclass(frozen=True)
class RunFile:
    key: str    # relative to the run directory, '/'-separated
    path: Path  # where to read it (may be a symlink inside the run directory)


def _is_within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


RUN_LOCK = ".v4rl-lock"
"""The run-directory lock's file name (engines/runs/run_lock.py takes it): bookkeeping of the process running
now, never an artifact."""


def walk_run_dir(run_dir: str | os.PathLike, *, exclude: tuple[str, ...] = ()) -> list[RunFile]:
    """Every regular file under `run_dir`, sorted by key.

    Skipped: in-progress temporaries (directories whose name starts with '.', as a checkpoint being written,
    and files ending in '.tmp', as an atomic write in flight), the top-level manifest.json (it is derived) and
    RUN_LOCK (the run-directory lock, which names the process holding it), and keys matching an `exclude` glob. Symlinks are followed only when they stay inside the run directory;
    one that leaves it is a ValueError naming it.
    """
    root = Path(run_dir).expanduser().resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist or is not a directory")
    files: list[RunFile] = []
    visited = {root}

    def visit(directory: Path, rel: tuple[str, ...]) -> None:
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            key = "/".join((*rel, entry.name))
            path = Path(entry.path)
            if entry.is_symlink():
                target = Path(os.path.realpath(path))
                if not _is_within(target, root):
                    raise ValueError(f"{key} in {root} is a symlink to {target}, outside the run directory; "
                                     "copy the file in or remove the link")
                if not target.exists():
                    raise ValueError(f"{key} in {root} is a dangling symlink (to {target})")
            if entry.is_dir():  # follows links, now known to stay inside
                real = Path(os.path.realpath(path))
                if entry.name.startswith(".") or real in visited:
                    continue
                visited.add(real)
                visit(path, (*rel, entry.name))
            elif entry.is_file():
                if entry.name.endswith(".tmp") or key in ("manifest.json", RUN_LOCK):
                    continue
                if any(fnmatch.fnmatchcase(key, pat) for pat in exclude):
                    continue
                files.append(RunFile(check_key(key, what=f"file {str(path)!r} (key)"), path))

    visit(root, ())
    return files
