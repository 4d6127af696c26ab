"""Prefect task: upload a run directory to the artifact store (engines/artifact_store), plus the credential
lookup the nightly flow shares for its history reads.

Retries come in two layers. The library retries each request (5xx, throttling, timeouts, dropped
connections) a bounded number of times with backoff; when that runs out it raises TransientStoreError and
the task is retried as a whole, which is cheap because objects already in place are skipped by sha256.
A bad key, denied access or a missing bucket fails at once. The task is never cached: every call uploads
what changed since the last one.

Credentials: the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN) or a Prefect
Secret block named by `secret_block` -- either a mapping {"aws_access_key_id", "aws_secret_access_key"[,
"aws_session_token"]} or just the secret access key as a string (the key id then comes from the
environment). Only the block's *name* is a task parameter; the values stay inside the task run.

    from prefect.blocks.system import Secret
    Secret(value={"aws_access_key_id": "...", "aws_secret_access_key": "..."}).save("v4rl-s3")
"""

from __future__ import annotations

import logging

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError
from prefect.tasks import exponential_backoff

from engines.artifact_store import S3Credentials, TransientStoreError, upload_run


def only_transient(task, task_run, state) -> bool:
    """retry_condition_fn: retry only when the store gave up on transient errors."""
    try:
        state.result()
    except TransientStoreError:
        return True
    except BaseException:
        return False
    return False


def resolve_credentials(secret_block: str | None) -> dict:
    """{"credentials": S3Credentials} from the Prefect Secret block `secret_block`, or {} when none is named
    (the library then reads the environment). Splat it into the library calls:
    `read_json(url, key, **resolve_credentials(block))`."""
    if not secret_block:
        return {}
    from prefect.blocks.system import Secret

    try:
        value = Secret.load(secret_block).get()
    except Exception as exc:  # the text of a validation error could quote the value: name the type only
        raise ValueError(f"Prefect Secret block {secret_block!r} could not be loaded ({type(exc).__name__}); "
                         f"create it with Secret(value={{...}}).save({secret_block!r})") from None
    return {"credentials": S3Credentials.from_secret_value(value, source=f"Secret block {secret_block!r}")}


def _logger():
    try:
        return get_run_logger()
    except MissingContextError:  # called as .fn() outside a run
        return logging.getLogger(__name__)


@task(name="upload-artifacts", cache_policy=NO_CACHE, retries=3,
      retry_delay_seconds=exponential_backoff(backoff_factor=10), retry_jitter_factor=0.5,
      retry_condition_fn=only_transient)
def upload_artifacts(run_dir: str, store_url: str, prefix: str, secret_block: str | None = None,
                     endpoint_url: str | None = None) -> dict:
    """Upload `run_dir` under `<store_url>/<prefix>/` with manifest.json last; skip what is already there.

    Returns UploadReport.to_dict(): uploaded / skipped / multipart / vanished paths, bytes, retries, per-file
    URLs (`urls`) and the manifest URL (`manifest`). Paths and URLs only, no credentials."""
    report = upload_run(run_dir, store_url, prefix=prefix, endpoint_url=endpoint_url,
                        **resolve_credentials(secret_block))
    _logger().info("artifacts: %d uploaded (%.1f MB), %d unchanged, %d request retries -> %s",
                   len(report.uploaded), report.bytes_uploaded / 1e6, len(report.skipped), report.retries,
                   report.manifest)
    return report.to_dict()
