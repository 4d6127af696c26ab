"""The s3:// store through plain boto3 (AWS, MinIO, moto, any endpoint that speaks S3).

Retries. botocore's own retry loop is switched off (one attempt) and replaced by a `needs-retry` handler on
the client, so every request -- a PUT, a HEAD, a list page, each part of a multipart upload -- is retried on
5xx, throttling (SlowDown, 503, 429), timeouts and dropped connections with our exponential backoff and
jitter, a bounded number of times, and the retries are counted. Retrying is safe: an upload writes one key,
so a PUT repeated after a lost response overwrites the same object with the same bytes; nothing is added.

Every call has connect and read timeouts (botocore Config). Object sha256s are stored as user metadata
(x-amz-meta-sha256), which is what makes uploads idempotent.
"""

from __future__ import annotations

import hashlib
import logging
import mimetypes
import os
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import unquote, urlsplit

import boto3
import botocore.exceptions as bex
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config

from engines.artifact_store.common import (ArtifactStoreError, S3Credentials, StoreOptions, TransientStoreError,
                                           guard_loggers, redact, register_secrets)
from engines.artifact_store.paths import check_key, join_key

log = logging.getLogger(__name__)

THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "ThrottledException",
                            "RequestThrottled", "RequestLimitExceeded", "TooManyRequestsException",
                            "ServiceUnavailable", "InternalError", "RequestTimeout", "RequestTimeoutException"})
NETWORK_ERRORS = (bex.ConnectionError, bex.HTTPClientError, bex.IncompleteReadError)
SHA_META = "sha256"  # -> x-amz-meta-sha256


def transient_reason(response=None, exc: BaseException | None = None) -> str | None:
    """Why this outcome is worth retrying, or None when it is not (success, 4xx, a local bug)."""
    if exc is not None:
        if isinstance(exc, bex.ClientError):
            return transient_reason((None, exc.response))
        if isinstance(exc, NETWORK_ERRORS):
            return type(exc).__name__
        return None
    if response is None:
        return None
    http, parsed = response
    status = http.status_code if http is not None else parsed.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = (parsed or {}).get("Error", {}).get("Code")
    if status is not None and (status >= 500 or status == 429) or code in THROTTLE_CODES:
        return f"HTTP {status}{f' {code}' if code else ''}"
    return None


def describe(exc: BaseException) -> str:
    """One line about a failure, scrubbed of any registered secret."""
    if isinstance(exc, bex.ClientError):
        err = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        text = f"{err.get('Code', '?')} (HTTP {status}): {err.get('Message', '')}".rstrip(": ")
    else:
        text = f"{type(exc).__name__}: {exc}"
    return redact(text)


def _extra_args(key: str, sha256: str) -> dict:
    """The sha256 as user metadata (what idempotency compares) and a content type, so a browser or the
    Prefect UI following a link shows a PNG or JSON instead of downloading it."""
    ctype = mimetypes.guess_type(key)[0] or ("text/plain" if key.endswith((".jsonl", ".md", ".txt"))
                                              else "application/octet-stream")
    return {"Metadata": {SHA_META: sha256}, "ContentType": ctype}


def _target(request_dict: dict) -> str:
    path = urlsplit(request_dict.get("url", "")).path
    return "s3:/" + unquote(path) if path else "?"


class S3Backend:
    def __init__(self, bucket: str, base: str, *, credentials: S3Credentials | None, options: StoreOptions) -> None:
        self.bucket, self.base, self.options = bucket, base, options
        self.retries = 0
        self._lock = threading.Lock()
        self._transfer = None
        endpoint = options.resolved_endpoint()
        config = Config(
            connect_timeout=options.connect_timeout,
            read_timeout=options.read_timeout,
            retries={"total_max_attempts": 1, "mode": "standard"},  # retries are ours (_needs_retry)
            max_pool_connections=max(10, options.max_concurrency + 2),
            s3={"addressing_style": "path"} if endpoint else None,
        )
        session = boto3.session.Session()  # private: never the process-wide default session
        creds = credentials or S3Credentials.from_env()
        if creds is None:  # fall back to botocore's chain (profiles, instance roles)
            found = session.get_credentials()
            if found is None:
                raise ArtifactStoreError(f"no S3 credentials for s3://{bucket}: set AWS_ACCESS_KEY_ID and "
                                         "AWS_SECRET_ACCESS_KEY or pass a Prefect Secret block")
            frozen = found.get_frozen_credentials()
            register_secrets(frozen.access_key, frozen.secret_key, frozen.token)
            keys = {}
        else:
            keys = dict(aws_access_key_id=creds.access_key_id, aws_secret_access_key=creds.secret_access_key,
                        aws_session_token=creds.session_token)
        self._client = session.client("s3", region_name=options.resolved_region(), endpoint_url=endpoint,
                                      config=config, **keys)
        self._client.meta.events.register("needs-retry.s3", self._needs_retry)
        guard_loggers()

    def __repr__(self) -> str:
        return f"S3Backend(s3://{self.bucket}/{self.base})"

    # -- retries -----------------------------------------------------------------------------------------

    def _needs_retry(self, attempts: int, operation, request_dict: dict, response=None, caught_exception=None,
                     **_) -> float | None:
        reason = transient_reason(response, caught_exception)
        if reason is None:
            return None
        if attempts >= self.options.max_attempts:
            log.warning("%s %s: %s; giving up after %d attempts", operation.name, _target(request_dict), reason,
                        attempts)
            return None
        delay = self.options.backoff(attempts)
        with self._lock:
            self.retries += 1
        log.warning("%s %s: %s; retry %d of %d in %.2f s", operation.name, _target(request_dict), reason,
                    attempts, self.options.max_attempts - 1, delay)
        return delay

    def _fail(self, action: str, key: str, exc: BaseException) -> ArtifactStoreError:
        reason = transient_reason(exc=exc)
        where = self.url(key)
        # NoSuchUpload: a multipart upload that was aborted under us; starting it again fixes it.
        if reason is not None or getattr(exc, "response", {}).get("Error", {}).get("Code") == "NoSuchUpload":
            return TransientStoreError(f"{action} {where} failed after {self.options.max_attempts} attempts: "
                                       f"{describe(exc)}")
        return ArtifactStoreError(f"{action} {where} failed: {describe(exc)}")

    def _retry_body(self, action: str, key: str, read):
        """Run `read` (a GET and its body) again when the body stream breaks, which botocore cannot retry."""
        for attempt in range(1, self.options.max_attempts + 1):
            try:
                return read()
            except (bex.ResponseStreamingError, bex.IncompleteReadError, bex.ReadTimeoutError) as exc:
                if attempt == self.options.max_attempts:
                    raise self._fail(action, key, exc) from None
                with self._lock:
                    self.retries += 1
                time.sleep(self.options.backoff(attempt))
            except bex.BotoCoreError as exc:
                raise self._fail(action, key, exc) from None
            except bex.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    raise FileNotFoundError(f"no object {self.url(key)}") from None
                raise self._fail(action, key, exc) from None

    # -- objects -----------------------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        return join_key(self.base, check_key(key))

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{join_key(self.base, key)}"

    def list(self, prefix: str) -> dict[str, int]:
        full = join_key(self.base, check_key(prefix, what="prefix")) + "/" if prefix else (
            self.base + "/" if self.base else "")
        out: dict[str, int] = {}
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                for obj in page.get("Contents", []):
                    key = obj["Key"][len(self.base) + 1:] if self.base else obj["Key"]
                    out[key] = obj["Size"]
        except (bex.ClientError, bex.BotoCoreError) as exc:
            raise self._fail("listing", prefix, exc) from None
        return dict(sorted(out.items()))

    def stored_sha256(self, key: str) -> str | None:
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=self._full(key))
        except bex.ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return None
            raise self._fail("reading metadata of", key, exc) from None
        except bex.BotoCoreError as exc:
            raise self._fail("reading metadata of", key, exc) from None
        return head.get("Metadata", {}).get(SHA_META)

    def put_bytes(self, key: str, data: bytes, sha256: str) -> None:
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._full(key), Body=data, **_extra_args(key, sha256))
        except (bex.ClientError, bex.BotoCoreError) as exc:
            self._check_landed(key, sha256, exc)

    def put_file(self, key: str, path: Path, sha256: str, size: int) -> None:
        """Multipart when `size` >= the threshold (s3transfer splits it; each part is retried on its own)."""
        if self._transfer is None:
            cfg = TransferConfig(multipart_threshold=self.options.multipart_threshold,
                                 multipart_chunksize=self.options.multipart_chunksize,
                                 max_concurrency=self.options.max_concurrency, use_threads=True)
            self._transfer = create_transfer_manager(self._client, cfg)
        try:
            self._transfer.upload(str(path), self.bucket, self._full(key),
                                  extra_args=_extra_args(key, sha256)).result()
        except (bex.ClientError, bex.BotoCoreError) as exc:
            self._check_landed(key, sha256, exc)

    def _check_landed(self, key: str, sha256: str, exc: BaseException) -> None:
        """Return if a write that reported `exc` is in place anyway, else raise a clear error naming the object.

        A write whose last response was lost may have landed (a retried CompleteMultipartUpload answers
        NoSuchUpload because the first one went through); the object with our sha256 is then a success."""
        landed = False
        if transient_reason(exc=exc) is not None or getattr(exc, "response", {}).get("Error", {}).get("Code") \
                == "NoSuchUpload":
            try:
                landed = self.stored_sha256(key) == sha256
            except ArtifactStoreError:
                landed = False
        if landed:
            log.info("%s: the write reported %s but the object is in place with the right sha256",
                     self.url(key), describe(exc))
            return
        raise self._fail("upload to", key, exc) from None

    def probe(self, key: str, data: bytes) -> str | None:
        """Write `data` at `key` and delete it again (preflight's check that uploads will land). ArtifactStoreError
        naming the object and the fix when the write fails; a warning (None when clean) when only the delete
        does, since uploads never delete."""
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._full(key), Body=data)
        except (bex.ClientError, bex.BotoCoreError) as exc:
            raise ArtifactStoreError(f"{describe(exc)}; {self._probe_fix(exc)}") from None
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self._full(key))
        except (bex.ClientError, bex.BotoCoreError) as exc:
            return f"could not delete the probe object {self.url(key)} ({describe(exc)}); remove it by hand"
        return None

    def _probe_fix(self, exc: BaseException) -> str:
        error = getattr(exc, "response", {}) or {}
        code = error.get("Error", {}).get("Code")
        if code == "NoSuchBucket":
            return f"create the bucket {self.bucket!r} or point store_url at an existing one"
        if code in ("PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException"):
            return "set AWS_REGION to the bucket's region"
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                    "AllAccessDisabled") or error.get("ResponseMetadata", {}).get("HTTPStatusCode") == 403:
            return (f"give credentials allowed to write to s3://{self.bucket}/{self.base} (AWS_ACCESS_KEY_ID / "
                    "AWS_SECRET_ACCESS_KEY on the worker, or s3_secret_block)")
        if isinstance(exc, (*NETWORK_ERRORS, bex.ConnectTimeoutError, bex.ReadTimeoutError)):
            return "check s3_endpoint_url (or AWS_ENDPOINT_URL) and that the endpoint answers from this host"
        return "check store_url, s3_endpoint_url and the credentials"

    def get_bytes(self, key: str, *, max_bytes: int | None = None) -> bytes:
        def read() -> bytes:
            obj = self._client.get_object(Bucket=self.bucket, Key=self._full(key))
            if max_bytes is not None and obj["ContentLength"] > max_bytes:
                obj["Body"].close()
                raise ValueError(f"{self.url(key)} is {obj['ContentLength']} bytes, over the {max_bytes}-byte limit")
            data = obj["Body"].read()
            self._verify(key, obj, hashlib.sha256(data).hexdigest())
            return data
        return self._retry_body("download of", key, read)

    def get_file(self, key: str, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.part")

        def read() -> None:
            obj = self._client.get_object(Bucket=self.bucket, Key=self._full(key))
            h = hashlib.sha256()
            with open(tmp, "wb") as f:
                for chunk in obj["Body"].iter_chunks(1024 * 1024):
                    h.update(chunk)
                    f.write(chunk)
            self._verify(key, obj, h.hexdigest())
            os.replace(tmp, dest)
        try:
            self._retry_body("download of", key, read)
        finally:
            tmp.unlink(missing_ok=True)

    def _verify(self, key: str, obj: dict, sha256: str) -> None:
        stored = obj.get("Metadata", {}).get(SHA_META)
        if stored and stored != sha256:
            raise ArtifactStoreError(f"{self.url(key)}: content sha256 {sha256} does not match its recorded "
                                     f"sha256 {stored}; the object is corrupt or was overwritten by another tool")

    def close(self, *, cancel: bool = False) -> None:
        if self._transfer is not None:
            self._transfer.shutdown(cancel=cancel)
            self._transfer = None
        self._client.close()

