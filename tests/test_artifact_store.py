"""The artifact store: a run directory to file:// and to an S3-compatible server (moto on 127.0.0.1) behind a
fault-injecting proxy, and back.

Pinned here: what lands in the store and its manifest match the run directory byte for byte; a second
upload writes nothing (counted at the proxy); large files go multipart; 5xx, throttling, slow answers and
dropped connections are retried without duplicating an object, and persistent failure ends in a bounded
number of attempts with an error naming the object; keys cannot leave their prefix; planted credentials
appear in no log, repr, error, report or file; store contents are never unpickled. The S3 fault tests carry
the `faults` marker (issue 8's suite) and run by default too.

    .venv/bin/python -m pytest tests/test_artifact_store.py -q
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import time
import traceback
from pathlib import Path

import pytest

from engines.artifact_store import (ArtifactStoreError, S3Credentials, Store, StoreOptions, TransientStoreError,
                                    check_key, download, list_objects, parse_store_url, read_json, upload_run)
from engines.artifact_store.paths import RunFile

MiB = 1024 * 1024
# Fast backoff and short timeouts so fault tests take well under a second each.
FAST = StoreOptions(backoff_base=0.01, backoff_max=0.05, connect_timeout=2, read_timeout=2,
                    multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)

RUN_FILES = {
    "config.json": json.dumps({"preset": "tiny-cpu", "steps": 20}),
    "metrics.jsonl": '{"step": 1, "reward": 0.1}\n{"step": 2, "reward": 0.2}\n',
    "eval/step_000010.json": json.dumps({"step": 10, "pass@1": 0.41}),
    "plots/reward.png": b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8,
    "checkpoints/latest_checkpointed_iteration.txt": "10",
    "checkpoints/iter_0000010/.metadata": b"\x00dcp-metadata",
    "checkpoints/iter_0000010/metadata.json": '{"iteration": 10}',
    "checkpoints/iter_0000010/__0_0.distcp": bytes(range(251)) * 400,
    "report.md": "# run report\n",
}
# In-flight temporaries of the writers (runlog, checkpointing): never uploaded.
TEMPORARIES = {
    ".metrics.jsonl.tmp": "{}",
    "checkpoints/.latest_checkpointed_iteration.txt.tmp": "20",
    "checkpoints/.iter_0000020.partial-1a2b3c4d/__0_0.distcp": b"half a checkpoint",
}


def make_run(root: Path, files: dict | None = None) -> Path:
    run = root / "run"
    for rel, content in {**(RUN_FILES if files is None else files), **TEMPORARIES}.items():
        p = run / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return run


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def local_files(run: Path) -> dict[str, bytes]:
    return {rel: (run / rel).read_bytes() for rel in RUN_FILES}


def assert_no_duplicates(bucket, prefix: str, expected: set[str]) -> None:
    keys = bucket.keys(prefix)
    assert len(keys) == len(set(keys)), f"duplicate keys: {keys}"
    assert set(keys) == expected
    assert not bucket.client.list_multipart_uploads(Bucket=bucket.name).get("Uploads"), "dangling multipart upload"


# ----------------------------------------------------------------------------------------------------------
# file://


def test_file_store_round_trip(tmp_path):
    run = make_run(tmp_path)
    store = tmp_path / "store"
    report = upload_run(run, store.as_uri(), prefix="runs/r1")

    assert sorted(report.uploaded) == sorted([*RUN_FILES, "manifest.json"]) and report.skipped == []
    for rel, data in local_files(run).items():
        assert (store / "runs/r1" / rel).read_bytes() == data
        assert report.urls[rel] == (store / "runs/r1" / rel).as_uri()
    assert not any(p.name.endswith(".tmp") or ".partial-" in str(p) for p in store.rglob("*"))

    manifest = json.loads((store / "runs/r1/manifest.json").read_text())
    assert manifest["files"] == {rel: {"sha256": sha(d), "size": len(d)} for rel, d in local_files(run).items()}
    assert report.manifest == (store / "runs/r1/manifest.json").as_uri()
    assert (run / "manifest.json").read_bytes() == (store / "runs/r1/manifest.json").read_bytes()

    # read back through the helpers; a plain path names the same store
    assert read_json(str(store), "runs/r1/eval/step_000010.json")["pass@1"] == 0.41
    assert list_objects(store.as_uri(), "runs/r1/eval") == ["runs/r1/eval/step_000010.json"]
    assert download(store.as_uri(), "runs/r1/plots/reward.png") == RUN_FILES["plots/reward.png"]
    out = download(store.as_uri(), "runs/r1/report.md", tmp_path / "dl" / "report.md")
    assert out.read_text() == RUN_FILES["report.md"]

    # idempotent: nothing rewritten; one changed file goes up alone, with the manifest
    again = upload_run(run, str(store), prefix="runs/r1")
    assert again.uploaded == [] and len(again.skipped) == len(RUN_FILES) + 1
    (run / "metrics.jsonl").write_text(RUN_FILES["metrics.jsonl"] + '{"step": 3, "reward": 0.3}\n')
    third = upload_run(run, str(store), prefix="runs/r1")
    assert third.uploaded == ["metrics.jsonl", "manifest.json"]


def test_file_changed_or_vanished_during_upload(tmp_path, monkeypatch):
    """A checkpoint rotated away mid-upload is left out of the manifest instead of failing the upload."""
    import engines.artifact_store.store as store_mod

    run = make_run(tmp_path)
    real_walk = store_mod.walk_run_dir
    monkeypatch.setattr(store_mod, "walk_run_dir", lambda d, exclude=(): [
        *real_walk(d, exclude=exclude), RunFile("checkpoints/iter_0000001/gone.distcp", run / "gone")])
    report = upload_run(run, tmp_path / "store", prefix="r")
    assert report.vanished == ["checkpoints/iter_0000001/gone.distcp"]
    manifest = json.loads((tmp_path / "store/r/manifest.json").read_text())
    assert "checkpoints/iter_0000001/gone.distcp" not in manifest["files"]


# ----------------------------------------------------------------------------------------------------------
# s3:// through the proxy


def test_s3_upload_manifest_and_second_upload_skips(tmp_path, s3_bucket, s3_proxy):
    run = make_run(tmp_path)
    report = upload_run(run, s3_bucket.store_url("v4rl"), prefix="runs/r1", options=FAST,
                        endpoint_url=s3_proxy.url)
    expected = {f"v4rl/runs/r1/{rel}" for rel in [*RUN_FILES, "manifest.json"]}
    assert_no_duplicates(s3_bucket, "v4rl/", expected)
    assert report.manifest == f"s3://{s3_bucket.name}/v4rl/runs/r1/manifest.json"
    assert report.urls["config.json"] == f"s3://{s3_bucket.name}/v4rl/runs/r1/config.json"
    assert report.bytes_uploaded == report.bytes_total and report.retries == 0

    manifest = json.loads(s3_bucket.client.get_object(Bucket=s3_bucket.name,
                                                      Key="v4rl/runs/r1/manifest.json")["Body"].read())
    for rel, data in local_files(run).items():
        obj = s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=f"v4rl/runs/r1/{rel}")
        body = obj["Body"].read()
        assert body == data
        assert obj["Metadata"]["sha256"] == sha(data) == manifest["files"][rel]["sha256"]
        assert manifest["files"][rel]["size"] == len(data)
    assert set(manifest["files"]) == set(RUN_FILES)
    # the manifest was the last write
    puts = [r.path for r in s3_proxy.requests if r.method in ("PUT", "POST")]
    assert puts[-1].endswith("/manifest.json")

    s3_proxy.clear()
    again = upload_run(run, s3_bucket.store_url("v4rl"), prefix="runs/r1", options=FAST, endpoint_url=s3_proxy.url)
    assert again.uploaded == [] and sorted(again.skipped) == sorted([*RUN_FILES, "manifest.json"])
    assert s3_proxy.count("PUT", "POST") == 0, "an unchanged run must not re-put anything"
    assert_no_duplicates(s3_bucket, "v4rl/", expected)

    # the nightly flow's reads
    assert read_json(s3_bucket.store_url("v4rl"), "runs/r1/eval/step_000010.json", endpoint_url=s3_proxy.url,
                     options=FAST) == {"step": 10, "pass@1": 0.41}
    assert list_objects(s3_bucket.store_url("v4rl"), "runs", endpoint_url=s3_proxy.url) == sorted(
        k.removeprefix("v4rl/") for k in expected)
    with pytest.raises(FileNotFoundError):
        read_json(s3_bucket.store_url("v4rl"), "runs/r1/eval/step_000999.json", endpoint_url=s3_proxy.url)
    head = s3_bucket.client.head_object(Bucket=s3_bucket.name, Key="v4rl/runs/r1/plots/reward.png")
    assert head["ContentType"] == "image/png"


@pytest.mark.faults
def test_s3_multipart_for_large_file(tmp_path, s3_bucket, s3_proxy):
    big = os.urandom(10 * MiB + 123)
    run = make_run(tmp_path, {"config.json": "{}", "checkpoints/iter_0000010/model.distcp": big})
    # one part answers 503 once, and the completion's answer is lost after it went through
    s3_proxy.fail(1, status=503, methods=("PUT",), path_contains="partNumber=2")
    s3_proxy.drop(1, after_forward=True, methods=("POST",), path_contains="uploadId=")
    report = upload_run(run, s3_bucket.store_url(), prefix="r", options=FAST, endpoint_url=s3_proxy.url)

    assert report.multipart == ["checkpoints/iter_0000010/model.distcp"]
    assert s3_proxy.count("POST", query_contains="uploads") == 1  # CreateMultipartUpload
    assert s3_proxy.count("PUT", query_contains="partNumber=", fault=None) == 3  # 10 MiB in 5 MiB parts
    head = s3_bucket.client.head_object(Bucket=s3_bucket.name, Key="r/checkpoints/iter_0000010/model.distcp")
    assert head["ETag"].strip('"').endswith("-3") and head["Metadata"]["sha256"] == sha(big)
    assert_no_duplicates(s3_bucket, "r/", {"r/config.json", "r/checkpoints/iter_0000010/model.distcp",
                                           "r/manifest.json"})

    dest = download(s3_bucket.store_url(), "r/checkpoints/iter_0000010/model.distcp", tmp_path / "dl.bin",
                    endpoint_url=s3_proxy.url, options=FAST)
    assert sha(dest.read_bytes()) == sha(big)

    s3_proxy.clear()
    again = upload_run(run, s3_bucket.store_url(), prefix="r", options=FAST, endpoint_url=s3_proxy.url)
    assert again.uploaded == [] and s3_proxy.count("PUT", "POST") == 0


@pytest.mark.faults
def test_s3_lost_completion_answer_counts_as_landed(tmp_path, s3_bucket, s3_proxy):
    """CompleteMultipartUpload goes through but its answer is lost, and every retry of it fails: the object
    is in place with our sha256, so the upload succeeds instead of starting over (or duplicating)."""
    big = os.urandom(6 * MiB)
    run = make_run(tmp_path, {"checkpoints/iter_0000010/model.distcp": big})
    s3_proxy.drop(1, after_forward=True, methods=("POST",), path_contains="uploadId=")
    s3_proxy.fail(100, status=500, methods=("POST",), path_contains="uploadId=")
    report = upload_run(run, s3_bucket.store_url(), prefix="r", options=FAST, endpoint_url=s3_proxy.url)
    assert report.multipart == ["checkpoints/iter_0000010/model.distcp"]
    assert s3_proxy.count("POST", query_contains="uploadId=") == FAST.max_attempts
    assert_no_duplicates(s3_bucket, "r/", {"r/checkpoints/iter_0000010/model.distcp", "r/manifest.json"})
    body = s3_bucket.client.get_object(Bucket=s3_bucket.name, Key="r/checkpoints/iter_0000010/model.distcp")
    assert sha(body["Body"].read()) == sha(big)


@pytest.mark.faults
def test_s3_5xx_and_throttling_retried_without_duplicates(tmp_path, s3_bucket, s3_proxy):
    run = make_run(tmp_path)
    s3_proxy.fail(3, status=503)                    # SlowDown on the listing
    s3_proxy.fail(2, status=500, methods=("PUT",))  # InternalError on the first writes
    s3_proxy.fail(1, status=429, code="SlowDown", methods=("HEAD", "PUT"))
    report = upload_run(run, s3_bucket.store_url(), prefix="runs/r1", options=FAST, endpoint_url=s3_proxy.url)
    assert report.retries == 6 and s3_proxy.pending_faults() == 0
    assert_no_duplicates(s3_bucket, "runs/", {f"runs/r1/{rel}" for rel in [*RUN_FILES, "manifest.json"]})
    for rel, data in local_files(run).items():
        body = s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=f"runs/r1/{rel}")["Body"].read()
        assert body == data


@pytest.mark.faults
def test_s3_slow_answers_past_read_timeout_retried(tmp_path, s3_bucket, s3_proxy):
    run = make_run(tmp_path)
    opts = StoreOptions(backoff_base=0.01, read_timeout=0.5, connect_timeout=1)
    s3_proxy.slow(2, delay=1.5, methods=("PUT",))  # the writes land, their answers come too late
    s3_proxy.slow(1, delay=1.5, methods=("GET",))  # and the listing
    t0 = time.monotonic()
    report = upload_run(run, s3_bucket.store_url(), prefix="r", options=opts, endpoint_url=s3_proxy.url)
    assert report.retries >= 3 and s3_proxy.pending_faults() == 0 and time.monotonic() - t0 < 15
    assert_no_duplicates(s3_bucket, "r/", {f"r/{rel}" for rel in [*RUN_FILES, "manifest.json"]})


@pytest.mark.faults
def test_s3_dropped_connections_retried(tmp_path, s3_bucket, s3_proxy):
    run = make_run(tmp_path)
    s3_proxy.drop(1, methods=("GET",))                       # the listing
    s3_proxy.drop(2, methods=("PUT",))                       # before the write reaches the server
    s3_proxy.drop(1, methods=("PUT",), after_forward=True)   # after: written, answer lost
    report = upload_run(run, s3_bucket.store_url(), prefix="r", options=FAST, endpoint_url=s3_proxy.url)
    assert report.retries == 4 and s3_proxy.pending_faults() == 0
    assert_no_duplicates(s3_bucket, "r/", {f"r/{rel}" for rel in [*RUN_FILES, "manifest.json"]})
    assert sorted(report.uploaded) == sorted([*RUN_FILES, "manifest.json"])


@pytest.mark.faults
def test_s3_persistent_500_fails_naming_the_object(tmp_path, s3_bucket, s3_proxy):
    run = make_run(tmp_path)
    opts = StoreOptions(backoff_base=0.01, max_attempts=3, connect_timeout=1, read_timeout=2)
    s3_proxy.fail(1000, status=500, methods=("PUT",))
    with pytest.raises(TransientStoreError) as err:
        upload_run(run, s3_bucket.store_url(), prefix="r", options=opts, endpoint_url=s3_proxy.url)
    first = "checkpoints/iter_0000010/.metadata"  # the first file of the sorted walk
    assert f"s3://{s3_bucket.name}/r/{first}" in str(err.value)
    assert "3 attempts" in str(err.value) and "InternalError" in str(err.value)
    assert s3_proxy.count("PUT") == 3, "attempts must be bounded"
    assert s3_bucket.keys("r/") == [], "no manifest without its files"

    s3_proxy.clear()  # the store recovers: the next upload (a task retry) completes it
    upload_run(run, s3_bucket.store_url(), prefix="r", options=opts, endpoint_url=s3_proxy.url)
    assert_no_duplicates(s3_bucket, "r/", {f"r/{rel}" for rel in [*RUN_FILES, "manifest.json"]})


def test_s3_permanent_errors_are_not_retried(tmp_path, s3_bucket, s3_proxy):
    run = make_run(tmp_path)
    with pytest.raises(ArtifactStoreError) as err:
        upload_run(run, "s3://no-such-bucket-v4rl", prefix="r", options=FAST, endpoint_url=s3_proxy.url)
    assert not isinstance(err.value, TransientStoreError) and "NoSuchBucket" in str(err.value)
    assert len(s3_proxy.requests) == 1


# ----------------------------------------------------------------------------------------------------------
# Keys stay inside their prefix


@pytest.mark.parametrize("key", ["../x.json", "eval/../../x", "/etc/passwd", "eval\\x.json", "eval//x.json",
                                 "eval/", "", "./x", "C:/x", "a\x00b", "a/\n/b"])
def test_bad_keys_rejected(key):
    with pytest.raises(ValueError) as err:
        check_key(key)
    assert repr(key) in str(err.value) or "empty" in str(err.value)


@pytest.mark.parametrize("prefix", ["../up", "runs/../../x", "/abs", "a//b", "a\\b", ""])
def test_bad_prefix_rejected(tmp_path, prefix):
    run = make_run(tmp_path)
    with pytest.raises(ValueError, match="prefix"):
        upload_run(run, tmp_path / "store", prefix=prefix)
    assert not (tmp_path / "store").exists()


def test_symlinks_out_of_the_run_dir_rejected(tmp_path):
    run = make_run(tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("not part of the run")
    (run / "plots" / "inner.png").symlink_to(run / "plots" / "reward.png")  # inside: fine, uploaded as a file
    (run / "eval" / "leak.json").symlink_to(outside)
    with pytest.raises(ValueError, match=r"eval/leak.json.*outside the run directory"):
        upload_run(run, tmp_path / "store", prefix="r")
    assert not (tmp_path / "store").exists(), "nothing may be written before the walk is checked"

    (run / "eval" / "leak.json").unlink()
    (run / "eval" / "up").symlink_to(tmp_path)  # a directory link out
    with pytest.raises(ValueError, match=r"eval/up.*outside"):
        upload_run(run, tmp_path / "store", prefix="r")
    (run / "eval" / "up").unlink()
    report = upload_run(run, tmp_path / "store", prefix="r")
    assert (tmp_path / "store/r/plots/inner.png").read_bytes() == RUN_FILES["plots/reward.png"]
    assert "plots/inner.png" in report.uploaded


def test_odd_file_names_and_reads_rejected(tmp_path):
    run = make_run(tmp_path)
    (run / "eval" / "a\\b.json").write_text("{}")
    with pytest.raises(ValueError, match=r"backslash") as err:
        upload_run(run, tmp_path / "store", prefix="r")
    assert "a\\\\b.json" in str(err.value) or "a\\b.json" in str(err.value)

    store = tmp_path / "store2"
    (store / "r").mkdir(parents=True)
    (tmp_path / "secret.json").write_text('{"x": 1}')
    for key in ("../secret.json", "r/../../secret.json", "/etc/hostname"):
        with pytest.raises(ValueError):
            read_json(store.as_uri(), key)
        with pytest.raises(ValueError):
            download(store.as_uri(), key)
    # a link planted inside a file store cannot redirect reads or writes outside it
    (store / "r" / "link").symlink_to(tmp_path)
    with pytest.raises(ValueError, match="outside the store root"):
        read_json(store.as_uri(), "r/link/secret.json")


def test_store_urls(tmp_path):
    assert parse_store_url(str(tmp_path)).url == tmp_path.as_uri()
    assert parse_store_url("s3://bkt/a/b/").base == "a/b"
    for bad in ("file://relative/path", "http://127.0.0.1:9000/bkt", "s3://Bad_Bucket!/x", "s3://bkt/a/../b",
                "s3://bkt/x?endpoint=y"):
        with pytest.raises(ValueError):
            parse_store_url(bad)
    with pytest.raises(ValueError) as err:
        parse_store_url("s3://AKIDPLANTED:SECRETPLANTED@bkt/x")
    assert "PLANTED" not in str(err.value)
    with pytest.raises(ValueError, match="inside the run directory"):
        upload_run(make_run(tmp_path), tmp_path / "run" / "store", prefix="r")


# ----------------------------------------------------------------------------------------------------------
# Secrets and untrusted content


def test_planted_credentials_never_leak(tmp_path, s3_bucket, s3_proxy, monkeypatch, caplog, capsys):
    key_id, secret, token = "AKIAPLANTED7Q2XK9", "planted-secret/KvX8+q1zW0", "planted-token-Jq3Lp0Zr9"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    caplog.set_level(logging.DEBUG)  # botocore logs headers and canonical requests at DEBUG
    run = make_run(tmp_path)
    texts: list[str] = []

    s3_proxy.fail(1, status=503, methods=("PUT",))  # a retry and its warning
    report = upload_run(run, s3_bucket.store_url(), prefix="r", options=FAST, endpoint_url=s3_proxy.url)
    texts += [repr(report), json.dumps(report.to_dict())]
    assert {r.access_key_id for r in s3_proxy.requests} == {key_id}, "the planted credentials were used"

    creds = S3Credentials(key_id, secret, token)
    texts += [repr(creds), str(creds), f"{creds}", repr(Store(s3_bucket.store_url(), credentials=creds,
                                                             endpoint_url=s3_proxy.url))]
    with pytest.raises(TypeError):
        pickle.dumps(creds)

    failures = []
    with pytest.raises(ArtifactStoreError) as e1:  # a permanent error
        upload_run(run, "s3://no-such-bucket-v4rl", prefix="r", credentials=creds, options=FAST,
                   endpoint_url=s3_proxy.url)
    failures.append(e1.value)
    s3_proxy.fail(100, status=500)
    with pytest.raises(TransientStoreError) as e2:  # retries exhausted
        read_json(s3_bucket.store_url(), "r/config.json", credentials=creds, endpoint_url=s3_proxy.url,
                  options=StoreOptions(max_attempts=2, backoff_base=0.01))
    failures.append(e2.value)
    with pytest.raises(ValueError) as e3:  # a malformed Secret block value
        S3Credentials.from_secret_value({"aws_access_key_id": key_id, "secret": secret}, source="block")
    failures.append(e3.value)
    for exc in failures:
        texts += [str(exc), repr(exc), "".join(traceback.format_exception(exc))]

    out = capsys.readouterr()
    texts += [caplog.text, out.out, out.err]
    texts += [p.read_text(errors="replace") for p in run.rglob("*") if p.is_file()]
    blob = "\n".join(texts)
    for planted in (key_id, secret, token):
        assert planted not in blob
    assert "Authorization" in caplog.text and "<redacted>" in caplog.text, \
        "DEBUG request logs were captured and scrubbed (otherwise this test proves nothing)"


def test_store_contents_are_never_unpickled(tmp_path):
    marker = tmp_path / "unpickled"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    payload = pickle.dumps(Evil())
    run = make_run(tmp_path, {"eval/step_000020.json": payload, "checkpoints/iter_0000020/state.pt": payload})
    upload_run(run, tmp_path / "store", prefix="r")
    with pytest.raises(ValueError, match="not UTF-8 JSON"):
        read_json(tmp_path / "store", "r/eval/step_000020.json")
    assert download(tmp_path / "store", "r/checkpoints/iter_0000020/state.pt") == payload
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------------------
# The Prefect task (called as .fn(): no server needed)


def test_upload_task_returns_paths_only(tmp_path):
    from prefect.cache_policies import NO_CACHE

    from tasks.upload import only_transient, upload_artifacts

    run = make_run(tmp_path)
    out = upload_artifacts.fn(str(run), (tmp_path / "store").as_uri(), "runs/r1")
    assert json.loads(json.dumps(out)) == out
    assert out["manifest"] == (tmp_path / "store/runs/r1/manifest.json").as_uri()
    assert set(out["urls"]) == {*RUN_FILES, "manifest.json"}
    assert upload_artifacts.fn(str(run), (tmp_path / "store").as_uri(), "runs/r1")["uploaded"] == []

    assert upload_artifacts.retries >= 1 and upload_artifacts.retry_condition_fn is only_transient
    assert upload_artifacts.cache_policy is NO_CACHE  # every call must upload what changed since the last


def test_retry_condition_only_transient():
    from prefect.states import Completed, Failed

    from tasks.upload import only_transient

    assert only_transient(None, None, Failed(data=TransientStoreError("503 on s3://b/k")))
    assert not only_transient(None, None, Failed(data=ArtifactStoreError("AccessDenied on s3://b/k")))
    assert not only_transient(None, None, Failed(data=ValueError("key '../x' leaves its prefix")))
    assert not only_transient(None, None, Completed(data={"ok": 1}))


def test_upload_task_with_secret_block(tmp_path, s3_bucket, s3_proxy, monkeypatch):
    from prefect.blocks.system import Secret

    from tasks.upload import upload_artifacts

    key_id, secret = "AKIAFROMBLOCK00001", "block-secret-Zx81+pQ"
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    loaded = []

    class FakeSecret:
        def get(self):
            return {"aws_access_key_id": key_id, "aws_secret_access_key": secret}

    monkeypatch.setattr(Secret, "load", classmethod(lambda cls, name, **kw: loaded.append(name) or FakeSecret()))
    out = upload_artifacts.fn(str(make_run(tmp_path)), s3_bucket.store_url("v4rl"), "runs/r1",
                              secret_block="v4rl-s3", endpoint_url=s3_proxy.url)
    assert loaded == ["v4rl-s3"] and {r.access_key_id for r in s3_proxy.requests} == {key_id}
    assert out["manifest"] == f"s3://{s3_bucket.name}/v4rl/runs/r1/manifest.json"
    assert key_id not in json.dumps(out) and secret not in json.dumps(out)


def test_the_run_directory_lock_is_not_an_artifact(tmp_path):
    """The lock a running process holds on its run directory names that process; it is skipped, not uploaded."""
    from engines.artifact_store import walk_run_dir
    from engines.runs.run_lock import hold_run_dir

    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".metadata").write_text("dcp")  # a dot FILE inside a checkpoint is part of it
    with hold_run_dir(tmp_path):
        keys = [f.key for f in walk_run_dir(tmp_path)]
    assert keys == ["ckpt/.metadata", "metrics.jsonl"], keys
