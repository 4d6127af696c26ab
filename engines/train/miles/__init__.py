"""The `miles` training backend: Miles (Megatron actor + SGLang rollout on Ray) runs the cluster path.

v4rl does not grow its own Megatron trainer (upstream megatron-core has no DeepSeek-V4 attention or
sqrtsoftplus router); it drives the engine the seed ran. This module
  - builds the Miles command line from a run preset: the seed's `scripts/amd/run_deepseek_v4.py train` flags
    (`launcher_argv`, reproduced setting by setting in tests) and the Miles `train.py` arguments they map to
    (`train_args`), with our torch_dist as --ref-load and the FP8 HF directory as --hf-checkpoint;
  - runs it as a job on the existing Ray cluster (RAY_ADDRESS, MILES_SCRIPT_EXTERNAL_RAY=1), streaming its log
    line by line into a callback (the Prefect logger) and a log file, killing it when it prints nothing for
    `idle_timeout_s` (a stalled collective) or runs past `timeout_s`, and stopping the submitted Ray job too;
  - reads its checkpoints (`iter_XXXXXXX/`, `latest_checkpointed_iteration.txt`, the data cursor) by Miles' own
    resume rules; repairs a tracker a crash left behind, and fails when Miles silently starts from rollout 0
    after a resume (a known slime/Miles pain);
  - parses its metric lines (`step 12: {'train/pg_loss': ...}`, `np.float64(...)` values) under Miles' own
    names (ours are the same by design; eval is `eval/<dataset>-pass@k`) and writes them into the run
    directory tiny-cpu writes (`results`: metrics.jsonl, eval/step_XXXXXX.json).
The Miles run itself needs GPUs (tests marked `gpu`); everything else is plain Python, tested on CPU.

Modules: `command` (the job and its command lines), `checkpoints` (iter_* directories, tracker, resume),
`metrics` (log line parsing), `results` (records -> run directory), `runner` (run, stream, time out, stop).
"""

from engines.train.miles.checkpoints import (TRACKER, MilesCheckpoint, MilesCheckpointError, Resume, data_cursor_path,
                                             find_resume, list_checkpoints, prepare_resume, read_tracker, write_tracker)
from engines.train.miles.command import (MilesJob, default_run_id, launcher_argv, megatron_parallel_args,
                                         sglang_server_argv, train_args)
from engines.train.miles.metrics import MetricRecord, eval_datasets, parse_metric_line, to_v4rl_metrics
from engines.train.miles.results import MilesRecorder, MilesResultsError, eval_result, record_lines, record_log
from engines.train.miles.runner import MilesOutcome, MilesRunError, MilesTimeout, run_job, run_miles, stop_ray_job

__all__ = ["TRACKER", "MetricRecord", "MilesCheckpoint", "MilesCheckpointError", "MilesJob", "MilesOutcome",
           "MilesRecorder", "MilesResultsError", "MilesRunError", "MilesTimeout", "Resume", "data_cursor_path",
           "default_run_id", "eval_datasets", "eval_result", "find_resume", "launcher_argv", "list_checkpoints",
           "megatron_parallel_args", "parse_metric_line", "prepare_resume", "read_tracker", "record_lines",
           "record_log", "run_job", "run_miles", "sglang_server_argv", "stop_ray_job", "to_v4rl_metrics",
           "train_args", "write_tracker"]
