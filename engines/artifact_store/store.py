"""`Store`: one opened store URL (file:// or s3://) and what the pipeline does with it -- upload a run
directory, list keys, read JSON, download a file.

upload_run is idempotent: each file's sha256 is compared with the stored object's (S3 metadata
x-amz-meta-sha256, or the file's own hash on disk) and only changed or missing files are written. The
manifest (sha256 + size per relative path) goes last, so a store that holds a manifest holds every file it
names. Files deleted while the upload runs (a checkpoint rotated away) are left out of the manifest. Nothing is
ever deleted from the store: objects of files that left the run directory stay, but not in the manifest (the one
object deleted is preflight's probe, check_writable, written and removed before the run starts).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from engines.artifact_store.common import ArtifactStoreError, S3Credentials, StoreOptions, TransientStoreError
from engines.artifact_store.local import FileBackend, sha256_file
from engines.artifact_store.paths import (StoreLocation, check_key, check_prefix, join_key, parse_store_url,
                                          walk_run_dir)

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PROBE_NAME = ".v4rl-probe-"
"""Preflight's probe object (Store.check_writable): written and deleted under the run's prefix."""
MANIFEST_FORMAT = "v4rl-manifest/1"
JSON_MAX_BYTES = 64 * 1024 * 1024


@dataclass
class UploadReport:
    """What one upload_run did. Paths and URLs only: safe to return from a task or show in the UI."""

    store_url: str
    prefix: str
    manifest: str
    """URL of the run's manifest.json in the store."""
    uploaded: list[str] = field(default_factory=list)
    """Relative paths written this time (manifest.json included when it changed)."""
    skipped: list[str] = field(default_factory=list)
    """Relative paths already in the store with the same sha256."""
    multipart: list[str] = field(default_factory=list)
    """The uploaded paths that went up as multipart uploads."""
    vanished: list[str] = field(default_factory=list)
    """Files deleted while the upload ran (e.g. a rotated checkpoint); not in the manifest."""
    urls: dict[str, str] = field(default_factory=dict)
    """Relative path -> s3:// or file:// URL of every object of the run, manifest included."""
    bytes_uploaded: int = 0
    bytes_total: int = 0
    """Size of the whole run in the store (manifest included); bytes_uploaded is the part sent this time."""
    retries: int = 0
    """Requests retried on transient errors (5xx, throttling, timeouts, dropped connections)."""
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_manifest(entries: dict[str, tuple[str, int]]) -> bytes:
    """Deterministic JSON (same files -> same bytes), so an unchanged run re-uploads nothing."""
    files = {k: {"sha256": sha, "size": size} for k, (sha, size) in sorted(entries.items())}
    doc = {"format": MANIFEST_FORMAT, "files": files, "total_bytes": sum(s for _, s in entries.values())}
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def _write_local_manifest(run_root: Path, data: bytes) -> None:
    path = run_root / MANIFEST
    try:
        if path.is_file() and path.read_bytes() == data:
            return
        tmp = path.with_name(f".{MANIFEST}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only run directory can still be uploaded
        log.warning("could not write %s (%s); the manifest is in the store only", path, exc)


class Store:
    """An opened store. Keys are relative to the store URL; every key is checked (paths.check_key)."""

    def __init__(self, store_url: str | os.PathLike, *, credentials: S3Credentials | None = None,
                 options: StoreOptions | None = None, endpoint_url: str | None = None) -> None:
        self.location: StoreLocation = parse_store_url(store_url)
        self.options = options or StoreOptions()
        if endpoint_url:
            self.options = replace(self.options, endpoint_url=endpoint_url)
        if self.location.scheme == "file":
            self._backend = FileBackend(self.location.path)
        else:
            from engines.artifact_store.s3 import S3Backend  # boto3 only when needed

            self._backend = S3Backend(self.location.bucket, self.location.base, credentials=credentials,
                                      options=self.options)

    def __repr__(self) -> str:
        return f"Store({self.location.url})"

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(cancel=exc_type is not None)

    def close(self, *, cancel: bool = False) -> None:
        """Release connections; with `cancel`, abandon multipart transfers still in flight."""
        self._backend.close(cancel=cancel)

    @property
    def url(self) -> str:
        return self.location.url

    def object_url(self, key: str) -> str:
        return self._backend.url(check_key(key))

    # -- reading -----------------------------------------------------------------------------------------

    def list(self, prefix: str = "") -> list[str]:
        """Keys (relative to the store URL) under `prefix`, sorted. The prefix is matched by whole path
        segments: 'runs/r1' lists runs/r1/..., not runs/r10/...."""
        return list(self._backend.list(check_prefix(prefix) if prefix else ""))

    def read_bytes(self, key: str, *, max_bytes: int | None = None) -> bytes:
        return self._backend.get_bytes(check_key(key), max_bytes=max_bytes)

    def read_json(self, key: str, *, max_bytes: int = JSON_MAX_BYTES) -> Any:
        """Parse a stored JSON object. Only JSON: objects from a store are untrusted and never unpickled."""
        data = self.read_bytes(key, max_bytes=max_bytes)
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{self.object_url(key)} is not UTF-8 JSON ({exc})") from None

    def download(self, key: str, dest: str | os.PathLike | None = None) -> bytes | Path:
        """The object's bytes, or, with `dest`, the path it was written to (atomically)."""
        if dest is None:
            return self.read_bytes(key)
        dest = Path(dest)
        self._backend.get_file(check_key(key), dest)
        return dest

    # -- preflight ---------------------------------------------------------------------------------------

    def check_writable(self, prefix: str = "") -> str | None:
        """Write and delete a small probe object under `prefix` (where the run's upload goes), so a store that
        cannot take the run's artifacts stops the run before it trains, not at its first upload. Raises
        ArtifactStoreError in one line naming the store and the fix (no such bucket, denied, unreachable, a
        directory that cannot be created); returns a warning when only the delete failed, else None."""
        key = join_key(check_prefix(prefix), f"{PROBE_NAME}{uuid.uuid4().hex[:12]}") if prefix else \
            f"{PROBE_NAME}{uuid.uuid4().hex[:12]}"
        try:
            return self._backend.probe(key, b"v4rl preflight: this object is deleted at once\n")
        except ArtifactStoreError as exc:
            raise ArtifactStoreError(f"artifact store {self.url} is not writable: {exc}") from None

    # -- upload ------------------------------------------------------------------------------------------

    def upload_run(self, run_dir: str | os.PathLike, *, prefix: str, exclude: tuple[str, ...] = ()) -> UploadReport:
        t0 = time.perf_counter()
        prefix = check_prefix(prefix)
        run_root = Path(run_dir).expanduser().resolve()
        if self.location.scheme == "file":
            target = (self.location.path / prefix).resolve()
            if target != run_root and run_root in target.parents:
                raise ValueError(f"store target {target} lies inside the run directory {run_root}; the upload "
                                 "would copy itself. Choose a store outside the run directory")
        files = walk_run_dir(run_root, exclude=exclude)
        backend, threshold = self._backend, self.options.multipart_threshold
        report = UploadReport(store_url=self.url, prefix=prefix,
                              manifest=backend.url(join_key(prefix, MANIFEST)))
        existing = backend.list(prefix)
        entries: dict[str, tuple[str, int]] = {}

        def put(rel: str, key: str, size: int, sha: str, write) -> None:
            if existing.get(key) == size and backend.stored_sha256(key) == sha:
                report.skipped.append(rel)
            else:
                write()
                report.uploaded.append(rel)
                report.bytes_uploaded += size
            report.urls[rel] = backend.url(key)

        for f in files:
            key = join_key(prefix, f.key)
            try:
                before = f.path.stat()
                if before.st_size < threshold:  # small: hash and send the very bytes we read
                    data = f.path.read_bytes()
                    sha, size = hashlib.sha256(data).hexdigest(), len(data)
                    put(f.key, key, size, sha, lambda: backend.put_bytes(key, data, sha))
                else:  # large: stream it (multipart on S3), then make sure it did not change underneath
                    sha, size = sha256_file(f.path), before.st_size

                    def write_large() -> None:
                        backend.put_file(key, f.path, sha, size)
                        after = f.path.stat()
                        if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
                            raise TransientStoreError(f"{f.path} changed while it was uploaded to "
                                                      f"{backend.url(key)}; upload again once it is complete")
                        if self.location.scheme == "s3":
                            report.multipart.append(f.key)
                    put(f.key, key, size, sha, write_large)
            except FileNotFoundError:
                if f.path.exists():
                    raise
                log.warning("%s disappeared during the upload (rotated?); left out of the manifest", f.path)
                report.vanished.append(f.key)
                report.urls.pop(f.key, None)
                continue
            entries[f.key] = (sha, size)
            report.bytes_total += size

        manifest = build_manifest(entries)
        _write_local_manifest(run_root, manifest)
        mkey = join_key(prefix, MANIFEST)
        msha = hashlib.sha256(manifest).hexdigest()
        put(MANIFEST, mkey, len(manifest), msha, lambda: backend.put_bytes(mkey, manifest, msha))
        report.bytes_total += len(manifest)
        report.retries = backend.retries
        report.seconds = round(time.perf_counter() - t0, 3)
        log.info("uploaded %d files (%d bytes), skipped %d, %d retries -> %s", len(report.uploaded),
                 report.bytes_uploaded, len(report.skipped), report.retries, report.manifest)
        return report


# ----------------------------------------------------------------------------------------------------------
# One-call helpers (each opens and closes a Store).


def upload_run(run_dir: str | os.PathLike, store_url: str | os.PathLike, *, prefix: str,
               credentials: S3Credentials | None = None, options: StoreOptions | None = None,
               endpoint_url: str | None = None, exclude: tuple[str, ...] = ()) -> UploadReport:
    """Upload every file of `run_dir` under `<store_url>/<prefix>/<relative path>`, then manifest.json.

    Idempotent by sha256; large files go multipart; transient S3 errors are retried with backoff. Raises
    ValueError for keys or symlinks that would leave the prefix, TransientStoreError when retries ran out,
    ArtifactStoreError for permanent failures (denied, no such bucket). Credentials default to the
    environment; they never appear in the report, logs or errors.
    """
    with Store(store_url, credentials=credentials, options=options, endpoint_url=endpoint_url) as store:
        return store.upload_run(run_dir, prefix=prefix, exclude=exclude)


def check_store(store_url: str | os.PathLike, prefix: str = "", *, credentials: S3Credentials | None = None,
                options: StoreOptions | None = None, endpoint_url: str | None = None) -> str | None:
    """Store.check_writable on a store opened here; missing credentials fail the same way, in one line."""
    try:
        store = Store(store_url, credentials=credentials, options=options, endpoint_url=endpoint_url)
    except ArtifactStoreError as exc:
        raise ArtifactStoreError(f"artifact store {parse_store_url(store_url).url} is not writable: {exc}") from None
    with store:
        return store.check_writable(prefix)


def list_objects(store_url: str | os.PathLike, prefix: str = "", *, credentials: S3Credentials | None = None,
                 options: StoreOptions | None = None, endpoint_url: str | None = None) -> list[str]:
    """Keys under `prefix`, relative to `store_url`, sorted (e.g. to find earlier runs' eval/*.json)."""
    with Store(store_url, credentials=credentials, options=options, endpoint_url=endpoint_url) as store:
        return store.list(prefix)


def read_json(store_url: str | os.PathLike, key: str, *, credentials: S3Credentials | None = None,
              options: StoreOptions | None = None, endpoint_url: str | None = None,
              max_bytes: int = JSON_MAX_BYTES) -> Any:
    """A stored JSON object (parsed with json only: store contents are untrusted and never unpickled)."""
    with Store(store_url, credentials=credentials, options=options, endpoint_url=endpoint_url) as store:
        return store.read_json(key, max_bytes=max_bytes)


def download(store_url: str | os.PathLike, key: str, dest: str | os.PathLike | None = None, *,
             credentials: S3Credentials | None = None, options: StoreOptions | None = None,
             endpoint_url: str | None = None) -> bytes | Path:
    """The object's bytes, or with `dest` the path it was written to (sha256-checked against its metadata)."""
    with Store(store_url, credentials=credentials, options=options, endpoint_url=endpoint_url) as store:
        return store.download(key, dest)
