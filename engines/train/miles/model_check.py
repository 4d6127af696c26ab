"""Miles' OWN DeepSeek-V4 model against v4rl's checkpoint: key sets, loading, and one forward, on CPU.

Runs engines/train/miles/probes/model_probe.py in a subprocess (engines.engine_sources.engine_python) with
Megatron-LM first on sys.path, then Miles and SGLang's source, `probes/standins/` (TransformerEngine's module
structure) ahead of them, GPU-only modules stubbed, and torch.cuda answering as the target accelerator. The
probe parses the job's model flags with Miles' own `parse_args`, builds the model through Miles' model provider
and `--spec` (on the meta device for a full-size model), and reports what was asked.

    keys = miles_model_keys(config_json_dict, meta=True)                  # ~1-3 min on 2 cores
    problems = compare_keys(keys, expected_checkpoint_keys(ModelConfig.from_hf_dict(config_json_dict)))
    # [] or ["missing in the checkpoint: decoder.layers.0...", ...] each naming the fix

Key comparison rules (what Miles' loader does with a difference): a key the model asks for that the checkpoint
lacks keeps its random init and the loader only prints `... will skip`; a global-shape difference fails the
load; a dtype difference is cast on load (still reported: the file should hold what the model holds). TE's
`_extra_state` objects are not tensors of the model's weights and are listed apart, never required.

Nothing here is imported by the library at startup; `v4rl plan --miles-dir` and the cluster preflight call it.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROBES = Path(__file__).with_name("probes")
PROBE = PROBES / "model_probe.py"
STANDINS = PROBES / "standins"
MODEL_STUB_ROOTS = ("tile_kernels", "fast_hadamard_transform")
"""Beyond the parse-args probe's stubs: TileKernels' mHC ops and the Hadamard kernel, imported at module level by
Miles' model (their numbers matter only for a forward; tests/conformance/miles_kernels.py replaces them then)."""
PROBE_SEQ_LENGTH = 256
"""--seq-length of the probe's argv: Miles' compressor needs a multiple of 128 (the HCA rate)."""


class MilesModelError(RuntimeError):
    """Miles' model could not be built, loaded or run by the probe; the message names the stage and the error."""


@dataclass
class ProbeResult:
    """What the model probe answered (model_probe.py's JSON)."""

    raw: dict[str, Any]
    stderr: str = ""

    @property
    def keys(self) -> dict[str, list]:
        return self.raw["keys"]["tensors"]

    @property
    def extra_state_objects(self) -> list[str]:
        return self.raw["keys"]["objects"]

    @property
    def parameters(self) -> int:
        return self.raw["keys"]["parameters"]

    @property
    def loads(self) -> list[dict[str, Any]]:
        return self.raw.get("loads", [])

    @property
    def forwards(self) -> dict[str, str]:
        return self.raw.get("forwards", {})


def probe_argv(config: Mapping[str, Any], *, hf_dir: str | Path, load_dir: str | Path, meta: bool = False,
               extra: Sequence[str] = ()) -> list[str]:
    """train.py argv for the probe: the model flags v4rl derives from config.json (the job's own) plus a
    single-rank BF16 CPU set-up; `load_dir` is both --load and --ref-load (a finetune start, as the job's)."""
    from engines.train.miles.model_args import model_args

    init = ["--init-model-with-meta-device"] if meta else ["--use-cpu-initialization"]
    return [*model_args(config), "--hf-checkpoint", str(hf_dir), "--ref-load", str(load_dir), "--load", str(load_dir),
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
            "--expert-model-parallel-size", "1", "--bf16", *init, "--no-gradient-accumulation-fusion",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--seq-length", str(PROBE_SEQ_LENGTH),
            "--max-position-embeddings", str(int(config.get("max_position_embeddings", 4096))),
            "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--colocate", "--qkv-format", "bshd",
            "--rollout-batch-size", "1", "--n-samples-per-prompt", "1", "--num-rollout", "1",
            "--prompt-data", "/dev/null", "--finetune", "--no-load-optim", "--no-load-rng", "--seed", "1234",
            *extra]


def run_probe(request: Mapping[str, Any], *, miles_dir: str | Path | None = None,
              megatron_dir: str | Path | None = None, env: Mapping[str, str] | None = None,
              device: str = "mi355x", timeout: float = 1800.0) -> ProbeResult:
    """Run the model probe on `request` (model_probe.py's keys; `device` fills its accelerator description)."""
    from engines.engine_sources import engine_python, megatron_tree, miles_tree, sglang_paths
    from engines.engine_stubs import GPU_ONLY_ROOTS
    from engines.train.miles.preflight import DEVICES, MILES_STUB_ROOTS

    paths = [STANDINS, megatron_tree(megatron_dir), miles_tree(miles_dir), *sglang_paths()]
    with tempfile.TemporaryDirectory(prefix="v4rl-miles-model-") as tmp:
        req = Path(tmp) / "request.json"
        req.write_text(json.dumps({"device": DEVICES[device], **request}))
        code = f"import runpy, sys; sys.argv[0] = {str(PROBE)!r}; runpy.run_path({str(PROBE)!r}, run_name='__main__')"
        done = engine_python(code, paths, args=[str(req)], stub_roots=(*GPU_ONLY_ROOTS, *MILES_STUB_ROOTS,
                                                                       *MODEL_STUB_ROOTS),
                             env={"CUDA_DEVICE_MAX_CONNECTIONS": "1", **(env or {})}, cwd=tmp, timeout=timeout,
                             check=False)
    from engines.train.miles.probes.model_probe import MARKER

    out = done.stdout or ""
    if MARKER not in out:
        tail = "\n".join(((done.stderr or "") + out).strip().splitlines()[-30:])
        raise MilesModelError(f"the Miles model probe exited {done.returncode} without an answer:\n{tail}")
    answer = json.loads(out.split(MARKER, 1)[1].strip().splitlines()[0])
    if not answer.get("ok"):
        raise MilesModelError(f"Miles' model failed at stage {answer.get('stage')}: {answer.get('error')}\n"
                              f"{answer.get('traceback', '')[-3000:]}")
    return ProbeResult(answer, done.stderr or "")


# ------------------------------------------------------------------------------------------------ key sets
def expected_checkpoint_keys(cfg) -> dict[str, list]:
    """{key: [global shape, dtype]} of the torch_dist checkpoint v4rl's converter writes for `cfg`."""
    from checkpoints.torch_dist import megatron_specs

    return {k: [list(s.shape), str(s.dtype).replace("torch.", "")] for k, s in megatron_specs(cfg).items()}


def checkpoint_keys(ckpt: str | Path) -> dict[str, list]:
    """{key: [global shape, dtype]} of an existing torch_dist checkpoint (root or iteration dir), as stored."""
    from checkpoints.megatron_io import megatron_tensor_metadata

    return {k: [list(s.shape), str(s.dtype).replace("torch.", "")] for k, s in megatron_tensor_metadata(ckpt).items()}


@dataclass
class KeyComparison:
    """Miles' model's checkpoint keys vs the checkpoint's."""

    missing: list[str] = field(default_factory=list)
    """Keys the model asks for that the checkpoint lacks: they would keep their random init (`will skip`)."""
    unexpected: list[str] = field(default_factory=list)
    """Keys the checkpoint holds that the model never asks for (a renamed key shows up here and in `missing`)."""
    shape: list[str] = field(default_factory=list)
    """'key: model [..] vs checkpoint [..]': the load fails."""
    dtype: list[str] = field(default_factory=list)
    """'key: model int32 vs checkpoint int64': the load casts; the file should hold the model's dtype."""

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.shape or self.dtype)

    def problems(self, *, fix: str = "") -> list[str]:
        out = [f"missing in the checkpoint (Miles' model would keep its random init and only print `will skip`): "
               f"{k}" for k in self.missing]
        out += [f"in the checkpoint but not asked for by Miles' model: {k}" for k in self.unexpected]
        out += [f"global shape differs (the load fails): {s}" for s in self.shape]
        out += [f"dtype differs (cast on load): {s}" for s in self.dtype]
        if out and fix:
            out.append(f"fix: {fix}")
        return out


def compare_keys(model_keys: Mapping[str, Sequence], ckpt_keys: Mapping[str, Sequence]) -> KeyComparison:
    """Compare {key: [shape, dtype]} maps (model_keys: Miles' sharded_state_dict; ckpt_keys: the file's)."""
    result = KeyComparison(missing=sorted(set(model_keys) - set(ckpt_keys)),
                           unexpected=sorted(set(ckpt_keys) - set(model_keys)))
    for key in sorted(set(model_keys) & set(ckpt_keys)):
        (m_shape, m_dtype), (c_shape, c_dtype) = model_keys[key], ckpt_keys[key]
        if list(m_shape) != list(c_shape):
            result.shape.append(f"{key}: model {list(m_shape)} vs checkpoint {list(c_shape)}")
        if m_dtype != c_dtype:
            result.dtype.append(f"{key}: model {m_dtype} vs checkpoint {c_dtype}")
    return result
