"""Runs INSIDE a subprocess with Miles' tree and SGLang 0.5.23 on sys.path: Miles' own rollout client
(`miles/rollout/sglang_rollout.py` `GenerateState.submit_generate_tasks` + `abort`, and
`generate_utils/prefill_logprobs.py`) against a running `v4rl` rollout server. Nothing here is Miles' code; it
imports and calls it, unmodified, and writes what Miles returned to OUT_JSON.

  abort    Miles submits GROUPS groups of N samples (`generate_and_rm_group` tasks, `--partial-rollout`), waits
           until the engine runs them, then calls its `abort(args, rollout_id=7)`: Miles lists the workers at
           its router (`/list_workers`, `--use-miles-router`), posts `/abort_request {"abort_all": true}` to
           each, and collects the partial groups.
  prefill  Miles' `recompute_samples_rollout_logprobs_via_prefill` (batched: one `/generate` with a list of
           `input_ids`, `max_new_tokens: 0`, `logprob_start_len = prompt_len - 1`) and the single-sample
           `recompute_rollout_logprobs_via_prefill` over samples the engine generated; both results are written.

Miles reaches its engines through a router (`http://{sglang_router_ip}:{sglang_router_port}`); the router is not
what is under test, so a forwarder on 127.0.0.1 stands in for it: `/list_workers` names the engine, every other
path is forwarded to the engine unchanged.

    python -c ... miles_rollout_harness.py abort|prefill ENGINE_URL HF_DIR OUT_JSON
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from argparse import Namespace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from miles.rollout import sglang_rollout
from miles.rollout.generate_utils import prefill_logprobs
from miles.utils import http_utils
from miles.utils.types import Sample

MAX_NEW_TOKENS = 3000  # long enough that every sample is still decoding when Miles aborts


def start_router(engine_url: str) -> ThreadingHTTPServer:
    """A forwarder in the router's place: Miles asks it for its workers, and sends it /generate."""

    class Forward(BaseHTTPRequestHandler):
        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/list_workers":
                return self._answer(200, json.dumps({"urls": [engine_url]}).encode())
            answer = httpx.get(engine_url + self.path, timeout=600)
            self._answer(answer.status_code, answer.content)

        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            answer = httpx.post(engine_url + self.path, content=body, timeout=600,
                                headers={"Content-Type": "application/json"})
            self._answer(answer.status_code, answer.content)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def miles_args(hf_dir: str, router: ThreadingHTTPServer) -> Namespace:
    """The fields of Miles' parsed args that this path reads, at Miles' defaults except those named."""
    return Namespace(
        hf_checkpoint=hf_dir, chat_template_path=None, sglang_server_concurrency=8, rollout_num_gpus=1,
        rollout_num_gpus_per_engine=1, rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=-1,
        rollout_max_response_len=MAX_NEW_TOKENS, rollout_stop=None, rollout_stop_token_ids=None,
        rollout_skip_special_tokens=False, sglang_dp_size=1, n_samples_per_prompt=2,
        sglang_router_ip="127.0.0.1", sglang_router_port=router.server_address[1], use_miles_router=True,
        partial_rollout=True, mask_offpolicy_in_partial_rollout=False, group_rm=True, ci_test=False,
        custom_generate_function_path=None, use_rollout_routing_replay=False, use_rollout_indexer_replay=False,
        lora_rank=0, lora_adapter_path=None, multi_lora_n_adapters=0, sglang_router_policy=None,
        recompute_logprobs_via_prefill=True, agent_abort_hook_path=None, eval_num_gpus=0,
        use_distributed_post=False, sglang_speculative_algorithm=None)


async def run_abort(args: Namespace, engine_url: str, groups: int) -> dict:
    state = sglang_rollout.GenerateState(args)
    # Miles' payload exactly, plus SGLang's ignore_eos: the tiny model's EOS would end samples before the abort
    state.sampling_params["ignore_eos"] = True
    prompts = [f"{a} + {b} =" for a, b in zip(range(3, 3 + groups), range(11, 11 + groups))]
    state.submit_generate_tasks([[Sample(prompt=p, index=g * 2 + i, group_index=g) for i in range(2)]
                                 for g, p in enumerate(prompts)])
    deadline = time.monotonic() + 300
    async with httpx.AsyncClient(timeout=30) as client:
        while True:  # abort only once the engine is decoding every sample
            status = (await client.get(f"{engine_url}/get_server_info")).json()["internal_states"][0]
            if status["num_running_reqs"] == 2 * groups:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine never ran all {2 * groups} samples: {status}")
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # some decode steps, so the partial samples carry tokens
        aborted = await sglang_rollout.abort(args, rollout_id=7)
        after = (await client.get(f"{engine_url}/get_server_info")).json()["internal_states"][0]
    return {"groups": [[{"status": s.status.value, "tokens": s.tokens, "response_length": s.response_length,
                         "rollout_log_probs": s.rollout_log_probs, "response": s.response,
                         "start_rollout_id": s.metadata.get("start_rollout_id"), "index": s.index}
                        for s in group] for group in aborted],
            "pendings_left": len(state.pendings), "aborted_flag": state.aborted,
            "engine_after": {k: after[k] for k in ("num_running_reqs", "num_waiting_reqs")}}


async def run_prefill(args: Namespace, engine_url: str, generated: list[dict]) -> dict:
    samples = []
    for g in generated:
        s = Sample(tokens=g["input_ids"] + g["output_ids"], response_length=len(g["output_ids"]),
                   status=Sample.Status.COMPLETED)
        samples.append(s)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    params = dict(sglang_rollout.GenerateState(args).sampling_params)
    await prefill_logprobs.recompute_samples_rollout_logprobs_via_prefill(args, samples, url=url,
                                                                          sampling_params=params)
    batched = [list(s.rollout_log_probs) for s in samples]
    sources = [s.metadata.get("rollout_log_probs_source") for s in samples]
    for s in samples:
        s.rollout_log_probs = None
        await prefill_logprobs.recompute_rollout_logprobs_via_prefill(args, s, url=url, sampling_params=params)
    return {"batched": batched, "single": [s.rollout_log_probs for s in samples], "sources": sources}


def main(mode: str, engine_url: str, hf_dir: str, out_json: str, extra: str = "") -> None:
    router = start_router(engine_url)
    args = miles_args(hf_dir, router)
    http_utils.init_http_client(args)  # what Miles' rollout manager does before any rollout
    try:
        if mode == "abort":
            result = asyncio.run(run_abort(args, engine_url, int(extra or 2)))
        elif mode == "prefill":
            result = asyncio.run(run_prefill(args, engine_url, json.loads(Path(extra).read_text())))
        else:
            raise SystemExit(f"mode must be abort or prefill; got {mode!r}")
    finally:
        router.shutdown()
    tmp = Path(out_json + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(out_json)


if __name__ == "__main__":
    main(*sys.argv[1:])
