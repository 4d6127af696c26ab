"""End to end through Prefect as a user runs it: a real Prefect server on 127.0.0.1, the work pool and the
deployments from deployments/prefect.yaml, `prefect deployment run`, a process worker; artifacts go to an
S3-compatible server (moto) on 127.0.0.1. Checks: the flow runs end Completed, the expected task runs and
subflow runs exist, the report/progress/eval artifacts exist, and every uploaded object's checksum matches
the run directory's file. The nightly deployment then runs, records its verdict in the store, and (with no
earlier nights) says the pass@1 check needs more history.

    .venv/bin/python -m pytest tests/test_pipeline_e2e.py -q
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

from tests.prefect_server import flow_run_children
from tests.s3_server import TEST_CREDENTIALS

REPO = Path(__file__).resolve().parent.parent


def _prefect(env: dict, *args: str, timeout: float = 600) -> str:
    proc = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"prefect {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _run_deployment(env: dict, name: str, params: dict):
    """`prefect deployment run NAME --param params=...`, then one worker pass; returns the finished flow run."""
    from prefect import get_client

    out = _prefect(env, "deployment", "run", name, "--param", "params=" + json.dumps(params))
    match = re.search(r"UUID:\s*([0-9a-f-]{36})", out)
    assert match, out
    _prefect(env, "worker", "start", "--pool", "v4rl-process", "--run-once", timeout=1500)
    with get_client(sync_client=True) as client:
        return client.read_flow_run(match.group(1))


def _artifact_keys() -> set[str]:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return {a.key for a in client.read_artifacts() if a.key}


def test_pipeline_and_nightly_through_deployments(prefect_server, s3_bucket, tmp_path):  # noqa: F811
    env = {**prefect_server["env"], **TEST_CREDENTIALS, "PROJECT_ROOT": str(REPO)}
    _prefect(env, "work-pool", "create", "v4rl-process", "--type", "process", "--overwrite")
    _prefect(env, "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "--all")
    store = s3_bucket.store_url("v4rl")
    small = dict(runs_root=str(tmp_path / "runs"), steps=2, eval_interval=2, prompts_per_step=4, n_samples=4,
                 n_eval=8, eval_samples=4, align_prompts=2, store_url=store, s3_endpoint_url=s3_bucket.endpoint_url)

    run = _run_deployment(env, "rl-pipeline/tiny-cpu", {**small, "preset": "tiny-cpu", "run_key": "e2e"})
    assert run.state.is_completed(), run.state
    tasks, subflows = flow_run_children(
        run.id, expect=("preflight", "convert", "verify", "train", "upload-artifacts", "report"))
    names = {t.name.rsplit("-", 1)[0] for t in tasks}
    assert {"preflight", "convert", "verify", "train", "upload-artifacts", "report"} <= names, names
    assert sum(t.name.rsplit("-", 1)[0] == "train" for t in tasks) == 1  # one training task for the run
    assert sum(f.flow_id is not None for f in subflows) >= 2  # evaluate at step 0 and step 2, as they land
    assert all(f.state.is_completed() for f in subflows)
    keys = _artifact_keys()
    assert {"e2e-report", "e2e-training", "e2e-eval"} <= keys, keys

    run_dir = tmp_path / "runs" / "e2e"
    uploaded = set(s3_bucket.keys("v4rl/runs/e2e/"))
    for rel in ("metrics.jsonl", "report.md", "plots/reward.png", "eval/step_000002.json", "manifest.json"):
        assert f"v4rl/runs/e2e/{rel}" in uploaded, rel
    manifest = json.loads(s3_bucket.client.get_object(Bucket=s3_bucket.name, Key="v4rl/runs/e2e/manifest.json")
                          ["Body"].read())
    files = manifest["files"] if "files" in manifest else manifest
    for rel, entry in files.items():
        body = s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=f"v4rl/runs/e2e/{rel}")["Body"].read()
        assert hashlib.sha256(body).hexdigest() == entry["sha256"] == hashlib.sha256(
            (run_dir / rel).read_bytes()).hexdigest(), rel

    night = _run_deployment(env, "nightly-validation/nightly",
                            {k: small[k] for k in ("runs_root", "steps", "eval_interval", "prompts_per_step", "n_eval",
                                                   "store_url", "s3_endpoint_url")})
    assert night.state.is_completed(), night.state
    records = [k for k in s3_bucket.keys("v4rl/runs/") if k.endswith("/nightly.json")]
    assert len(records) == 1
    record = json.loads(s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=records[0])["Body"].read())
    assert record["verdict"]["checks"]["pass@1"]["status"] == "insufficient_history"
