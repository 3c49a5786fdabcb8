"""AdamW whose moment estimates live in CPU memory.

Why it exists: full fine-tuning of Qwen2.5-3B on a 24 GB card. AdamW keeps two
fp32 moments per parameter, 3.09e9 * 2 * 4 bytes = 24.7 GB: more than the whole
card before the bf16 weights (6.2 GB), their gradients (6.2 GB) and activations.
Moving the moments to host RAM trades that GPU memory for PCIe traffic each step.
"""

from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch.optim.adamw import adamw
from torch.optim.optimizer import ParamsT

from config import AdamWConfig


class MemoryEfficientAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW with exp_avg / exp_avg_sq kept on the CPU in fp32.

    Scheme (enabled=True): one parameter at a time, copy its weights and gradient
    into pinned CPU staging buffers, run torch's own functional AdamW there in fp32,
    and copy the new weights back with non_blocking. We send back the new weights
    rather than the update (new - old) because then the GPU needs no scratch at
    all: an fp32 update for Qwen2.5-3B's 151936x2048 embedding alone is 1.2 GB of
    device memory. For bf16 weights the PCIe bytes per element are the same
    (2 grad + 2 weight + 2 weight back vs 2 grad + 4 fp32 update), and the weight
    is rounded to bf16 once, from the fp32 result. The moments themselves never
    cross PCIe, so they stay in ordinary pageable memory: pinning 24 GB would lock
    host RAM for no transfer gain; only the staging buffers are pinned.

    enabled=False is plain torch.optim.AdamW: the same functional math on the
    parameters' device, moments in the parameters' dtype.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        enabled: bool = True,
    ) -> None:
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}; pass a non-negative learning rate")
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}; pass a small positive value such as 1e-8")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas must each be in [0, 1), got {betas}; the usual choice is (0.9, 0.999)")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}; use 0.0 to disable it")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.enabled = enabled

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One AdamW step for every parameter that has a gradient (others are skipped)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params_with_grad = [param for param in group["params"] if param.grad is not None]
            if self.enabled:
                for param in params_with_grad:
                    self._step_offloaded(group, param)
            else:
                states = [self._state(param, param.device, param.dtype) for param in params_with_grad]
                _adamw(group, params_with_grad, [param.grad for param in params_with_grad], states)
        return loss

    def _step_offloaded(self, group: dict[str, Any], param: torch.Tensor) -> None:
        state = self._state(param, torch.device("cpu"), torch.float32)
        pin = param.device.type == "cuda"
        grad_fp32 = _staged_on_cpu(param.grad, pin).float()
        staged_param = _staged_on_cpu(param, pin)
        param_fp32 = staged_param.float()  # the same tensor when the weights are fp32
        _adamw(group, [param_fp32], [grad_fp32], [state])
        staged_param.copy_(param_fp32)
        # Safe to let staged_param go out of scope: the pinned caching allocator
        # does not reuse its block until this copy has finished on the stream.
        param.copy_(staged_param, non_blocking=pin)

    def _state(self, param: torch.Tensor, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The parameter's AdamW state, created as torch.optim.AdamW does on first use."""
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, dtype=dtype, device=device, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=dtype, device=device, memory_format=torch.preserve_format)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from this class or torch.optim.AdamW, keeping moments on the CPU when enabled."""
        if not self.enabled:
            super().load_state_dict(state_dict)
            return
        # torch's loader casts every moment to its parameter's device and dtype, which
        # would put all 24 GB of moments on the GPU (and round them to bf16), so the
        # base class only loads the param groups and we place the moments ourselves.
        super().load_state_dict({**state_dict, "state": {}})
        saved_state = state_dict["state"]
        saved_ids = chain.from_iterable(group["params"] for group in state_dict["param_groups"])
        params = chain.from_iterable(group["params"] for group in self.param_groups)
        for saved_id, param in zip(saved_ids, params, strict=True):
            if saved_id in saved_state:
                self.state[param] = {
                    key: saved_state[saved_id][key].to("cpu", torch.float32, copy=True)
                    for key in ("step", "exp_avg", "exp_avg_sq")
                }


def _staged_on_cpu(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """A CPU copy of tensor, in pinned memory when it comes from a GPU (faster DMA both ways)."""
    staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
    staged.copy_(tensor)  # blocking on purpose: the CPU math below needs the values now
    return staged


def _adamw(
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict[str, torch.Tensor]],
) -> None:
    """torch's functional AdamW (the code behind torch.optim.AdamW) for one param group."""
    beta1, beta2 = group["betas"]
    adamw(
        params,
        grads,
        [state["exp_avg"] for state in states],
        [state["exp_avg_sq"] for state in states],
        [],
        [state["step"] for state in states],
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
    )


def new_adamw(params: ParamsT, config: AdamWConfig) -> MemoryEfficientAdamW:
    """AdamW over the parameters that train (a LoRA run's adapters: its frozen weights get no moments)."""
    params = [param for param in params if param.requires_grad]
    return MemoryEfficientAdamW(params, lr=config.learning_rate, betas=config.betas, eps=config.eps,
                                weight_decay=config.weight_decay, enabled=config.memory_efficient_adamw)
