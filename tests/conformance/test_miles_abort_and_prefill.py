"""Miles' own abort and prefill-logprob recompute against `v4rl`'s rollout server, both vendored generations (#27).

- `sglang_rollout.abort` (Miles' `--partial-rollout` abort): with groups of samples decoding on the engine,
  Miles' abort posts `/abort_request {"abort_all": true}` to the workers its router lists and collects the
  groups; every sample comes back ABORTED with its partial response (tokens, logprobs, `start_rollout_id`),
  and the engine runs and queues nothing afterwards.
- `generate_utils/prefill_logprobs.py` (`--recompute-logprobs-via-prefill`), batched and per sample: the
  logprobs Miles recomputes by a prefill of prompt + response equal the engine's own decode-time
  `output_token_logprobs` of the same tokens within PREFILL_TOLERANCE.

How Miles is run: miles_rollout_harness.py (a forwarder stands in for Miles' router).

    .venv/bin/python -m pytest tests/conformance/test_miles_abort_and_prefill.py -q
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from engines.rollout.engine import RolloutEngine
from engines.rollout.server import RolloutServer
from engines.upstream.sources import engine_python
from engines.upstream.stubs import GPU_ONLY_ROOTS

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
GENERATIONS = ["miles_tree", "miles_gen2_tree"]
# Miles main imports `encoding_dsv4` from its own SGLang branch; upstream 0.5.23 lacks it (never called here)
STUB_ROOTS = (*GPU_ONLY_ROOTS, "sglang.srt.entrypoints.openai.encoding_dsv4")
# float32 decode vs float32 prefill of the same tokens: different kernels (batched prefill attention, decode
# steps) sum in different orders; measured max |diff| 7.2e-7 here (both generations), 2.4e-7 in reference part D
PREFILL_TOLERANCE = 1e-5


def run_harness(miles: Path, sglang_paths, mode: str, url: str, hf_dir: Path, out: Path, extra: str) -> dict:
    code = (f"import runpy, sys; sys.argv = ['h', *sys.argv[1:]]; "
            f"runpy.run_path({str(HERE / 'miles_rollout_harness.py')!r}, run_name='__main__')")
    engine_python(code, [REPO, miles, *sglang_paths], args=[mode, url, str(hf_dir), str(out), extra], stub_roots=STUB_ROOTS,
                  env={"PYTHONPATH": os.pathsep.join([str(REPO), str(miles)])}, cwd=miles, timeout=600)
    return json.loads(out.read_text())


@pytest.mark.parametrize("generation", GENERATIONS)
def test_miles_abort_returns_partial_samples(generation, request, sglang_paths, tiny_base, tmp_path):
    miles = request.getfixturevalue(generation)
    with RolloutServer(RolloutEngine(tiny_base)) as server:
        result = run_harness(miles, sglang_paths, "abort", server.url, tiny_base, tmp_path / "abort.json", "2")
        status = server.engine.status()
    samples = [s for group in result["groups"] for s in group]
    assert len(result["groups"]) == 2 and len(samples) == 4, result
    assert {s["index"] for s in samples} == {0, 1, 2, 3}
    for s in samples:
        assert s["status"] == "aborted", s
        assert 0 < s["response_length"] < 3000, s  # partial: decoding had started and was stopped
        assert len(s["rollout_log_probs"]) == s["response_length"]
        assert s["start_rollout_id"] == 7  # Miles marks partial samples for the data buffer
        assert s["response"]
    assert result["pendings_left"] == 0 and result["aborted_flag"] is True
    assert result["engine_after"] == {"num_running_reqs": 0, "num_waiting_reqs": 0}
    assert status["num_running_reqs"] == 0 and status["num_waiting_reqs"] == 0


@pytest.mark.parametrize("generation", GENERATIONS)
def test_miles_prefill_recompute_equals_engine_logprobs(generation, request, sglang_paths, tiny_base, tmp_path):
    miles = request.getfixturevalue(generation)
    prompts = [[1, 40, 41, 42, 43], [1, 50, 51, 52, 53], [1, 60, 61, 62, 63]]  # one length: Miles batches them
    with RolloutServer(RolloutEngine(tiny_base)) as server:
        body = {"input_ids": prompts, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 5,
                                    "ignore_eos": True}}
        answers = httpx.post(f"{server.url}/generate", json=body, timeout=120).json()
        generated = [{"input_ids": p, "output_ids": a["output_ids"],
                      "logprobs": [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]}
                     for p, a in zip(prompts, answers)]
        (tmp_path / "generated.json").write_text(json.dumps(generated))
        result = run_harness(miles, sglang_paths, "prefill", server.url, tiny_base, tmp_path / "prefill.json",
                             str(tmp_path / "generated.json"))
    assert result["sources"] == ["sglang_prefill_recompute"] * 3
    worst = 0.0
    for g, batched, single in zip(generated, result["batched"], result["single"]):
        assert len(batched) == len(single) == len(g["output_ids"]) == 10
        worst = max(worst, *(abs(a - b) for a, b in zip(batched + single, g["logprobs"] * 2)))
    print(f"Miles' prefill recompute vs the engine's decode logprobs: max |diff| {worst:.3g}")
    assert worst <= PREFILL_TOLERANCE
