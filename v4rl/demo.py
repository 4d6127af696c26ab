"""`v4rl demo`: the tiny-cpu path as far as it is built.

1. take the tiny DeepSeek-V4 base checkpoint (FP8 + FP4 experts): the committed asset that
   `v4rl bootstrap --seed 0` reproduces byte for byte, or a fresh bootstrap with `--fresh`;
2. load it in our engine and in transformers' reference, sample held-out answers with our engine and
   score the same tokens under both (per-token |Δlogprob|);
3. report held-out pass@1 / pass@8;
4. list the pipeline stages that are not built yet.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

NOT_BUILT = [
    ("convert / verify", "HF FP8 -> Megatron torch_dist BF16 conversion, megatron-core load check"),
    ("serve-rollout", "SGLang-compatible HTTP rollout server with online weight updates"),
    ("align / train", "train-vs-rollout alignment report, GRPO + TIS on Ray"),
    ("pipeline", "Prefect flows, eval subflows, artifact upload, deployments, nightly validation"),
    ("plan", "parallel layout planner, MI355X profile, Miles launch plans"),
]


ASSET = Path(__file__).resolve().parent.parent / "tests" / "assets" / "tiny-base"


def run_demo(workdir: Path, *, seed: int = 0, fresh: bool = False) -> int:
    from engines.rollout.sampling import SamplingParams, generate
    from engines.score import load_ours, load_reference, token_logprobs
    from engines.train.bootstrap import BootstrapConfig, bootstrap, evaluate_pass_at_k
    from rl.math_task import make_splits

    console = Console()
    base = workdir / "base"
    if not fresh and seed == 0 and (ASSET / "bootstrap.json").exists():
        base = ASSET
        console.print(f"[bold]1. base checkpoint[/]: {base} (committed; `v4rl bootstrap --out DIR --seed 0` "
                      "rebuilds it byte for byte in a few minutes; `v4rl demo --fresh` does that here)")
    elif (base / "bootstrap.json").exists() and not fresh:
        console.print(f"[bold]1. base checkpoint[/]: reusing {base}")
    else:
        console.print(f"[bold]1. base checkpoint[/]: bootstrapping the tiny model into {base}")
        bootstrap(base, BootstrapConfig(seed=seed), log=console.print)
    summary = json.loads((base / "bootstrap.json").read_text())

    console.print("[bold]2. our engine vs transformers' reference on the same tokens[/]")
    ours, reference = load_ours(base), load_reference(base)
    tokenizer = _tokenizer(base)
    _, eval_rows = make_splits(0, summary["eval_problems"], summary["seed"])
    prompts = [[tokenizer.bos_token_id] + tokenizer(r["prompt"], add_special_tokens=False).input_ids
               for r in eval_rows[:16]]
    outs = generate(ours, prompts, SamplingParams(temperature=1.0, max_new_tokens=8), n=2, seed=seed,
                    eos_token_id=tokenizer.eos_token_id)
    seqs = [{"prompt_ids": c.prompt_ids, "response_ids": c.output_ids} for group in outs for c in group]
    lp_ours = token_logprobs(ours, seqs, vocab_size=ours.cfg.vocab_size)
    lp_ref = token_logprobs(lambda ids: reference(input_ids=ids).logits, seqs, vocab_size=ours.cfg.vocab_size)
    diffs = torch.tensor([abs(a - b) for x, y in zip(lp_ours, lp_ref) for a, b in zip(x, y)])
    sampled = torch.tensor([lp for group in outs for c in group for lp in c.output_logprobs])
    console.print(f"   {len(seqs)} sampled responses, {diffs.numel()} tokens: |Δlogprob| ours vs reference "
                  f"mean {diffs.mean():.2e} max {diffs.max():.2e}; sampler vs rescoring max "
                  f"{(sampled - torch.tensor([v for x in lp_ours for v in x])).abs().max():.2e}")

    console.print("[bold]3. held-out pass@k of the base model[/] (temperature 1, 8 samples)")
    pass1, pass8, mean_len = evaluate_pass_at_k(ours, tokenizer, eval_rows, n=8, seed=seed)
    console.print(f"   pass@1 {pass1:.3f}  pass@8 {pass8:.3f}  mean response {mean_len:.1f} tokens "
                  f"({len(eval_rows)} problems)")

    table = Table("stage", "status")
    for name, what in NOT_BUILT:
        table.add_row(name, f"[yellow]not built yet[/]: {what}")
    console.print(table)
    return 0


def _tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
