"""Parameters of the rl-pipeline flow: one pydantic model (a form in the Prefect UI) with its presets.

    PipelineParams.preset("tiny-cpu", steps=20)

The cluster presets also read the block "Cluster site and Miles job": where the existing Ray cluster is
(ray_address, master_addr, network interfaces, each also from a Prefect Variable `site_variable`), where Miles,
Megatron-LM and the datasets live on its nodes, and which Miles v4rl builds the job for (31f1ca961).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from engines import TINY_BASE
from engines.backends import backend_name
from engines.presets.runs import REHEARSAL_RUN, get_run_preset, run_numbers
from engines.presets.spec import RehearsalStage

from rl.correction_setting import MIS_ALTERNATIVE, MIS_EXAMPLE, Mode, RolloutCorrection
from rl.field_docs import field_docs
from rl.known_fields import check_known_fields

REPO = Path(__file__).resolve().parent.parent


FORM_NUMBERS = ("steps", "eval_interval", "prompts_per_step", "n_samples", "n_eval", "eval_samples", "lr", "seed")
"""The fields of the form that are a preset's numbers (engines.presets.runs.RUN_NUMBERS): their defaults are the
tiny-cpu preset's, and a cluster preset fills in its own (PRESET_PARAMS)."""
_TINY = {name: value for name, value in run_numbers("tiny-cpu").items() if name in FORM_NUMBERS}
PRESET_PARAMS: dict[str, dict] = {
    name: {**{k: v for k, v in run_numbers(name).items() if k in FORM_NUMBERS},
           "hf_checkpoint": "/data/DeepSeek-V4-Flash-FP8", "rehearse": get_run_preset(name).miles.rehearse}
    for name in ("dsv4-flash-mi355x", "dsv4-flash-mi355x-1node", "dsv4-flash-mi355x-32gpu")}
"""Per cluster preset, the parameters whose defaults differ from the field defaults (tiny-cpu's): that preset's
own numbers (engines/presets/runs.py), so `v4rl plan --preset P` and the form of P run the same run."""
PRESET_PARAMS[REHEARSAL_RUN.name] = {
    **{k: v for k, v in run_numbers(REHEARSAL_RUN).items() if k in FORM_NUMBERS}, "rehearse": None,
    "hf_checkpoint": "", "align_prompts": 2}
"""cluster-rehearsal: its checkpoint is the tiny Miles-legal model the flow writes into the run directory (empty:
<run_dir>/local-cluster/hf-fp8-experts), and 2 gate prompts (Megatron rescores them on this host's CPU)."""
_REHEARSE_DOC = field_docs("engines.presets.spec", "MilesSettings")["rehearse"]
_CORRECTION, _CORRECTION_DOCS = RolloutCorrection(), field_docs("rl.correction_setting", "RolloutCorrection")
"""Rollout corrections the Miles job carries today (--use-tis or not); the others run in the embedded trainer."""


class FlowParams(BaseModel):
    """A flow's parameters: a field that is not one of them is refused, naming it and the closest field (`{"stepz":
    3}` would otherwise run the default 100 steps). Inputs are never echoed in validation errors
    (hide_input_in_errors): a secret pasted into the wrong field stays out of logs."""

    # extra="forbid" also puts additionalProperties: false in the schema Prefect's server checks a run's
    # parameters against; the validator below runs first and says which field was meant
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    @model_validator(mode="before")
    @classmethod
    def _known_fields_only(cls, data):
        if isinstance(data, dict):
            check_known_fields(data, cls.model_fields, "")  # Prefect's message names the parameter (params: ...)
        return data


class PipelineParams(FlowParams):
    """What one rl-pipeline run does. Field descriptions show in the Prefect UI's run form.

    Bad values fail before anything runs, naming the parameter and the fix (an unknown one: FlowParams)."""

    preset: Literal["tiny-cpu", "dsv4-flash-mi355x", "dsv4-flash-mi355x-1node", "dsv4-flash-mi355x-32gpu",
                    "cluster-rehearsal"] = Field(
        "tiny-cpu", description="tiny-cpu runs here end to end; the dsv4-flash-mi355x presets run Miles on an existing "
                                "Ray cluster of MI355X (the seed's 2 + 2 nodes, or Miles' own 1-node / 32-GPU "
                                "layouts); cluster-rehearsal runs the seed's Miles job, every step real, on a Ray head "
                                "this flow starts here (tiny model, logical GPUs; docs/cluster.md).")
    run_key: str = Field("tiny-cpu", pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                         description="Stable name of the run: a new flow run with the same key resumes it.")
    runs_root: str = Field(str(REPO / "runs"), description="Where run directories live (runs/<run_key>/).")
    hf_checkpoint: str = Field(str(TINY_BASE), description="HF FP8 checkpoint the rollout engine serves.")
    steps: int = Field(_TINY["steps"], ge=1, le=100000, description="GRPO steps of the run.")
    eval_interval: int = Field(_TINY["eval_interval"], ge=1, description="The training engine evaluates every this many steps (and "
                                                     "before training and at the last step); each evaluation is "
                                                     "published as it lands, while training goes on.")
    save_interval: int | None = Field(None, ge=1, description="Checkpoint every this many steps (and at the last "
                                                              "step); a retry resumes from the last one. Empty: the "
                                                              "preset's (cluster presets: Miles' --save-interval, "
                                                              "20; tiny-cpu: eval_interval).")
    prompts_per_step: int = Field(_TINY["prompts_per_step"], ge=1)
    n_samples: int = Field(_TINY["n_samples"], ge=2, description="Samples per prompt (GRPO group size).")
    n_eval: int = Field(_TINY["n_eval"], ge=1, description="Held-out problems per evaluation.")
    eval_samples: int = Field(_TINY["eval_samples"], ge=1, description="Samples per held-out problem (pass@1..8).")
    lr: float = Field(_TINY["lr"], gt=0)
    seed: int = _TINY["seed"]
    align_prompts: int = Field(16, ge=1, description="Prompts of the cross-engine alignment check.")
    align_threshold: float = Field(0.09, gt=0, description="Max mean |Δlogprob| between rollout and trainer.")
    store_url: str = Field("", description="Artifact store: file:///path or s3://bucket/prefix; empty: "
                                           "<runs_root>/store.")
    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto); None: AWS.")
    s3_secret_block: str | None = Field(None, description="Prefect Secret block holding the S3 secret key "
                                                          "(the key id comes from AWS_ACCESS_KEY_ID).")
    use_ray: bool = Field(True, description="Host trainer and rollout as Ray actors (loopback-only local cluster).")
    train_data: str = Field("", description="JSONL/parquet prompt file ({prompt, label} rows, Miles' format); "
                                            "empty: the synthetic addition task. Bad rows are dropped and counted "
                                            "in the report.")
    eval_data: str = Field("", description="Held-out prompt file (its first n_eval usable rows); empty: the "
                                           "synthetic held-out set.")
    input_key: str = Field("prompt", min_length=1, max_length=200,
                           description="Column of train_data / eval_data holding the prompt (Miles' --input-key), "
                                       "e.g. question.")
    label_key: str = Field("label", min_length=1, max_length=200,
                           description="Column holding the reference answer (Miles' --label-key), e.g. answer.")
    max_grader_error_ratio: float = Field(0.25, ge=0, le=1, description="Fraction of samples per step whose reward "
                                          "function may fail (scored 0, counted in rollout/grader_errors) before "
                                          "the run stops.")
    rollout_correction: Mode = Field(_CORRECTION.mode, description=_CORRECTION_DOCS["mode"])
    opsm: bool = Field(_CORRECTION.opsm, description=_CORRECTION_DOCS["opsm"])
    opsm_delta: float = Field(_CORRECTION.opsm_delta, ge=0, description=_CORRECTION_DOCS["opsm_delta"])
    routing_replay: bool = Field(_CORRECTION.routing_replay, description=_CORRECTION_DOCS["routing_replay"])
    metric_sinks: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list, description="Dashboards mirroring metrics.jsonl and eval/: tensorboard "
                                          "(<run_dir>/tensorboard/), wandb (offline under <run_dir>/wandb/ unless "
                                          "WANDB_MODE=online).")
    # -- the user's data and reward (rl/reward_spec.py) ------------------------------------------------------------
    reward: str = Field("auto", description="How training samples are scored: auto (literal for the synthetic task, "
                                            "math-verify for train_data), literal, math-verify, or "
                                            "package.module:function, a reward function with TRL's contract "
                                            "f(prompts, completions, label, **kwargs) -> list[float], importable "
                                            "on the worker (PYTHONPATH). Its failures count as grader errors.")
    eval_reward: str = Field("auto", description="How held-out samples are graded for pass@k: auto (literal for the "
                                                 "synthetic set, math-verify for eval_data) or any value reward "
                                                 "accepts.")

    # ---- Cluster site and Miles job (cluster presets only; names are engines.profiles.site.Site / MilesJob fields) ----
    ray_address: str | None = Field(None, description="RAY_ADDRESS: the Jobs API of the existing Ray cluster, e.g. "
                                                      "http://10.0.0.1:8265 (v4rl never starts or stops Ray).")
    master_addr: str | None = Field(None, description="MASTER_ADDR: torch.distributed rendezvous host, usually the "
                                                      "Ray head's IP.")
    socket_ifname: str | None = Field(None, description="NIC for NCCL/RCCL, Gloo and tensorpipe bootstrap traffic "
                                                        "(NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, TP_SOCKET_IFNAME).")
    ib_hca: str | None = Field(None, description="NCCL_IB_HCA: the RDMA devices RCCL/NCCL may use, e.g. rdma0,rdma1.")
    site_variable: str | None = Field(None, description="Prefect Variable holding a JSON object with any of "
                                                        "ray_address, master_addr, socket_ifname, ib_hca (a parameter "
                                                        "given here wins): `prefect variable set NAME "
                                                        "'{\"ray_address\": ...}'`.")
    miles_dir: str = Field("/workspace/miles", description="Miles checkout on the cluster nodes (main 31f1ca961; "
                                                            "train.py runs from it).")
    megatron_dir: str = Field("/root/Megatron-LM", description="Megatron-LM miles-main checkout on the cluster nodes "
                                                               "(2e64d788b).")
    data_dir: str = Field("/root/datasets", description="Where the preset's datasets (dapo-math-17k/, aime-2024/) "
                                                        "are on the cluster nodes; train_data / eval_data win.")
    eval_name: str = Field("aime", pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                           description="Name of eval_data in Miles' metrics (eval/<name>, eval/<name>-pass@k).")
    miles_check_dir: str | None = Field(None, description="Miles checkout on THIS host for preflight's parse_args "
                                                          "check; None: $V4RL_MILES_DIR or the pinned tarball.")
    megatron_check_dir: str | None = Field(None, description="Megatron-LM checkout on this host for that check; "
                                                             "None: $V4RL_MEGATRON_DIR or the pinned tarball.")
    miles_generation: int | None = Field(None, ge=1, le=2,
                                         description="Miles' DeepSeek-V4 generation on the cluster: 1 (31f1ca961, "
                                                     "plugin weight names) or 2 (e9e19b223 and later, Megatron's "
                                                     "names, --dsv4-impl). None: read from miles_check_dir's (else "
                                                     "$V4RL_MILES_DIR's) code, else 1. Decides the converted "
                                                     "checkpoint's names and the job's flags.")
    dsv4_impl: str = Field("miles", pattern=r"^(miles|megatron)$",
                           description="--dsv4-impl for a generation-2 Miles: miles (plugin attention, TP allowed) "
                                       "or megatron (Megatron's dsv4_hybrid; TP 1).")
    sglang_check_dir: str | None = Field(None, description="SGLang source on this host (the directory holding "
                                         "`sglang/`) the cluster runs: preflight builds its DeepSeek-V4 model on CPU "
                                         "and refuses the run when an online update does not reproduce a fresh load "
                                         "(3-5 min); None: not checked.")
    rehearse: RehearsalStage | None = Field(get_run_preset("tiny-cpu").miles.rehearse, description=_REHEARSE_DOC)
    align_sglang_url: str | None = Field(None, description="SGLang server serving hf_checkpoint for the cluster "
                                         "alignment gate (e.g. http://10.0.0.3:30000); empty: one engine is launched "
                                         "on the Ray cluster for the gate and stopped before Megatron rescores.")

    @model_validator(mode="before")
    @classmethod
    def _preset_fills_the_rest(cls, data):
        """Fields left out take the preset's values, not tiny-cpu's: `{"preset": "dsv4-flash-mi355x", "ray_address":
        ...}` (what `prefect deployment run -p params=...` sends, since it replaces the whole object) is the seed's
        run, not 20 tiny-cpu steps at lr 1e-4 under the run key "tiny-cpu"."""
        if not isinstance(data, dict) or not isinstance(data.get("preset"), str):
            return data
        from engines.presets.runs import preset_name

        try:
            name = preset_name(data["preset"])
        except ValueError:
            return data  # the field validator reports it, naming the closest preset
        return {"run_key": name, **PRESET_PARAMS.get(name, {}), **data}

    @field_validator("preset", mode="before")
    @classmethod
    def _preset_spelling(cls, v):
        """tiny_cpu, TINY-CPU and tiny-cpu are one preset, as in `v4rl train` and `v4rl plan`."""
        if isinstance(v, str):
            from engines.presets.runs import preset_name

            return preset_name(v)  # ValueError naming the closest known preset
        return v

    @field_validator("runs_root", "hf_checkpoint")
    @classmethod
    def _absolute(cls, v: str) -> str:
        return str(Path(v).expanduser().resolve()) if v else v

    @field_validator("train_data", "eval_data")
    @classmethod
    def _data_file(cls, v: str, info) -> str:
        if not v:
            return v
        path = Path(v).expanduser().resolve()
        if path.is_dir():
            raise ValueError(f"{info.field_name} {path} is a directory; give the data file inside it")
        if path.suffix.lower() not in (".jsonl", ".json", ".parquet"):
            raise ValueError(f"{info.field_name} {path}: unsupported file type {path.suffix!r}; give a .jsonl, .json "
                             "or .parquet file with prompt and label columns, or leave it empty for the synthetic task")
        if not path.is_file():
            raise ValueError(f"{info.field_name} {path} does not exist; check the path (it is read on the machine "
                             "that runs the flow)")
        return str(path)

    @field_validator("miles_check_dir", "megatron_check_dir")
    @classmethod
    def _checkout_here(cls, v: str | None, info) -> str | None:
        if v and not Path(v).expanduser().is_dir():
            raise ValueError(f"{info.field_name} {v}: no such directory on this host (preflight runs Miles' parser "
                             "here); give a checkout on this machine, or leave it empty for the pinned sources")
        return str(Path(v).expanduser().resolve()) if v else None

    @field_validator("reward", "eval_reward")
    @classmethod
    def _reward(cls, v: str, info) -> str:
        from rl.reward_spec import check_reward_spec

        return check_reward_spec(v, info.field_name)  # imports an import path's module and checks its signature

    @model_validator(mode="after")
    def _reward_reaches_the_trainer(self) -> "PipelineParams":
        for name in ("reward", "eval_reward"):
            value = getattr(self, name)
            if backend_name(self.preset) == "miles" and value not in ("auto", "math-verify"):
                raise ValueError(f"{name}={value!r} applies to the embedded tiny-cpu run only; on {self.preset} Miles "
                                 "trains, evaluates and grades with its own --rm-type math: leave it at auto or "
                                 "math-verify (a custom Miles reward is its --custom-rm-path, not wired here)")
        return self

    @model_validator(mode="after")
    def _rehearsal_needs_a_miles_job(self) -> "PipelineParams":
        if self.rehearse and backend_name(self.preset) != "miles":
            raise ValueError(f"rehearse={self.rehearse!r}: {self.preset} runs the embedded engines here, with no Miles "
                             "job to rehearse; leave rehearse empty, or rehearse a cluster preset "
                             "(dsv4-flash-mi355x, ...)")
        return self

    @model_validator(mode="after")
    def _miles_checkout_has_a_generation(self) -> "PipelineParams":
        # resolved_miles_generation reads the checkout at conversion time; a non-Miles tree is refused here, in one
        # line, before the run starts, not as a traceback from the first task that asks
        if self.miles_check_dir and self.miles_generation is None:
            from engines.miles.generation import MilesGenerationError, detect_generation

            try:
                detect_generation(self.miles_check_dir)
            except MilesGenerationError as exc:
                raise ValueError(f"miles_check_dir: {exc}; or set miles_generation") from None
        return self

    @model_validator(mode="after")
    def _correction_reaches_the_trainer(self) -> "PipelineParams":
        self.correction()  # ValueError naming the field and the fix
        if backend_name(self.preset) == "miles" and self.rollout_correction in MIS_ALTERNATIVE:
            raise ValueError(f"rollout_correction={self.rollout_correction!r} needs Miles' {MIS_EXAMPLE} (mis.py), "
                             f"which the pinned Miles generations do not carry; use "
                             f"{MIS_ALTERNATIVE[self.rollout_correction]!r} on {self.preset}, or run "
                             f"{self.rollout_correction} on tiny-cpu (docs/rollout-correction.md)")
        return self

    def correction(self) -> RolloutCorrection:
        """The run's rl.correction_setting.RolloutCorrection (the embedded trainer's TrainRunConfig field)."""
        return RolloutCorrection(mode=self.rollout_correction, opsm=self.opsm, opsm_delta=self.opsm_delta,
                                 routing_replay=self.routing_replay)

    @field_validator("store_url")
    @classmethod
    def _store(cls, v: str) -> str:
        if v:
            from engines.artifact_store.paths import parse_store_url

            try:
                parse_store_url(v)
            except ValueError as exc:
                raise ValueError(f"store_url: {exc}") from None
        return v

    @field_validator("s3_endpoint_url")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if not v:
            return None
        from urllib.parse import urlsplit

        if "@" in v:  # never echo it: user:secret@host (a secret with "/" in it ends urlsplit's netloc early)
            raise ValueError("s3_endpoint_url embeds credentials (user:secret@host); give the bare endpoint and pass "
                             "credentials through AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or s3_secret_block")
        parts = urlsplit(v)
        try:
            parts.port  # noqa: B018 - raises for a non-numeric port
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
            raise ValueError("s3_endpoint_url must look like http://127.0.0.1:9000 or https://s3.example.com "
                             "(scheme, host, optional port; no credentials, no query)")
        return v

    @field_validator("s3_secret_block")
    @classmethod
    def _block_name(cls, v: str | None) -> str | None:
        if v and not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,99}", v):  # never echo it: it may be the secret itself
            raise ValueError("s3_secret_block must be the name of a Prefect Secret block (lowercase letters, digits "
                             "and dashes, e.g. v4rl-s3), not the secret value; create the block with "
                             "Secret(value=...).save(name)")
        return v or None

    @model_validator(mode="after")
    def _check(self) -> "PipelineParams":
        # the embedded engines load hf_checkpoint on this host; a Miles job reads it on the cluster's shared disk
        from checkpoints.paths import not_hf_reason, not_output_dir_reason

        here = backend_name(self.preset) == "embedded"
        reason = not_hf_reason(self.hf_checkpoint) if here else None
        if reason:  # a run directory, another model, a shard missing or cut short: found before anything starts
            raise ValueError(f"hf_checkpoint {reason}")
        if Path(self.runs_root).exists() and not Path(self.runs_root).is_dir():
            raise ValueError(f"runs_root {self.runs_root} is a file; give a directory (created if missing)")
        reason = not_output_dir_reason(Path(self.runs_root)) if here else None
        if reason:  # a read-only place, a full disk
            raise ValueError(f"runs_root {reason}")
        if self.preset == REHEARSAL_RUN.name and not self.hf_checkpoint:
            self.hf_checkpoint = str(self.run_dir / "local-cluster" / "hf-fp8-experts")
        if self.eval_interval > self.steps:
            raise ValueError(f"eval_interval ({self.eval_interval}) exceeds steps ({self.steps}); lower it so that "
                             "at least one evaluation runs")
        return self

    def resolved_miles_generation(self) -> int:
        """miles_generation, else the generation of the Miles checkout on this host (miles_check_dir, else
        $V4RL_MILES_DIR), else 1: the same answer for the conversion, the preflight and the job."""
        if self.miles_generation is not None:
            return self.miles_generation
        local = self.miles_check_dir or os.environ.get("V4RL_MILES_DIR")
        if not local:
            return 1
        from engines.miles.generation import detect_generation

        return detect_generation(local).generation

    def backend(self):
        """The run's engines (engines/backends `Backend`), built once from the preset: the flow hands this one
        object to every task, which calls it without asking which engines it drives."""
        if self.preset == REHEARSAL_RUN.name:
            raise ValueError("cluster-rehearsal's engines exist while its flow runs (its local Ray head and engine): "
                             "use `with params.engines() as backend`")
        return _BUILDERS[backend_name(self.preset)](self)

    @contextmanager
    def engines(self):
        """The run's backend for the length of a flow run: `backend()`, except that cluster-rehearsal first starts
        its local cluster (engines/upstream/rehearsal/cluster_run.py: v4rl's engine, a Ray head with logical GPUs,
        the user's Miles and Megatron-LM) and stops it when the block ends; its backend is the Miles one."""
        if self.preset != REHEARSAL_RUN.name:
            yield self.backend()
            return
        from engines.upstream.rehearsal.cluster_run import local_cluster

        with local_cluster(self.run_dir / "local-cluster", self.miles_job(), run_dir=self.run_dir,
                           eval_interval=self.eval_interval, overrides=self.miles_overrides(),
                           miles_dir=self.miles_check_dir, megatron_dir=self.megatron_check_dir,
                           dsv4_impl=self.dsv4_impl) as run:
            yield _miles_backend(self, run, miles_dir=run.job.miles_dir, megatron_dir=run.job.megatron_dir)

    def miles_overrides(self) -> dict:
        """The run preset overrides these parameters make on the cluster path (engines.presets.runs OVERRIDES)."""
        out: dict = {"num_rollout": self.steps, "rollout_batch_size": self.prompts_per_step,
                     "n_samples_per_prompt": self.n_samples, "eval_interval": self.eval_interval,
                     "n_samples_per_eval_prompt": self.eval_samples, "lr": self.lr}
        if self.correction() != _CORRECTION:  # Miles' flags: engines/miles/train_args.py correction_args
            out["rollout_correction"] = self.correction().to_dict()
        if self.save_interval:  # else the preset's (MilesSettings.save_interval): one job saves on its own grid
            out["save_interval"] = self.save_interval
        if self.train_data:
            out["prompt_data"] = self.train_data
        if self.eval_data:
            out["eval_datasets"] = [[self.eval_name, self.eval_data]]
        generation = self.resolved_miles_generation()
        if generation != 1 or self.dsv4_impl != "miles":  # only when not the preset's own (generation 1, miles)
            out.update(miles_generation=generation, dsv4_impl=self.dsv4_impl)
        for key, default in (("input_key", "prompt"), ("label_key", "label")):
            if getattr(self, key) != default:  # Miles' --input-key / --label-key (its eval sets read the same)
                out[key] = getattr(self, key)
        return out

    def miles_job(self):
        """The engines.miles.MilesJob of this run: our torch_dist as --ref-load, Miles' saves in the run dir."""
        from engines.miles import MilesJob

        return MilesJob(run_id=self.run_key, hf_checkpoint=self.hf_checkpoint, ref_load=str(self.run_dir / "torch_dist"),
                        save_dir=str(self.run_dir / "miles-checkpoints"), miles_dir=self.miles_dir,
                        megatron_dir=self.megatron_dir, data_dir=self.data_dir, log_dir=str(self.run_dir))

    def site(self):
        """The engines.profiles.site.Site of this run: these parameters over `site_variable`'s values. (Prefect 3.9
        has no JSON block any more; a Variable holds a JSON object and is edited in the UI's Variables page.)"""
        from engines.profiles.site import SITE_PARAMETERS, Site

        given = {k: getattr(self, k) for k in SITE_PARAMETERS if getattr(self, k)}
        if self.site_variable:
            from prefect.variables import Variable

            stored = Variable.get(self.site_variable)
            example = "'{\"ray_address\": \"http://HEAD:8265\", \"master_addr\": \"HEAD\"}'"
            if not isinstance(stored, dict):
                found = "does not exist" if stored is None else f"holds a {type(stored).__name__}, not a JSON object"
                raise ValueError(f"site_variable {self.site_variable!r}: the Prefect Variable {found}; create it with "
                                 f"`prefect variable set {self.site_variable} {example}`")
            unknown = sorted(set(stored) - set(SITE_PARAMETERS))
            if unknown:
                raise ValueError(f"site_variable {self.site_variable!r} has unknown keys {unknown}; use "
                                 f"{', '.join(SITE_PARAMETERS)}")
            given = {**{k: v for k, v in stored.items() if v}, **given}
        return Site(**given)

    @classmethod
    def preset_defaults(cls, name: str, **overrides) -> "PipelineParams":
        """The preset's run (PRESET_PARAMS over the field defaults; run_key: the preset's name) with overrides."""
        return cls.model_validate({"preset": name, **overrides})

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_root) / self.run_key

    @property
    def store(self) -> str:
        return self.store_url or f"file://{Path(self.runs_root) / 'store'}"

    def training_fingerprint(self) -> str:
        """Hash of everything that shapes the training trajectory (the training task's cache key)."""
        # runs_root too: a cached training only stands for training done in this very run directory
        keys = ("preset", "run_key", "runs_root", "hf_checkpoint", "steps", "prompts_per_step", "n_samples", "lr",
                "seed")
        fields = {k: getattr(self, k) for k in keys}
        if self.train_data:  # only when set: fingerprints of runs on the synthetic task stay as they were
            fields["train_data"] = self.train_data
        if self.reward != "auto":  # likewise
            fields["reward"] = self.reward
        for key, default in (("input_key", "prompt"), ("label_key", "label")):
            if getattr(self, key) != default:  # likewise
                fields[key] = getattr(self, key)
        if self.correction() != _CORRECTION:  # likewise
            fields["rollout_correction"] = self.correction().to_dict()
        blob = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _embedded(p: PipelineParams):
    """engines/backends/embedded.py EmbeddedBackend: the trainer's TrainRunConfig from these parameters."""
    from engines.backends.embedded import EmbeddedBackend
    from engines.train.run import TrainRunConfig, tiny_loop

    loop = tiny_loop(prompts_per_step=p.prompts_per_step, n_samples=p.n_samples, eval_interval=p.eval_interval,
                     eval_samples=p.eval_samples, seed=p.seed)
    config = TrainRunConfig(base=p.hf_checkpoint, steps=p.steps, save_interval=p.save_interval or p.eval_interval,
                            n_eval=p.n_eval, lr=p.lr, loop=loop, use_ray=p.use_ray, metric_sinks=list(p.metric_sinks),
                            train_data=p.train_data, eval_data=p.eval_data, input_key=p.input_key,
                            label_key=p.label_key, max_grader_error_ratio=p.max_grader_error_ratio, reward=p.reward,
                            eval_reward=p.eval_reward, rollout_correction=p.correction())
    return EmbeddedBackend(run_dir=str(p.run_dir), config=config)


def _miles(p: PipelineParams):
    """engines/backends/miles.py MilesBackend: the Miles job (site, paths, preset overrides) of a cluster
    preset, where its results go, the checkouts preflight checks it against, and the torch_dist names its Miles
    generation loads."""
    from engines.miles.pipeline import ClusterRun

    run = ClusterRun(preset=p.preset, job=p.miles_job(), site=p.site(), run_dir=str(p.run_dir),
                     eval_interval=p.eval_interval, overrides=p.miles_overrides(),
                     align_sglang_url=p.align_sglang_url or None)
    return _miles_backend(p, run, miles_dir=p.miles_check_dir, megatron_dir=p.megatron_check_dir)


def _miles_backend(p: PipelineParams, run, *, miles_dir: str | None, megatron_dir: str | None):
    """MilesBackend of `run`; its Miles generation (the run's override, else generation 1) names the checkpoint.
    Preflight checks the job against the checkouts `miles_dir` / `megatron_dir` on this host (None: the pinned
    sources)."""
    from engines.backends.miles import MilesBackend

    generation = run.overrides.get("miles_generation", 1)
    return MilesBackend(run=run, steps=p.steps, megatron_names="megatron" if generation == 2 else "plugin",
                        miles_dir=miles_dir, megatron_dir=megatron_dir,
                        sglang_dir=p.sglang_check_dir)


_BUILDERS = {"embedded": _embedded, "miles": _miles}
"""How each backend (engines.backends.backend_name) is built from the flow's parameters."""
