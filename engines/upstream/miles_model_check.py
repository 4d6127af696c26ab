"""Miles' OWN DeepSeek-V4 model against v4rl's checkpoint: key sets, loading, and one forward, on CPU.

Runs engines/upstream/probes/model_probe.py in a subprocess (engines.upstream.sources.engine_python) with
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
from engines.miles.train_args import MEGATRON_VOCAB_DIVISIBLE_BY as MAKE_VOCAB_DIVISIBLE_BY
from engines.miles.train_args import padded_vocab, vocab_args

PROBES = Path(__file__).with_name("probes")
PROBE = PROBES / "model_probe.py"
STANDINS = PROBES / "standins"
NUMERIC_STANDINS = PROBES / "numeric_standins.py"
"""The GPU kernels' math for a forward (TileKernels mHC, Hadamard, tilelang sparse attention and indexer)."""
TILE_KERNELS = "tile-kernels==2.1.0"
"""The wheel whose pure-torch mHC references (tile_kernels/torch/mhc.py) stand in for TileKernels' GPU ops."""
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

    @property
    def forward_error(self) -> str:
        """Why the forward stage failed after keys and loads succeeded ('' when it ran)."""
        if self.raw.get("ok"):
            return ""
        from engines.upstream.sources import engine_error

        return f"{self.raw.get('stage')}: {engine_error(self.stderr, exception=self.raw.get('error'))}"


def probe_argv(config: Mapping[str, Any], *, hf_dir: str | Path, load_dir: str | Path, meta: bool = False,
               generation: int = 1, extra: Sequence[str] = ()) -> list[str]:
    """train.py argv for the probe: the model flags v4rl derives from config.json (the job's own, for Miles'
    DeepSeek-V4 `generation`) plus a single-rank BF16 CPU set-up; `load_dir` is both --load and --ref-load (a
    finetune start, as the job's)."""
    from engines.miles.model_args import model_args

    init = ["--init-model-with-meta-device"] if meta else ["--use-cpu-initialization"]
    return [*model_args(config, generation=generation), "--hf-checkpoint", str(hf_dir), "--ref-load", str(load_dir),
            "--load", str(load_dir),
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
    from engines.upstream.sources import engine_error, engine_python, megatron_tree, miles_tree, sglang_paths
    from engines.upstream.stubs import GPU_ONLY_ROOTS
    from engines.upstream.miles_preflight import DEVICES, MILES_STUB_ROOTS

    paths = [STANDINS, megatron_tree(megatron_dir), miles_tree(miles_dir), *sglang_paths()]
    with tempfile.TemporaryDirectory(prefix="v4rl-miles-model-") as tmp:
        req = Path(tmp) / "request.json"
        req.write_text(json.dumps({"device": DEVICES[device], **request}))
        code = f"import runpy, sys; sys.argv[0] = {str(PROBE)!r}; runpy.run_path({str(PROBE)!r}, run_name='__main__')"
        done = engine_python(code, paths, args=[str(req)], stub_roots=(*GPU_ONLY_ROOTS, *MILES_STUB_ROOTS,
                                                                       *MODEL_STUB_ROOTS),
                             env={"CUDA_DEVICE_MAX_CONNECTIONS": "1", **(env or {})}, cwd=tmp, timeout=timeout,
                             check=False)
    from engines.upstream.probes.model_probe import MARKER

    out = done.stdout or ""
    if MARKER not in out:
        raise MilesModelError(f"the Miles model probe exited {done.returncode} without an answer: "
                              f"{engine_error(done.stderr, out)}")
    answer = json.loads(out.split(MARKER, 1)[1].strip().splitlines()[0])
    if not answer.get("ok") and answer.get("built_and_loaded") and str(answer.get("stage", "")).startswith("forward"):
        return ProbeResult(answer, done.stderr or "")  # keys and loads stand; forward_error says what failed
    if not answer.get("ok"):  # Miles' own words (argparse prints its error to stderr before SystemExit 2)
        raise MilesModelError(f"Miles' model ({miles_dir or 'pinned'}) failed at stage {answer.get('stage')}: "
                              f"{engine_error(done.stderr, exception=answer.get('error'))}")
    return ProbeResult(answer, done.stderr or "")


def tile_kernels_mhc_reference() -> Path:
    """tile_kernels/torch/mhc.py from the registry's tile-kernels wheel, cached in the engine cache (the wheel
    needs Python >= 3.12, hence --python-version; only this file is extracted, the package is never imported)."""
    import os
    import subprocess
    import sys
    import zipfile

    from engines.upstream.sources import EngineSourceMissing, cache_root

    home = cache_root() / TILE_KERNELS.replace("==", "-")
    target = home / "tile_kernels" / "torch" / "mhc.py"
    if target.is_file():
        return target
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home) as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--python-version", "3.12",
                               "--only-binary=:all:", TILE_KERNELS, "-d", tmp], capture_output=True, text=True,
                              timeout=600)
        if done.returncode != 0:
            raise EngineSourceMissing(f"`pip download {TILE_KERNELS}` failed (offline?): "
                                      f"{done.stderr.strip()[-400:]}; run once with access to the package registry")
        wheel = next(Path(tmp).glob("tile_kernels-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract("tile_kernels/torch/mhc.py", tmp)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(Path(tmp) / "tile_kernels" / "torch" / "mhc.py", target)
    return target


# ------------------------------------------------------------------------------------------------ key sets
def expected_checkpoint_keys(cfg, names: str = "plugin") -> dict[str, list]:
    """{key: [global shape, dtype]} of the torch_dist checkpoint v4rl's converter writes for `cfg` under `names`
    (checkpoints/names.py MegatronNames: plugin for Miles' generation 1, megatron for generation 2)."""
    from checkpoints.torch_dist import megatron_specs

    return {k: [list(s.shape), str(s.dtype).replace("torch.", "")] for k, s in megatron_specs(cfg, names).items()}


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
    vocab_padded: list[str] = field(default_factory=list)
    """Embedding / output-layer rows Megatron pads the vocab with (--make-vocab-size-divisible-by x TP): Miles'
    loader fills the rows the file lacks with zeros (tests/conformance/test_miles_model.py); not a failure."""

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


VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
"""The tensors whose rows Megatron pads to the padded vocab size."""


def compare_keys(model_keys: Mapping[str, Sequence], ckpt_keys: Mapping[str, Sequence]) -> KeyComparison:
    """Compare {key: [shape, dtype]} maps (model_keys: Miles' sharded_state_dict; ckpt_keys: the file's)."""
    result = KeyComparison(missing=sorted(set(model_keys) - set(ckpt_keys)),
                           unexpected=sorted(set(ckpt_keys) - set(model_keys)))
    for key in sorted(set(model_keys) & set(ckpt_keys)):
        (m_shape, m_dtype), (c_shape, c_dtype) = model_keys[key], ckpt_keys[key]
        if list(m_shape) != list(c_shape):
            line = f"{key}: model {list(m_shape)} vs checkpoint {list(c_shape)}"
            padded = (key in VOCAB_KEYS and len(m_shape) == len(c_shape) == 2 and m_shape[1] == c_shape[1]
                      and m_shape[0] > c_shape[0])
            (result.vocab_padded if padded else result.shape).append(line)
        if m_dtype != c_dtype:
            result.dtype.append(f"{key}: model {m_dtype} vs checkpoint {c_dtype}")
    return result


# --------------------------------------------------------------------------------------------- preflight
@dataclass
class ModelKeyCheck:
    """Miles' model (built on the meta device from the user's checkout) against the checkpoint v4rl hands over."""

    comparison: KeyComparison
    miles_dir: str
    generation: int
    checkpoint: str
    """The torch_dist dir read, or 'v4rl's converter output for config.json' when none exists here yet."""
    model_keys: int = 0
    extra_state_objects: int = 0
    parameters: int = 0
    vocab_note: str = ""

    @property
    def ok(self) -> bool:
        return self.comparison.ok

    def summary(self) -> str:
        head = (f"Miles' DeepSeek-V4 model ({self.miles_dir}, generation {self.generation}; {self.model_keys} keys, "
                f"{self.parameters:,} parameters, built on the meta device) vs {self.checkpoint}")
        if self.ok:
            return f"{head}: same keys, global shapes and dtypes" + (f"; {self.vocab_note}" if self.vocab_note else "")
        fix = ("convert with the same Miles: `v4rl convert SRC DST --miles-dir " + self.miles_dir + "` (names of its "
               "generation), or check out the Miles/Megatron-LM pair v4rl supports (31f1ca961 + 2e64d788b, "
               "e9e19b223 + 6184c094a)")
        return "\n".join([f"{head}: the checkpoint does not fit (nothing was submitted):",
                          *(f"  {p}" for p in self.comparison.problems(fix=fix))])

    def to_json(self) -> dict[str, Any]:
        c = self.comparison
        return {"ok": self.ok, "miles_dir": self.miles_dir, "generation": self.generation,
                "checkpoint": self.checkpoint, "model_keys": self.model_keys, "parameters": self.parameters,
                "extra_state_objects": self.extra_state_objects, "missing": c.missing, "unexpected": c.unexpected,
                "shape": c.shape, "dtype": c.dtype, "vocab_padded": c.vocab_padded, "vocab_note": self.vocab_note}


def check_model_keys(config: Mapping[str, Any], *, ckpt: str | Path | None = None, miles_dir: str | Path | None = None,
                     megatron_dir: str | Path | None = None, impl: str | None = None,
                     timeout: float = 1800.0) -> ModelKeyCheck:
    """Build the Miles model of `miles_dir` for this config.json on the meta device and compare its checkpoint keys
    with `ckpt` (an existing torch_dist dir) or, when there is none here, with what v4rl's converter writes for the
    config under that Miles' names. Global shapes are those of a single-rank build (keys do not depend on the
    parallel split; the vocab is padded to --make-vocab-size-divisible-by x TP, reported in vocab_note)."""
    from engines.miles.pins import MILES_GENERATIONS
    from engines.upstream.sources import megatron_tree, miles_tree
    from engines.model.config import ModelConfig
    from engines.miles.generation import detect_generation, dsv4_impl_args

    gen = detect_generation(miles_tree(miles_dir))
    pins = MILES_GENERATIONS[gen.generation]
    miles, megatron = miles_tree(miles_dir, pins[0]), megatron_tree(megatron_dir, pins[1])
    if ckpt is not None and Path(ckpt).exists():
        expected, where = checkpoint_keys(ckpt), str(ckpt)
    else:
        expected = expected_checkpoint_keys(ModelConfig.from_hf_dict(dict(config)), gen.megatron_names)
        where = f"v4rl's converter output for this config.json ({gen.megatron_names} names)"
    extra = dsv4_impl_args(gen, impl)  # generation 1's parser has no --dsv4-impl (it exits 2 on one)
    with tempfile.TemporaryDirectory(prefix="v4rl-miles-keys-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(dict(config)))
        argv = probe_argv(config, hf_dir=tmp, load_dir=tmp, meta=True, generation=gen.generation, extra=extra)
        result = run_probe({"argv": argv, "do": ["keys"]}, miles_dir=miles, megatron_dir=megatron, timeout=timeout)
    comparison = compare_keys(result.keys, expected)
    padded, vocab = int(result.raw.get("padded_vocab_size", 0)), int(config["vocab_size"])
    note = (f"Megatron pads the vocab {vocab} -> {padded} at TP 1 (pad rows load as zeros; their logit 0 enters "
            "Miles' logprob softmax)") if padded != vocab else ""
    return ModelKeyCheck(comparison, str(miles), gen.generation, where, len(result.keys),
                         len(result.extra_state_objects), result.parameters, note)


def check_job_model_keys(preset, job, *, miles_dir: str | Path | None = None,
                         megatron_dir: str | Path | None = None) -> ModelKeyCheck:
    """The job's Miles model (meta device) vs the checkpoint it hands over: job.ref_load when it exists on this
    host, else what v4rl's converter writes for the job's config.json (--hf-checkpoint here, else the preset's)."""
    from engines.miles.model_args import read_config

    if Path(job.hf_checkpoint).is_dir():
        config = read_config(job.hf_checkpoint)
    elif preset.hf_config is not None:
        config = preset.hf_config()
    else:
        raise ValueError(f"{job.hf_checkpoint} is not a directory here and preset {preset.name!r} has no config.json; "
                         "point hf_checkpoint at the FP8 HF checkpoint")
    check = check_model_keys(config, ckpt=job.ref_load, miles_dir=miles_dir, megatron_dir=megatron_dir,
                             impl=getattr(preset.miles, "dsv4_impl", None))
    vocab, tp = int(config["vocab_size"]), preset.parallel.tp
    given = vocab_args(preset, vocab)
    padded = padded_vocab(vocab, tp, int(given[1]) if given else MAKE_VOCAB_DIVISIBLE_BY)
    if padded != vocab:  # TP does not divide the vocab: no divisor avoids the pad rows
        check.vocab_note = (f"at TP {tp} Megatron pads the vocab {vocab} -> {padded}: {padded - vocab} pad rows load "
                            "as zeros and their logit 0 enters Miles' logprob softmax (docs/conformance.md 'Megatron conformance', "
                            "vocab padding); choose a TP that divides the vocab")
    return check
