"""(b) SGLang 0.5.23's own clients against v4rl's live rollout server (127.0.0.1, tiny-cpu checkpoint).

  - an `sgl.function` program through `RuntimeEndpoint`: `sgl.gen` (which always sends `stop_regex: []`, the
    request v4rl's server used to refuse) and `sgl.select` (prompt scoring with text in the logprobs);
  - `sglang.test.send_one.send_one_prompt`, SGLang's one-prompt smoke client, plain and with `--stream`;
  - `sglang.test.kl_test_utils`: decode logprobs against prefill rescoring of the same tokens, plain and after
    a prefill cache hit, under SGLang's own KL estimate and a bound of KL_BOUND (our engine is exact in fp32).
The decode-cache-hit variant is not run: v4rl's prefix cache matches whole sequences, not radix prefixes.

    .venv/bin/python -m pytest tests/conformance/test_sglang_clients_on_v4rl.py -q
"""

from __future__ import annotations

import re

import pytest

from engines.rollout.engine import RolloutEngine
from engines.rollout.server import RolloutServer
from engines.rollout.sglang import SGLangClient

KL_BOUND = 1e-6
"""Mean k3 KL between decode and rescoring logprobs SGLang's helper must see (fp32: ~3e-14 measured)."""
PROMPT = "Compute 12+34. Answer in \\boxed{}."


@pytest.fixture(scope="module")
def v4rl_url(tiny_checkpoint):
    with RolloutServer(RolloutEngine(tiny_checkpoint)) as server:
        yield server.url


def test_sgl_function_with_gen_and_select(v4rl_url, sglang_worker, tiny_checkpoint):
    choices = ["yes", "no"]
    out = sglang_worker.call("run_program", url=v4rl_url, prompt=PROMPT, choices=choices, timeout=300)
    assert out["error"] is None
    assert out["verdict"] in choices and out["model_path"] == str(tiny_checkpoint)
    meta = out["meta"]
    assert meta["finish_reason"]["type"] in ("length", "stop") and meta["completion_tokens"] >= 1
    with SGLangClient(v4rl_url) as ours:  # the same greedy continuation as v4rl's own client gets
        again = ours.generate({"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert out["answer"] == again["text"]


def test_send_one_prompt(v4rl_url, sglang_worker):
    out = sglang_worker.call("send_one", url=v4rl_url, prompt=PROMPT, timeout=300)
    assert out["acc_length"] == 1.0 and out["speed"] > 0  # it returns (0, 0) on any non-200 answer
    with SGLangClient(v4rl_url) as ours:  # its request: greedy, 8 new tokens at most (EOS may end it sooner)
        tokens = ours.generate({"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    n = tokens["meta_info"]["completion_tokens"]
    assert re.search(rf"\|\s*[\d.]+\s*\|\s*{n}\s*\|", out["printed"]), out["printed"]  # latency, tokens


def test_send_one_prompt_streamed(v4rl_url, sglang_worker):
    """`send_one --stream` parses v4rl's server-sent events as SGLang's: it prints each chunk's new text (the
    cumulative text past what it printed), and reads the last chunk's meta_info (it crashed on the refusal)."""
    out = sglang_worker.call("send_one", url=v4rl_url, prompt=PROMPT, stream=True, timeout=300)
    assert out["acc_length"] == 1.0 and out["speed"] > 0
    with SGLangClient(v4rl_url) as ours:
        whole = ours.generate({"text": PROMPT, "return_logprob": True,
                               "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert out["printed"].startswith(whole["text"])  # the streamed pieces join into the unstreamed text
    n = whole["meta_info"]["completion_tokens"]
    assert re.search(rf"\|\s*[\d.]+\s*\|\s*{n}\s*\|", out["printed"]), out["printed"]


def test_kl_logprob_checks(v4rl_url, sglang_worker, tmp_path, tiny_checkpoint):
    engine_tokens = [[0] + [5 + (11 * i + 7 * k) % 90 for k in range(20 + i)] for i in range(6)]
    out = sglang_worker.call("kl_check", url=v4rl_url, cache_home=str(tmp_path), prompts=engine_tokens,
                             model_name="v4rl-tiny", kl_bound=KL_BOUND, max_new_tokens=12, timeout=600)
    kls = [float(x) for x in re.findall(r"avg_kl_div=([0-9.eE+-]+)", out["printed"])]
    assert len(kls) == 2 and all(k < KL_BOUND for k in kls), out["printed"]
    assert "cache miss" not in out["printed"]  # every prompt was served from the prefix cache the second time


def test_sglang_router_admits_v4rl_as_a_healthy_worker(v4rl_url, sglang_paths, tmp_path):
    """sglang-router (the Rust router Miles launches) with v4rl's engine in --worker-urls: its add-worker workflow
    (HTTP /health, then /get_server_info + /get_model_info metadata) marks it healthy and /generate is routed."""
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    router = f"http://127.0.0.1:{ports[0]}"
    log = (tmp_path / "router.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                             str(ports[0]), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(ports[1]),
                             "--worker-urls", v4rl_url], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(map(str, sglang_paths))},
                            start_new_session=True)
    try:
        workers, deadline = [], time.monotonic() + 90
        while time.monotonic() < deadline and not any(w.get("is_healthy") for w in workers):
            time.sleep(1)
            try:
                with urllib.request.urlopen(f"{router}/workers", timeout=5) as r:
                    workers = json.load(r)["workers"]
            except OSError:
                continue
        assert [w["url"] for w in workers if w["is_healthy"]] == [v4rl_url], (tmp_path / "router.log").read_text()
        assert workers[0]["connection_mode"] == "HTTP" and workers[0]["metadata"]["model_type"] == "deepseek_v4"
        body = json.dumps({"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).encode()
        req = urllib.request.Request(f"{router}/generate", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.load(r)
        assert out["meta_info"]["completion_tokens"] >= 1
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)
        log.close()
