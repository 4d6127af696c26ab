"""transformer_engine.pytorch.optimizers stand-in: TE's FusedAdam as its update math in torch, for Megatron on a CPU.

Why it exists: the cluster's Megatron builds its optimizer from TE's FusedAdam (megatron/core/optimizer/__init__.py,
distrib_optimizer.py: `from transformer_engine.pytorch.optimizers import FusedAdam`), a CUDA kernel
(multi_tensor_adam). Without it Megatron falls back to torch's AdamW, a path whose resume cannot load: the
distributed optimizer's `state_dict()` (distrib_optimizer.py, "non-Apex/TE support") reads a per-parameter `step`
tensor that torch's AdamW creates only at its first step, so `sharded_state_dict(is_loading=True)` on the fresh
optimizer of a resume asserts `len(steps) == 1` on an empty list. TE's FusedAdam keeps its step where Megatron's
TE branch reads it (an int in each param group, absent until the first step, which that branch allows), so with
this stand-in a rehearsal takes the cluster's own save and load path.

What is kept: TE's constructor (`adam_w_mode`, `bias_correction`, `capturable`, ...), its state layout (per
parameter `exp_avg`, `exp_avg_sq` fp32, created at the first step; `step` in the param group, +1 per step for every
group with parameters) and the update of its kernel (transformer_engine/common/multi_tensor/adam.cu), in fp32:
    L2 mode (adam_w_mode=False): g <- g + wd*p
    m <- b1*m + (1-b1)*g;  v <- b2*v + (1-b2)*g^2
    m^ = m / (1 - b1^step), v^ = v / (1 - b2^step)   (bias_correction; else m^ = m, v^ = v)
    u = m^ / (sqrt(v^) + eps)  (+ wd*p in AdamW mode);  p <- p - lr*u
What is not: TE's precision-aware options (master weights, fp16/fp8/bf16 moments, decoupled grads, param
remainders) and capturable mode are refused at construction with one line; the rehearsal's job turns
--use-precision-aware-optimizer off (engines/upstream/rehearsal/job.py). FusedSGD is refused likewise (the job uses adam).
"""

from __future__ import annotations

import torch


class FusedAdam(torch.optim.Optimizer):
    """TE's FusedAdam (fp32 states, no master weights): the kernel's Adam/AdamW update in torch ops."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, bias_correction: bool = True,
                 adam_w_mode: bool = True, capturable: bool = False, master_weights: bool = False,
                 master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 use_decoupled_grad: bool = False, store_param_remainders: bool = False, set_grad_none=None) -> None:
        unsupported = {"amsgrad": amsgrad, "capturable": capturable, "master_weights": master_weights,
                       "use_decoupled_grad": use_decoupled_grad, "store_param_remainders": store_param_remainders,
                       "master_weight_dtype": master_weight_dtype != torch.float32,
                       "exp_avg_dtype": exp_avg_dtype != torch.float32,
                       "exp_avg_sq_dtype": exp_avg_sq_dtype != torch.float32}
        asked = [name for name, on in unsupported.items() if on]
        if asked:
            raise RuntimeError(f"FusedAdam stand-in (v4rl rehearsal, CPU): {', '.join(asked)} not supported; turn "
                               "off --use-precision-aware-optimizer / --optimizer-cuda-graph in the rehearsal job")
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable, self.master_weights, self.use_decoupled_grad = False, False, False

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=True if set_to_none is None else set_to_none)  # TE's default: None grads

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if len(group["params"]) == 0:
                continue  # TE leaves an empty group's step alone (Megatron aligns it on save)
            group["step"] = group.get("step", 0) + 1
            step, (beta1, beta2) = group["step"], group["betas"]
            correction1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
            correction2 = 1 - beta2 ** step if group["bias_correction"] else 1.0
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedAdam does not support sparse gradients.")
                g, param = p.grad.float(), p.float()
                if self.adam_w_mode == 0:
                    g = g + decay * param
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / correction1) / ((v / correction2).sqrt() + eps)
                if self.adam_w_mode == 1:
                    update = update + decay * param
                p.copy_(param - lr * update)
        return loss


class FusedSGD(torch.optim.Optimizer):
    """Imported beside FusedAdam by Megatron (core/optimizer/__init__.py); the rehearsal's job uses adam."""

    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError("FusedSGD stand-in (v4rl rehearsal, CPU): not written; the rehearsal job uses "
                           "--optimizer adam")
