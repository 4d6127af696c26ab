"""One long-lived subprocess with SGLang's source on sys.path (GPU-only modules stubbed), driven over pipes.

Importing SGLang's server modules takes about a minute on this machine, so the suite pays it once: the
worker imports `sglang_harness` (which imports SGLang) and then answers calls, one JSON line each way
(`call(name, **kwargs)` runs `sglang_harness.<name>(**kwargs)` there). SGLang's own logging stays on the
worker's stderr, kept in a file whose tail is attached to any failure. `close()` ends the process by its PID.

    worker = SGLangWorker(sglang_paths, tmp_dir)
    url = worker.call("start_app", workdir=str(tmp_dir), api_key="k")["url"]
    worker.close()
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
from pathlib import Path
from typing import Any

from engines.upstream.sources import engine_command

HERE = Path(__file__).resolve().parent
MARK = "V4RL-WORKER "
LOOP = f"""
import json, sys, traceback
sys.path.insert(0, {str(HERE)!r})
import sglang_harness as harness
out = sys.stdout
sys.stdout = sys.stderr  # SGLang's prints must not mix with the answers
out.write({MARK!r} + json.dumps({{"ready": True}}) + "\\n"); out.flush()
for line in sys.stdin:
    call = json.loads(line)
    try:
        answer = {{"result": getattr(harness, call["name"])(**call["kwargs"])}}
    except BaseException:
        answer = {{"error": traceback.format_exc()}}
    out.write({MARK!r} + json.dumps(answer, default=repr) + "\\n"); out.flush()
"""


class WorkerError(RuntimeError):
    """A call failed inside the SGLang worker; the message holds its traceback and the worker's stderr tail."""


class SGLangWorker:
    def __init__(self, paths: list[Path], workdir: Path, *, start_timeout: float = 900.0) -> None:
        cmd, env = engine_command(LOOP, paths, env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                                    "SGLANG_HEALTH_CHECK_TIMEOUT": "20"})
        self.log = workdir / "sglang-worker.log"
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, cwd=workdir)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._answer(start_timeout, "start (importing SGLang)")

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._lines.put(line[len(MARK):])
        self._lines.put(None)

    def _answer(self, timeout: float, what: str) -> Any:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise WorkerError(f"the SGLang worker did not answer {what} within {timeout:.0f} s\n"
                              f"{self.tail()}") from None
        if line is None:
            raise WorkerError(f"the SGLang worker exited ({self.proc.poll()}) during {what}\n{self.tail()}")
        answer = json.loads(line)
        if "error" in answer:
            raise WorkerError(f"{what} failed in the SGLang worker:\n{answer['error']}")
        return answer.get("result")

    def call(self, name: str, *, timeout: float = 300.0, **kwargs: Any) -> Any:
        self.proc.stdin.write(json.dumps({"name": name, "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout, name)

    def tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()
