"""Artifact store: a run directory to `file://` or `s3://` storage, and back.

    from engines.artifact_store import upload_run, read_json, list_objects
    report = upload_run("runs/r1", "s3://bucket/v4rl", prefix="runs/r1",
                        options=StoreOptions(endpoint_url="http://127.0.0.1:9000"))
    report.manifest_url  # s3://bucket/v4rl/runs/r1/manifest.json

- Store URLs: `file:///abs/path` or a plain path (the default kind), `s3://bucket[/base]` through boto3 with
  an optional endpoint (MinIO, moto). Credentials: passed in (`S3Credentials`, e.g. from a Prefect Secret
  block resolved by tasks/upload.py) or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN.
  They are never logged, never in reprs, errors or reports.
- Keys stay inside their prefix (paths.check_key); symlinks out of the run directory are refused.
- Idempotent by sha256, manifest.json last, multipart above a threshold, bounded retries with backoff and
  jitter on 5xx / throttling / timeouts / dropped connections (s3.py).
- Stored objects are only ever read as bytes or JSON: nothing from a store is unpickled.
- check_store writes and deletes a probe object: the preflight check that the store takes the run's uploads.

No Prefect in here; tasks/upload.py is the task wrapper.
"""

from engines.artifact_store.common import (ArtifactStoreError, S3Credentials, StoreOptions, TransientStoreError,
                                           redact)
from engines.artifact_store.paths import StoreLocation, check_key, check_prefix, parse_store_url, walk_run_dir
from engines.artifact_store.store import (MANIFEST, Store, UploadReport, build_manifest, check_store, download,
                                          list_objects, read_json, upload_run)

__all__ = [
    "ArtifactStoreError", "MANIFEST", "S3Credentials", "Store", "StoreLocation", "StoreOptions",
    "TransientStoreError", "UploadReport", "build_manifest", "check_key", "check_prefix", "check_store", "download",
    "list_objects", "parse_store_url", "read_json", "redact", "upload_run", "walk_run_dir",
]
