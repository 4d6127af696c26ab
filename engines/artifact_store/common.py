"""Errors, credentials, connection options and the secret scrubber shared by the store backends."""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

MiB = 1024 * 1024


class ArtifactStoreError(RuntimeError):
    """A store operation failed for good. The message names the object; it never holds credentials."""

    transient = False


class TransientStoreError(ArtifactStoreError):
    """Failed on errors a later retry can fix (5xx, throttling, timeouts, dropped connections, a file that
    changed while it was read). The Prefect task retries only these."""

    transient = True


# ----------------------------------------------------------------------------------------------------------
# Credentials


@dataclass(frozen=True, repr=False)
class S3Credentials:
    """Plain credential values. The repr and str never show them; nothing in this package logs them."""

    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.access_key_id or not self.secret_access_key:
            raise ValueError("S3 credentials need both an access key id and a secret access key")
        register_secrets(self.access_key_id, self.secret_access_key, self.session_token)

    def __repr__(self) -> str:
        token = ", session_token=<redacted>" if self.session_token else ""
        return f"S3Credentials(access_key_id=<redacted>, secret_access_key=<redacted>{token})"

    __str__ = __repr__

    def __reduce__(self):  # keep them out of pickled task results and caches
        raise TypeError("S3Credentials cannot be pickled; pass the Secret block name instead")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> S3Credentials | None:
        """AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, or None when they are not set."""
        env = os.environ if environ is None else environ
        key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
        if not key or not secret:
            return None
        return cls(key, secret, env.get("AWS_SESSION_TOKEN") or None)

    @classmethod
    def from_secret_value(cls, value: object, *, source: str = "secret",
                          environ: Mapping[str, str] | None = None) -> S3Credentials:
        """Credentials from a Prefect Secret block's value: a mapping with aws_access_key_id /
        aws_secret_access_key [/ aws_session_token] (the 'aws_' prefix and case are optional), or a plain
        string holding only the secret access key, the key id then coming from AWS_ACCESS_KEY_ID."""
        env = os.environ if environ is None else environ
        if isinstance(value, Mapping):
            norm = {str(k).lower().removeprefix("aws_"): v for k, v in value.items()}
            key, secret, token = (norm.get("access_key_id"), norm.get("secret_access_key"),
                                  norm.get("session_token"))
            if not isinstance(key, str) or not isinstance(secret, str) or not key or not secret:
                raise ValueError(f"{source} must hold aws_access_key_id and aws_secret_access_key as strings "
                                 f"(it has the keys {sorted(map(str, value))})")
            return cls(key, secret, token if isinstance(token, str) and token else None)
        if isinstance(value, str) and value:
            key = env.get("AWS_ACCESS_KEY_ID")
            if not key:
                raise ValueError(f"{source} holds only a secret access key; set AWS_ACCESS_KEY_ID for its key id "
                                 "or store a mapping with aws_access_key_id and aws_secret_access_key")
            return cls(key, value, env.get("AWS_SESSION_TOKEN") or None)
        raise ValueError(f"{source} holds a {type(value).__name__}; store a mapping with aws_access_key_id "
                         "and aws_secret_access_key, or the secret access key as a string")


# ----------------------------------------------------------------------------------------------------------
# Keeping secrets out of logs and messages.
#
# botocore logs request headers and canonical requests at DEBUG (the access key id in Authorization, a
# session token in X-Amz-Security-Token). Every credential value this process hands to a store is
# registered here, and a filter on the botocore/boto3/s3transfer/urllib3 loggers rewrites any record that
# contains one. Messages built here go through `redact` as well.

_SECRETS: set[str] = set()
_SECRETS_LOCK = threading.Lock()
_GUARDED_PREFIXES = ("botocore", "boto3", "s3transfer", "urllib3", "engines.artifact_store")
REDACTED = "<redacted>"


def register_secrets(*values: str | None) -> None:
    with _SECRETS_LOCK:
        _SECRETS.update(v for v in values if v and len(v) >= 4)


def redact(text: str) -> str:
    with _SECRETS_LOCK:
        secrets = sorted(_SECRETS, key=len, reverse=True)
    for s in secrets:
        if s in text:
            text = text.replace(s, REDACTED)
    return text


class _SecretFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not _SECRETS:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a broken record is the logging module's problem, not a leak
            return True
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


_FILTER = _SecretFilter()


def guard_loggers() -> None:
    """Attach the scrubber to every existing logger of the S3 stack (loggers are created on import, so call
    this after the client exists). Idempotent."""
    names = [n for n in list(logging.root.manager.loggerDict) if n.startswith(_GUARDED_PREFIXES)]
    for name in {*names, *_GUARDED_PREFIXES}:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


# ----------------------------------------------------------------------------------------------------------
# Options


@dataclass(frozen=True, kw_only=True)
class StoreOptions:
    """How to reach an s3:// store and how hard to try. Ignored for file:// stores."""

    endpoint_url: str | None = None
    """MinIO/moto-like endpoint, e.g. http://127.0.0.1:9000; default AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL,
    then AWS itself. Path-style addressing is used whenever an endpoint is given."""
    region: str | None = None
    """Signing region; default AWS_REGION / AWS_DEFAULT_REGION, then us-east-1."""
    multipart_threshold: int = 64 * MiB
    """Files of at least this size go up as multipart uploads (boto3 TransferConfig)."""
    multipart_chunksize: int = 16 * MiB
    """Part size of multipart uploads; S3 requires at least 5 MiB."""
    max_concurrency: int = 4
    """Parts in flight at once for one multipart upload."""
    max_attempts: int = 5
    """Attempts per request (the first one included) on 5xx, throttling, timeouts and dropped connections."""
    backoff_base: float = 0.5
    """Delay before the first retry in seconds; doubles per attempt, with +-50% jitter."""
    backoff_max: float = 20.0
    """Cap on one retry delay in seconds."""
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    """Seconds to wait for a connection / for the next bytes of a response, on every call."""

    def __post_init__(self) -> None:
        if self.multipart_chunksize < 5 * MiB:
            raise ValueError(f"multipart_chunksize={self.multipart_chunksize} is below S3's 5 MiB minimum part "
                             "size; use at least 5 * 1024 * 1024")
        if self.multipart_threshold < 1:
            raise ValueError("multipart_threshold must be positive")
        if self.max_attempts < 1:
            raise ValueError("max_attempts counts the first attempt too, so it must be at least 1")
        if self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        if min(self.backoff_base, self.backoff_max) < 0 or min(self.connect_timeout, self.read_timeout) <= 0:
            raise ValueError("backoff delays must be >= 0 and timeouts > 0 seconds")
        if self.endpoint_url and "@" in self.endpoint_url.split("://", 1)[-1].split("/", 1)[0]:
            raise ValueError("endpoint_url embeds credentials (user:secret@host); pass them through the "
                             "environment or a Secret block")

    def backoff(self, attempt: int) -> float:
        """Delay after failed attempt number `attempt` (1-based): base * 2**(attempt-1), capped, jittered."""
        delay = min(self.backoff_max, self.backoff_base * 2 ** (attempt - 1))
        return delay * random.uniform(0.5, 1.5)

    def resolved_endpoint(self) -> str | None:
        return self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")

    def resolved_region(self) -> str:
        return self.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
