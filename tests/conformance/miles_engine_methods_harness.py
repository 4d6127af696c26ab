"""Runs INSIDE a subprocess with Miles' tree and SGLang 0.5.23 on sys.path: every HTTP method of Miles'
`SGLangEngine` (miles/backends/sglang_utils/sglang_engine.py) that the broadcast harness
(miles_external_harness.py) does not already call, against a running `v4rl` rollout server, as an external engine.
Nothing here is Miles' code; it calls Miles' methods and writes what each returned (or raised) to OUT_JSON.

Served: health_generate, get_server_info, check_weights (snapshot, compare, checksum, reset_tensors), update_weights_from_disk,
update_weight_version + get_weight_version, release/resume_memory_occupation (which first calls flush_cache),
pause_generation in each of SGLang's modes + continue_generation. Refused at once (the engine has no such
capability; the test asserts a 4xx within seconds, not Miles' retry loop): update_weights_from_tensor (CUDA IPC
handles), the LoRA loaders, pull_weights, get_parallelism_info, get_remote_instance_transfer_engine_info,
start_profile, stop_profile. simulate_crash with --rollout-external logs and returns (it kills no process).

    python -c ... miles_engine_methods_harness.py URL EXPORT_DIR OUT_JSON
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from miles_external_harness import miles_args  # noqa: E402  (also gives Miles a dataclass ServerArgs)

from miles.backends.sglang_utils.sglang_engine import SGLangEngine  # noqa: E402


def memory_released(engine: SGLangEngine) -> list[str]:
    return engine.get_server_info()["internal_states"][0]["memory_released"]


def refusal(call) -> dict:
    """What a refused method did: its HTTP status and the engine's message, and how long it took."""
    start = time.monotonic()
    try:
        answer = call()
    except requests.exceptions.HTTPError as exc:
        return {"status": exc.response.status_code, "body": exc.response.text[:300],
                "seconds": time.monotonic() - start}
    return {"status": None, "answer": repr(answer)[:300], "seconds": time.monotonic() - start}


def main(url: str, export: str, out_json: str) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    args = miles_args(export)
    args.update_weight_local_checkpoint_dir = args.update_weight_disk_dir = export  # read by pull_weights
    engine = SGLangEngine(args, rank=0)
    engine.init(dist_init_addr=f"{host}:0", port=int(port), nccl_port=0, host=host)
    served = {"health_generate": engine.health_generate(timeout=30)}
    info = engine.get_server_info()
    served["server_info"] = {k: info.get(k) for k in ("model_path", "tp_size", "enable_memory_saver")}
    served["check_weights"] = [engine.check_weights(action) for action in ("snapshot", "compare", "checksum")]
    served["reset_tensors"] = engine.check_weights("reset_tensors")  # the disk update below overwrites them
    served["update_weights_from_disk"] = engine.update_weights_from_disk(export, weight_version="3")
    served["version_after_disk"] = engine.get_weight_version()
    served["update_weight_version"] = engine.update_weight_version("5")
    served["version_after_set"] = engine.get_weight_version()
    served["release"] = engine.release_memory_occupation()
    served["released"] = memory_released(engine)
    served["resume"] = engine.resume_memory_occupation()
    served["released_after_resume"] = memory_released(engine)
    served["pause_modes"] = {}
    for mode in ("abort", "retract", "in_place"):
        served["pause_modes"][mode] = engine.pause_generation(mode).status_code
        served["pause_modes"][mode + "/paused"] = engine.get_server_info()["internal_states"][0]["paused"]
        engine.continue_generation()
    served["simulate_crash"] = repr(engine.simulate_crash())
    served["health_after"] = engine.health_generate(timeout=30)

    refused = {
        "update_weights_from_tensor": refusal(lambda: engine.update_weights_from_tensor(["x"])),
        "load_lora_adapter_from_tensors": refusal(lambda: engine.load_lora_adapter_from_tensors(
            "a", {"r": 1}, serialized_tensors="x")),
        "load_lora_adapter_from_distributed": refusal(lambda: engine.load_lora_adapter_from_distributed(
            "a", {"r": 1}, ["w"], ["bfloat16"], [[1]], "g")),
        "unload_lora_adapter": refusal(lambda: engine.unload_lora_adapter("a")),
        "pull_weights": refusal(lambda: engine.pull_weights(1)),
        "get_parallelism_info": refusal(lambda: engine.get_parallelism_info(0)),
        "get_remote_instance_transfer_engine_info": refusal(
            lambda: engine.get_remote_instance_transfer_engine_info(0)),
        "start_profile": refusal(engine.start_profile),
        "stop_profile": refusal(engine.stop_profile),
    }
    tmp = Path(out_json + ".tmp")
    tmp.write_text(json.dumps({"served": served, "refused": refused}, default=repr))
    tmp.rename(out_json)


if __name__ == "__main__":
    main(*sys.argv[1:])
