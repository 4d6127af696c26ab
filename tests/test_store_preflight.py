"""Preflight checks that the artifact store takes the run's uploads, by writing and deleting a probe object, before
any engine starts (issue 40: an s3:// store without credentials was found at the first upload, after the whole
training). Against the session's S3-compatible server (moto on 127.0.0.1) and a real Prefect flow run: missing
credentials, a bucket that does not exist, an endpoint that does not answer and a file:// store that cannot be
created each fail in one line naming the store and the fix; a good store passes and keeps no probe object.

    .venv/bin/python -m pytest tests/test_store_preflight.py -q
"""

from __future__ import annotations

import pytest

from engines.artifact_store import ArtifactStoreError, StoreOptions, check_store
from tests.prefect_server import flow_run_children, free_port

ONE_TRY = StoreOptions(max_attempts=1, connect_timeout=2, read_timeout=5)


def _refused(store_url: str, **kwargs) -> str:
    with pytest.raises(ArtifactStoreError) as err:
        check_store(store_url, "runs/r1", **kwargs)
    message = str(err.value)
    assert message.startswith(f"artifact store {store_url} is not writable: ") and "\n" not in message, message
    return message


def test_a_good_s3_store_passes_and_keeps_no_probe(s3_bucket):
    assert check_store(s3_bucket.store_url("v4rl"), "runs/r1", endpoint_url=s3_bucket.endpoint_url) is None
    assert s3_bucket.keys() == []


def test_s3_store_mistakes_fail_in_one_line_naming_the_fix(s3_bucket, monkeypatch):
    url, endpoint = s3_bucket.store_url("v4rl"), s3_bucket.endpoint_url
    message = _refused(f"s3://{s3_bucket.name}-missing/v4rl", endpoint_url=endpoint)
    assert "NoSuchBucket" in message and f"create the bucket '{s3_bucket.name}-missing'" in message
    message = _refused(url, endpoint_url=f"http://127.0.0.1:{free_port()}", options=ONE_TRY)
    assert "check s3_endpoint_url" in message
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    message = _refused(url, endpoint_url=endpoint)
    assert "no S3 credentials" in message and "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in message
    assert s3_bucket.keys() == []


def test_a_file_store_is_created_and_left_as_it_was(tmp_path):
    store = tmp_path / "new" / "store"
    assert check_store(store.as_uri(), "runs/r1") is None
    assert not (tmp_path / "new").exists()  # the probe's directories are gone again
    (tmp_path / "afile").write_text("a file where the store's directory belongs")
    message = _refused((tmp_path / "afile" / "store").as_uri())
    assert "Not a directory" in message and "give store_url a directory this user can create and write" in message


def test_a_bad_store_fails_the_flow_in_preflight_before_any_engine(prefect_server, s3_bucket, tmp_path):  # noqa: F811
    from flows.rl_pipeline import rl_pipeline

    runs = tmp_path / "runs"
    state = rl_pipeline(params=dict(runs_root=str(runs), run_key="no-bucket", steps=1, eval_interval=1,
                                    prompts_per_step=1, n_eval=1, eval_samples=1, align_prompts=1, use_ray=False,
                                    store_url=f"s3://{s3_bucket.name}-missing/v4rl",
                                    s3_endpoint_url=s3_bucket.endpoint_url), return_state=True)
    assert state.is_failed(), state
    message = str(state.result(raise_on_failure=False))
    assert f"artifact store s3://{s3_bucket.name}-missing/v4rl is not writable" in message, message
    assert f"create the bucket '{s3_bucket.name}-missing'" in message
    tasks, _ = flow_run_children(state.state_details.flow_run_id, expect=("preflight",))
    assert [t.name.rsplit("-", 1)[0] for t in tasks] == ["preflight"], [t.name for t in tasks]
    assert not (runs / "no-bucket" / "torch_dist").exists() and not (runs / "no-bucket" / "metrics.jsonl").exists()
