"""The `miles` training backend: Miles (Megatron actor + SGLang rollout on Ray) runs the cluster path.

v4rl does not grow its own Megatron trainer (upstream megatron-core has no DeepSeek-V4 attention or
sqrtsoftplus router); it drives the engine the seed ran, in either DeepSeek-V4 generation (Miles main 31f1ca961
with Megatron-LM miles-main 2e64d788b, or Miles e9e19b223 with Megatron-LM 6184c094a: `MILES_PINS`; which one a
checkout is, generation.py reads from its code). This package
  - builds the whole job itself (`build_command`): the `train.py` argv from the preset, the planner's layout,
    the checkpoint's config.json (model_args.py) and the profile, and every rank's runtime env (env.py), with
    our torch_dist as --ref-load and Miles' own saves in --load/--save;
  - submits it to the existing Ray cluster (`ray job submit --address $RAY_ADDRESS`, submit.py) and runs it
    (runner.py): streaming its log into a callback and a log file, killing it when it prints nothing for
    `idle_timeout_s` or runs past `timeout_s`, and stopping the submitted Ray job too;
  - checks the job against the user's Miles before anything is submitted (preflight.py: Miles' own
    parse_args on CPU) and against Miles' own launcher (launcher_compare.py);
  - derives the pipeline's jobs from it (jobs.py: the run's one training job, Miles' eval-only run, the alignment
    gate's train-only debug run);
  - reads its checkpoints (`iter_XXXXXXX/`, `latest_checkpointed_iteration.txt`, the data cursor) by Miles' own
    resume rules, repairing a tracker a crash left behind (checkpoints.py), and parses its metric lines
    (`np.float64(...)` values, Miles' own names: metrics.py) into the run directory tiny-cpu writes
    (results.py: metrics.jsonl, eval/step_XXXXXX.json);
  - keeps the seed's launcher command for the PR-head Miles that accepts it (pr_launcher.py).
The Miles run itself needs GPUs (tests marked `gpu`); everything else is plain Python, tested on CPU.
"""

from engines.miles.checkpoints import (TRACKER, MilesCheckpoint, MilesCheckpointError, Resume, data_cursor_path,
                                             find_resume, list_checkpoints, prepare_resume, read_tracker, write_tracker)
from engines.miles.command import (ENTRYPOINT, MILES_PIN, MilesCommand, MilesJob, build_command,
                                         default_run_id, parse_flags, with_paths)
from engines.miles.metrics import MetricRecord, eval_datasets, parse_metric_line, to_v4rl_metrics
from engines.miles.model_args import ModelConfigError, model_args, read_config
from engines.miles.pr_launcher import PR_HEAD, launcher_argv
from engines.miles.results import MilesRecorder, MilesResultsError, eval_result, record_lines, record_log
from engines.miles.runner import (MilesOutcome, MilesRunError, MilesTimeout, PreparedJob, prepare_job, run_job,
                                        run_miles, stop_ray_job)
from engines.miles.submit import runtime_env_json, submit_argv
from engines.miles.train_args import megatron_parallel_args

__all__ = ["ENTRYPOINT", "MILES_PIN", "PR_HEAD", "TRACKER", "MetricRecord", "MilesCheckpoint", "MilesCheckpointError",
           "MilesCommand", "MilesJob", "MilesOutcome", "MilesRecorder", "MilesResultsError", "MilesRunError",
           "MilesTimeout", "ModelConfigError", "PreparedJob", "Resume", "build_command", "data_cursor_path",
           "default_run_id", "eval_datasets", "eval_result", "find_resume", "launcher_argv", "list_checkpoints",
           "megatron_parallel_args", "model_args", "parse_flags", "parse_metric_line", "prepare_job",
           "prepare_resume", "read_config", "read_tracker", "record_lines", "record_log", "run_job", "run_miles",
           "runtime_env_json", "stop_ray_job", "submit_argv", "to_v4rl_metrics", "with_paths", "write_tracker"]
