"""`v4rl rehearse`: Miles' own train.py, unmodified, on this CPU machine, with v4rl's engine as its SGLang.

How Miles runs on CPU: a local Ray head with logical GPUs (`ray start --num-gpus N`, ray_session.py); Miles' driver
and every Ray worker start with bootstrap/ first on PYTHONPATH, whose sitecustomize.py injects the CPU stand-ins
(GPU-only imports stubbed, names of Miles' SGLang branch, the accelerator's answers) without touching Miles' files;
`v4rl serve-rollout` on a Miles-legal tiny DeepSeek-V4 (tiny_model.py) is Miles' external SGLang engine; the job
is the cluster preset's, changed where a CPU must differ (job.py, every change a row of the substitution table).
With the head's Jobs API on, Miles' train.py is `ray job submit`ted through the cluster path's own submitter
(submitted.py: stage full with `--submit ray-job`; cluster_run.py: the cluster-rehearsal preset's local cluster,
on which the rl-pipeline runs the cluster path).
"""
