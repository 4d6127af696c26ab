"""The embedded trainer: transformers' DeepseekV4ForCausalLM learning GRPO on CPU (or one GPU), and the run that
drives it against v4rl's rollout server.

  trainer.py         one GRPO step (shared prompt forward, BF16 autocast, fp32 master weights, AdamW)
  hf_model.py        the transformers model from and to v4rl's native weights
  bf16.py            BF16 autocast (with the emulated matmuls on CPUs without native BF16)
  fake_quant.py      the quantization-aware forward (the weights the rollout serves, straight-through gradient)
  storage.py         weights as a checkpoint stores them (FP8 / FP4 round trip, no disk I/O)
  routing_replay.py  rollout routing replay (R3) and train/router_mismatch_frac
  actors.py          the trainer and rollout workers (Ray actors or in-process)
  cluster.py         Ray for a run: a loopback-only local cluster, the actors' placement group
  run.py             `v4rl train`: the GRPO loop (rl/loop.py) with these workers, resumable
  held_out.py        held-out pass@k of a served checkpoint
  bootstrap.py       `v4rl bootstrap`: the tiny base checkpoint

The run directory's bookkeeping is engines/runs; the cluster's Miles job is engines/miles.
"""
