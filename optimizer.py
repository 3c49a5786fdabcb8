"""AdamW whose moment estimates (and float32 master weights) can live in CPU memory.

Why it exists: full fine-tuning of Qwen2.5-3B on a 24 GB card. AdamW keeps two
fp32 moments per parameter, 3.09e9 * 2 * 4 bytes = 24.7 GB: more than the whole
card before the bf16 weights (6.2 GB), their gradients and activations.
Moving the moments to host RAM trades that GPU memory for PCIe traffic each step.

Master weights (optim.master_weights: float32): bf16 weights cannot take small updates. At lr 1e-5 an Adam
step (about lr per weight) is under half a bf16 ulp for every |w| above ~4e-3, so it rounds away, and
gradients summed in bf16 over many micro-batches lose their small terms the same way. So each low-precision
weight gets a float32 master copy that AdamW updates (on the CPU when offloaded) and the model's weight is
rounded from it, and each micro-batch's gradient is added into a float32 buffer as soon as backward computes
it (Float32Gradients). The bf16 weights stay what the forward, backward and generation compute with.
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
        master_weights: bool = False,
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
        low_precision = [param for group in self.param_groups for param in group["params"]
                         if param.dtype != torch.float32]
        # master_weights: float32 copies and float32 gradient sums for the weights below float32 (None: no such).
        self.float32_gradients = Float32Gradients(low_precision) if master_weights and low_precision else None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One AdamW step for every parameter that has a gradient (others are skipped)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params_with_grad = [(param, grad) for param in group["params"] if (grad := self.gradient(param)) is not None]
            if self.enabled:
                self._step_offloaded(group, params_with_grad)
            elif params_with_grad:
                self._step_on_device(group, params_with_grad)
        return loss

    def gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient AdamW applies to `param`: its float32 sum (master weights), else param.grad."""
        if self.float32_gradients is not None and param in self.float32_gradients.written:
            return self.float32_gradients.buffers[param]
        return param.grad  # None for a low-precision weight under master weights: its hook took the gradient

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.float32_gradients is not None:
            self.float32_gradients.start_step()

    def _step_on_device(self, group: dict[str, Any], params_with_grad: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One functional AdamW over the group's weights, or over their float32 masters (each weight then rounded
        once from its master's result)."""
        targets = [(param, self._master(param)) for param, _ in params_with_grad]
        updated = [param if master is None else master for param, master in targets]
        states = [self._state(param, param.device, param.dtype) for param, _ in params_with_grad]
        _adamw(group, updated, [grad for _, grad in params_with_grad], states)
        for param, master in targets:
            if master is not None:
                param.copy_(master)

    def _step_offloaded(self, group: dict[str, Any], params_with_grad: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """AdamW on the CPU, one piece of one weight at a time (OFFLOAD_PIECE elements): the piece's gradient (and,
        without a master copy, its weights) in host memory, AdamW there on float32, the new weights copied back.
        On a GPU the copies run on a stream of their own, the next piece's gradient already on its way while this
        piece's AdamW runs, the new weights going back without blocking, through two pairs of pinned buffers that
        serve every piece of every step."""
        pieces = [(param, grad, start, self._master(param)) for param, grad in params_with_grad
                  for start in range(0, param.numel(), OFFLOAD_PIECE)]
        if not pieces:
            return
        staging = HostStaging(self, pieces[0][0].device)
        param, grad, start, master = pieces[0]
        incoming = staging.fetch(param, grad, start, with_weights=master is None, slot=0)
        for index, (param, grad, start, master) in enumerate(pieces):
            host_grad, host_weights = incoming
            if index + 1 < len(pieces):  # the next piece's copies, queued before this piece's AdamW runs
                next_param, next_grad, next_start, next_master = pieces[index + 1]
                incoming = staging.fetch(next_param, next_grad, next_start, with_weights=next_master is None,
                                         slot=(index + 1) % 2)
            staging.wait(index % 2)
            state = self._state(param, torch.device("cpu"), torch.float32)
            end = min(start + OFFLOAD_PIECE, param.numel())
            # The master's piece, else the weights upcast: host_weights itself when they are float32.
            updated = master.view(-1)[start:end] if master is not None else host_weights.float()
            piece_state = {"step": state["step"].clone(), "exp_avg": state["exp_avg"].view(-1)[start:end],
                           "exp_avg_sq": state["exp_avg_sq"].view(-1)[start:end]}
            _adamw(group, [updated], [host_grad.float()], [piece_state])
            if end == param.numel():  # every piece took the same step: it counts once
                state["step"] += 1
            staging.send_back(updated, param.view(-1)[start:end], slot=index % 2)
        staging.finish()

    def _master(self, param: torch.Tensor) -> torch.Tensor | None:
        """The float32 master copy of a low-precision weight under master weights (None: none), made from the
        weight at its first step, where its moments live."""
        if self.float32_gradients is None or param.dtype == torch.float32:
            return None
        state = self._state(param, torch.device("cpu") if self.enabled else param.device, torch.float32)
        if "master" not in state:
            state["master"] = param.detach().to(state["exp_avg"].device, torch.float32, copy=True)
        return state["master"]

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
                    for key in ("step", "exp_avg", "exp_avg_sq", "master") if key in saved_state[saved_id]
                }


class Float32Gradients:
    """Gradients of low-precision weights summed in float32: backward hands each such parameter's gradient (one
    micro-batch's, in bf16) to `add` as soon as it is computed (a post-accumulate-grad hook), which adds it into
    the parameter's float32 buffer and frees it. Micro-batches then add up in float32, and at most one
    parameter's bf16 gradient exists at a time, beside the float32 buffers.

    On a CPU the buffers are made once and overwritten by each step's first gradient, not freed and made again.
    glibc's heap kept freed buffers without handing them back out among the next step's activations of other
    lengths, so the SmolLM2 search warm-up in bf16 grew by ~0.3 GB a step and peaked at 8.2 GB in 40 steps; with
    the buffers kept, 4.7 GB (float32: 4.1 GB). On a GPU they are freed after each step: the caching allocator
    reuses the blocks, and the rollout needs the room (Qwen2.5-3B's sums are 12.4 GB)."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.buffers: dict[torch.Tensor, torch.Tensor] = {}
        self.written: set[torch.Tensor] = set()  # the parameters whose buffer holds this step's sum
        self.keep_buffers = all(param.device.type == "cpu" for param in params)
        for param in params:
            param.register_post_accumulate_grad_hook(self.add)

    def add(self, param: torch.Tensor) -> None:
        if param not in self.buffers:
            self.buffers[param] = param.grad.float()
        elif param in self.written:
            self.buffers[param].add_(param.grad)
        else:
            self.buffers[param].copy_(param.grad)
        self.written.add(param)
        param.grad = None

    def every_buffer(self) -> list[torch.Tensor]:
        """A buffer for every parameter, in order (zeros where no micro-batch reached it): what ranks sum."""
        for param in self.params:
            if param not in self.buffers:
                self.buffers[param] = torch.zeros_like(param, dtype=torch.float32)
            elif param not in self.written:
                self.buffers[param].zero_()
            self.written.add(param)
        return [self.buffers[param] for param in self.params]

    def start_step(self) -> None:
        """The next gradient of each parameter starts its sum."""
        self.written.clear()
        if not self.keep_buffers:
            self.buffers.clear()


# Elements of a weight the offloaded step moves and updates at once: its pinned buffers' size (64 MB of float32
# gradients per slot), whatever the largest weight (Qwen2.5-3B's embedding: 311M).
OFFLOAD_PIECE = 1 << 24


class HostStaging:
    """The offloaded step's traffic between the weights' device and the CPU, for pieces of weights.

    On a GPU: a copy stream (after the compute stream's gradients), two slots of pinned buffers kept by the
    optimizer across steps, and an event per slot for the copies in. Slot i's buffers are refilled only after
    slot i's copy back was queued on the same stream, so the stream's order keeps them apart. On a CPU the
    pieces are views of the tensors themselves and nothing moves.
    """

    def __init__(self, optimizer: "MemoryEfficientAdamW", device: torch.device):
        self.gpu = device.type == "cuda"
        self.events: list = [None, None]
        if self.gpu:
            self.stream = torch.cuda.Stream(device)
            self.stream.wait_stream(torch.cuda.current_stream(device))  # the gradients are complete
            self.compute_stream = torch.cuda.current_stream(device)
            if not hasattr(optimizer, "_pinned"):
                optimizer._pinned = [{}, {}]
            self.pinned = optimizer._pinned

    def buffer(self, slot: int, role: str, dtype: torch.dtype, count: int) -> torch.Tensor:
        key = (role, dtype)
        if key not in self.pinned[slot]:
            self.pinned[slot][key] = torch.empty(OFFLOAD_PIECE, dtype=dtype, pin_memory=True)
        return self.pinned[slot][key][:count]

    def fetch(self, param: torch.Tensor, grad: torch.Tensor, start: int, *, with_weights: bool, slot: int):
        """(gradient piece, weights piece or None) in host memory; on a GPU still arriving until wait(slot)."""
        end = min(start + OFFLOAD_PIECE, param.numel())
        grad_piece, weights_piece = grad.view(-1)[start:end], param.view(-1)[start:end]
        if not self.gpu:
            return grad_piece, weights_piece if with_weights else None
        with torch.cuda.stream(self.stream):
            host_grad = self.buffer(slot, "gradient", grad.dtype, end - start).copy_(grad_piece, non_blocking=True)
            host_weights = None
            if with_weights:
                host_weights = self.buffer(slot, "weights", param.dtype, end - start).copy_(weights_piece,
                                                                                            non_blocking=True)
            self.events[slot] = torch.cuda.Event()
            self.events[slot].record(self.stream)
        return host_grad, host_weights

    def wait(self, slot: int) -> None:
        if self.events[slot] is not None:
            self.events[slot].synchronize()

    def send_back(self, updated: torch.Tensor, weights_piece: torch.Tensor, slot: int) -> None:
        """The piece's new weights (rounded to the weights' dtype once, from float32) into the weights."""
        if not self.gpu:
            if updated.data_ptr() != weights_piece.data_ptr():
                weights_piece.copy_(updated)
            return
        outgoing = self.buffer(slot, "weights", weights_piece.dtype, updated.numel())
        outgoing.copy_(updated)
        with torch.cuda.stream(self.stream):
            weights_piece.copy_(outgoing, non_blocking=True)

    def finish(self) -> None:
        """The compute stream waits for the new weights before it reads them."""
        if self.gpu:
            self.compute_stream.wait_stream(self.stream)


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
                                weight_decay=config.weight_decay, enabled=config.memory_efficient_adamw,
                                master_weights=config.master_weights == "float32")
