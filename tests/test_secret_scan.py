"""Secrets never leave the process that needs them (issue 8): plant distinctive S3 credentials and a rollout API
key through the supported configuration paths, run the smallest end-to-end rl-pipeline (a real Prefect server
and an S3-compatible server on 127.0.0.1), in-process and on a local Ray cluster, then search every output of the
run for them:

  - the run directory tree (every file, as bytes: checkpoints, plots, JSON, markdown, logs);
  - every object in the artifact store (bodies and user metadata) and every key;
  - what the run printed (stdout/stderr at the file-descriptor level) and every log record (root at DEBUG,
    so botocore's request dumps are included);
  - the Prefect API: flow-run and task-run records (parameters, states, messages), artifacts, logs, events,
    variables, block documents other than the Secret block itself; and the Prefect server's and this process's
    PREFECT_HOME on disk (the server database, persisted task results);
  - the report (report.md, summary.json, the report artifact);
  - on Ray: the cluster's session directory (every log, the workers' stdout/stderr, runtime-env files).

Configuration paths: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment, the S3 secret in a Prefect
Secret block named by `s3_secret_block` (key id from the environment: the documented string form), and
V4RL_ROLLOUT_API_KEY for the rollout servers. Non-vacuity: the S3 requests were signed with the planted key id
(seen by the proxy), every in-process rollout server was started with the planted API key and the training run's
server refused a request without it (the run checks this itself), the scan read many files and objects, and the
run key (a non-secret marker) IS found in each kind of output.

    .venv/bin/python -m pytest tests/test_secret_scan.py -q        (~45 s on 2 cores)
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import pytest


ACCESS_KEY_ID = "AKIAV4RLSCANPLANTED7Q"
ENV_SECRET = "v4rl+ENV/secret-9zQx2LmN4pRt6VwY8bCd"
BLOCK_SECRET = "v4rl+BLOCK/secret-3kJh5GfD7sAq1WeR0tYu"
ROLLOUT_KEY = "v4rl-rollout-key-P8nM6bV4cX2zL0kJ"
SECRETS = {"S3 access key id": ACCESS_KEY_ID, "S3 secret (env)": ENV_SECRET, "S3 secret (Secret block)": BLOCK_SECRET,
           "rollout API key": ROLLOUT_KEY}
RAY_TEMP = Path(tempfile.gettempdir()) / "ray"  # ray.init's default _temp_dir
MARKER = "scanmarker-7f3a"  # the run key: not a secret, must show up everywhere
BLOCK_NAME = "v4rl-scan-s3"


@dataclass
class Scan:
    """Searches blobs for every secret (raw and URL-encoded) and for the marker; remembers where."""

    leaks: list[str] = field(default_factory=list)
    seen: dict[str, int] = field(default_factory=dict)
    marker_in: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, where: str, data: bytes | str) -> None:
        blob = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data
        self.seen[kind] = self.seen.get(kind, 0) + 1
        for name, secret in SECRETS.items():
            for form in {secret, quote(secret, safe="")}:
                if form.encode() in blob:
                    at = blob.index(form.encode())
                    self.leaks.append(f"{name} in {kind} {where}: ...{blob[max(0, at - 80):at + 80]!r}...")
        if MARKER.encode() in blob:
            self.marker_in[kind] = self.marker_in.get(kind, 0) + 1

    def add_tree(self, kind: str, root: Path) -> None:
        for path in sorted(p for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink()):
            try:
                self.add(kind, str(path), path.read_bytes())
            except OSError:  # a file removed while we walked (a server's journal)
                continue


def test_scanner_finds_what_it_looks_for():
    scan = Scan()
    scan.add("probe", "x", f"before {quote(BLOCK_SECRET, safe='')} after {MARKER}".encode())
    assert len(scan.leaks) == 1 and "S3 secret (Secret block)" in scan.leaks[0] and scan.marker_in == {"probe": 1}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _every_log_record() -> Iterator[list[logging.LogRecord]]:
    """Every record of every logger at DEBUG (botocore's request dumps included), and Prefect's run loggers at
    INFO so that the run's own messages reach the API too. Prefect replaces root handlers when it configures
    logging, so pytest's caplog sees nothing here: a handler of our own on the root logger."""
    handler, root = _Records(), logging.getLogger()
    names = ("prefect", "prefect.flow_runs", "prefect.task_runs")
    saved = (root.level, {n: logging.getLogger(n).level for n in names})
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    for n in names:
        logging.getLogger(n).setLevel(logging.INFO)
    try:
        yield handler.records
    finally:
        root.removeHandler(handler)
        root.setLevel(saved[0])
        for n, level in saved[1].items():
            logging.getLogger(n).setLevel(level)


def _all_pages(read, **kwargs) -> list:
    out, offset = [], 0
    while True:
        page = read(limit=200, offset=offset, **kwargs)
        out += page
        if len(page) < 200:
            return out
        offset += 200


def _scan_prefect_api(scan: Scan) -> None:
    from prefect import get_client
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)
    EventsWorker.drain_all()
    with get_client(sync_client=True) as client:
        # The server records task runs from events in a background service, which lags on a busy machine.
        deadline = time.monotonic() + 30
        while not client.read_task_runs(limit=1) and time.monotonic() < deadline:
            time.sleep(1.0)
        for run in _all_pages(client.read_flow_runs):
            scan.add("prefect flow run", str(run.id), run.model_dump_json())
        for run in _all_pages(client.read_task_runs):
            scan.add("prefect task run", str(run.id), run.model_dump_json())
        for artifact in _all_pages(client.read_artifacts):
            scan.add("prefect artifact", str(artifact.key or artifact.id), artifact.model_dump_json())
        for record in _all_pages(client.read_logs):
            scan.add("prefect log", str(record.id), record.model_dump_json())
        page = client.read_events(limit=50)
        while page is not None:
            for event in page.events:
                scan.add("prefect event", str(event.id), event.model_dump_json())
            page = client.read_events_page(page.next_page) if page.next_page else None
        for variable in client.read_variables():
            scan.add("prefect variable", variable.name, variable.model_dump_json())
        for doc in client.read_block_documents(include_secrets=True):
            if doc.name != BLOCK_NAME:  # the Secret block is where the secret is meant to live
                scan.add("prefect block", str(doc.name), doc.model_dump_json())


def _scan_store(scan: Scan, bucket) -> None:
    for key in bucket.keys():
        obj = bucket.client.get_object(Bucket=bucket.name, Key=key)
        scan.add("store object", key, key.encode() + repr(obj["Metadata"]).encode() + obj["Body"].read())


@pytest.mark.parametrize("use_ray", [False, True], ids=["in-process", "ray"])
def test_planted_secrets_appear_in_no_output_of_a_pipeline_run(prefect_server, s3_bucket, s3_proxy,  # noqa: F811
                                                               tmp_path, monkeypatch, capfd, use_ray):
    import prefect.settings
    from prefect.blocks.system import Secret
    from prefect.logging.configuration import setup_logging

    import engines.rollout.server as rollout_server
    from flows.params import PipelineParams
    from flows.rl_pipeline import rl_pipeline

    # Prefect's console handler keeps the stderr it was built with; an earlier test's capfd file is closed by now
    setup_logging(incremental=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ENV_SECRET)
    monkeypatch.setenv("V4RL_ROLLOUT_API_KEY", ROLLOUT_KEY)
    Secret(value=BLOCK_SECRET).save(BLOCK_NAME, overwrite=True)
    served_keys: list[str | None] = []
    create_app = rollout_server.create_app
    monkeypatch.setattr(rollout_server, "create_app",
                        lambda engine, *, api_key=None, **kw: served_keys.append(api_key) or create_app(
                            engine, api_key=api_key, **kw))

    params = PipelineParams.preset_defaults(
        "tiny-cpu", run_key=MARKER, runs_root=str(tmp_path / "runs"), steps=1, eval_interval=1, prompts_per_step=4,
        n_samples=4, n_eval=8, eval_samples=4, align_prompts=2, use_ray=use_ray, store_url=s3_bucket.store_url("v4rl"),
        s3_endpoint_url=s3_proxy.url, s3_secret_block=BLOCK_NAME)
    ray_sessions_before = set(RAY_TEMP.glob("session_2*"))
    with _every_log_record() as records:
        state = rl_pipeline(params, return_state=True)
    assert state.is_completed(), state

    # the planted values really were used: requests signed with the key id, every rollout server keyed
    signed = {r.access_key_id for r in s3_proxy.requests if r.access_key_id}
    assert signed == {ACCESS_KEY_ID}, signed
    # in-process: the training task's server, which also serves its evaluations; on Ray that server lives in an
    # actor process, so the run's own probe (a request without the key must be refused) is what shows it was keyed
    assert set(served_keys) == (set() if use_ray else {ROLLOUT_KEY}), served_keys
    assert any("refuses requests without the API key" in r.getMessage() for r in records)

    scan = Scan()
    scan.add_tree("run directory", tmp_path / "runs" / MARKER)
    _scan_store(scan, s3_bucket)
    out, err = capfd.readouterr()
    scan.add("captured output", "stdout", out)
    scan.add("captured output", "stderr", err)
    for record in records:
        scan.add("log record", record.name, f"{record.getMessage()} {record.args!r} {record.exc_text or ''}")
    _scan_prefect_api(scan)
    scan.add_tree("prefect server home", prefect_server["home"])
    if use_ray:  # the local cluster's session: its logs, the workers' stdout/stderr, runtime env files
        new_sessions = set(RAY_TEMP.glob("session_2*")) - ray_sessions_before
        assert new_sessions, f"no new Ray session under {RAY_TEMP}"
        for session in new_sessions:
            scan.add_tree("ray session", session)
    local_home = Path(prefect.settings.get_current_settings().home)
    if local_home.exists() and local_home != prefect_server["home"]:
        scan.add_tree("prefect home of this process", local_home)

    assert not scan.leaks, "secrets leaked:\n" + "\n".join(scan.leaks[:20])
    assert scan.seen["run directory"] > 20 and scan.seen["store object"] > 20, scan.seen
    if use_ray:
        assert scan.seen["ray session"] > 10 and scan.marker_in.get("ray session"), (scan.seen, scan.marker_in)
    # (after other in-process flow runs in the same pytest session the server may hold only the subflow task
    # runs of this one: how many task runs there are is Prefect's business, scanning all of them is ours)
    assert scan.seen["prefect log"] > 10 and scan.seen["prefect task run"] >= 1, scan.seen
    assert scan.seen["log record"] > 50, scan.seen  # DEBUG: includes botocore's request dumps
    assert any(r.name.startswith("botocore") for r in records)
    for kind in ("run directory", "store object", "prefect flow run", "prefect artifact", "prefect log",
                 "prefect server home", "log record"):
        assert scan.marker_in.get(kind), f"the run key {MARKER} was not found in any {kind}: {scan.marker_in}"
    report = (tmp_path / "runs" / MARKER / "report.md").read_text()
    assert MARKER in report and not any(s in report for s in SECRETS.values())
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == ENV_SECRET  # still planted at the end: nothing unset it
