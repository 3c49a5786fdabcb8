"""Multi-GPU and multi-node training with PyTorch's own torch.distributed, launched by torchrun.

Data parallel: every rank holds the whole model, samples its share of the step's questions and
backpropagates its episodes; DDP sums the gradients (`training_model`, `OptimizerStep`). With `fsdp: true`,
FSDP2 (`fully_shard`, one unit per transformer block) shards parameters, gradients and optimizer
state over the ranks instead, and reduce-scatters gradients during backward.

Every helper here is a no-op in a plain single-process run, which never creates a process group.
"""

import os
from contextlib import contextmanager, nullcontext
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from qwen2_model import Transformer

# FSDP's modules (torch.distributed.fsdp, .checkpoint, .tensor) take seconds to import, so they are
# imported inside the functions that run only under a process group: a plain run never pays for them.


def init_from_env() -> None:
    """Join the process group that torchrun describes in the environment; nothing in a plain run."""
    if "WORLD_SIZE" not in os.environ or is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # NCCL for GPU tensors; gloo for the CPU ones (object gathers, count sums, device: cpu runs).
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")


def shutdown() -> None:
    if is_initialized():
        dist.destroy_process_group()


def run_entry_point(main: Callable[[], None]) -> None:
    """Run an entry point's main(): in torchrun's process group if launched by torchrun, else plainly."""
    init_from_env()
    try:
        main()
    finally:
        shutdown()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main_process() -> bool:
    return rank() == 0


def rank_device(device: torch.device) -> torch.device:
    """`cuda` means this rank's own GPU (LOCAL_RANK under torchrun); `cuda:N` would put every rank on one."""
    if device.type != "cuda" or (device.index is not None and world_size() == 1):
        return device
    if device.index is not None:
        raise ValueError(f"device: {device} puts all {world_size()} ranks on one GPU; use device: auto or cuda "
                         "(each rank then takes the GPU of its LOCAL_RANK).")
    return torch.device("cuda", torch.cuda.current_device())


def shard_range(num_items: int) -> range:
    """This rank's contiguous share of `num_items` (shares differ by at most one item)."""
    return range(num_items * rank() // world_size(), num_items * (rank() + 1) // world_size())


def global_sum(value: float) -> float:
    """Sum of a Python number over all ranks (the value itself when single-process)."""
    return global_sums({"value": value})["value"]


def global_sums(values: dict[str, float]) -> dict[str, float]:
    """Sums over all ranks of a dict of numbers, in one collective."""
    if not is_initialized():
        return dict(values)
    # float64 on the CPU (gloo): exact for token counts, and no device synchronisation.
    tensor = torch.tensor([float(v) for v in values.values()], dtype=torch.float64)
    dist.all_reduce(tensor)
    return dict(zip(values, tensor.tolist()))


def global_max(value: float) -> float:
    if not is_initialized():
        return value
    tensor = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def all_gather(value) -> list:
    """Every rank's `value` (any picklable object), in rank order, on every rank."""
    if not is_initialized():
        return [value]
    gathered = [None] * world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def all_ranks(values: list) -> list:
    """Every rank's `values` (lists of picklable objects), one list in rank order, on every rank."""
    return [value for rank_values in all_gather(values) for value in rank_values]


def is_sharded(model: torch.nn.Module) -> bool:
    if not is_initialized():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def training_model(model: Transformer, device: torch.device, fsdp: bool) -> torch.nn.Module:
    """The module whose forward and backward the update runs: under torchrun, DDP over `model` (or
    `model` itself sharded in place by FSDP2); in a plain run, `model`. Generation, evaluation and
    saving keep using `model`."""
    if not is_initialized():
        return model
    if fsdp:
        shard_model(model, device)
        return model
    # Gradients as views into DDP's communication buckets: no second gradient-sized copy in memory.
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  gradient_as_bucket_view=True)
    ddp.register_comm_hook(None, _sum_gradients)
    return ddp


def _sum_gradients(_, bucket):
    # A sum, not DDP's mean: each rank's loss is already divided by the *global* token (or sequence)
    # count, so the ranks' gradients are the pieces of the single-process gradient and add up to it.
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda future: future.value()[0])


class OptimizerStep:
    """Where gradients meet ranks: summed over them (by DDP or FSDP, in backward), clipped, applied.

    Wrap each micro-batch's forward and backward in `micro_batch(last)`: DDP then sums gradients only
    in the step's last backward (the others accumulate locally). FSDP reduce-scatters in every one.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float):
        self.model, self.optimizer, self.max_grad_norm = model, optimizer, max_grad_norm
        self.is_ddp = isinstance(model, DistributedDataParallel)
        # Master weights (optimizer.py): the optimizer sums the gradients in float32, and the ranks sum those sums.
        self.float32_gradients = getattr(optimizer, "float32_gradients", None)
        self.summed = False

    def micro_batch(self, last: bool):
        if self.is_ddp and (not last or self.float32_gradients is not None):
            return self.model.no_sync()
        self.summed = True
        return nullcontext()

    def __call__(self) -> float:
        """Apply the accumulated gradients; returns their norm (over all shards under FSDP) before clipping."""
        if self.float32_gradients is not None:
            return self.step_float32()
        if self.is_ddp and not self.summed:
            # This rank had no micro-batch (all its episodes were filtered out), but the others wait for
            # its share of the sum: a forward and backward with zero loss gives it, as zeros.
            tokens = torch.zeros((1, 1), dtype=torch.long, device=next(self.model.parameters()).device)
            log_probs, _ = self.model(tokens, targets=tokens)
            (log_probs.sum() * 0).backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.summed = False
        return (norm.full_tensor() if is_sharded(self.model) else norm).item()

    def step_float32(self) -> float:
        """The float32 sums summed over the ranks (as DDP would the gradients), clipped as clip_grad_norm_ does,
        applied."""
        gradients = self.float32_gradients.every_buffer()
        if is_initialized():
            for gradient in gradients:
                dist.all_reduce(gradient)
        norm = torch.nn.utils.get_total_norm(gradients)
        torch._foreach_mul_(gradients, (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.item()


def shard_model(model: Transformer, device: torch.device) -> None:
    """FSDP2 over all ranks: one all-gather unit per transformer block, the root holding embeddings,
    final norm and lm_head. Each block's shards move to `device` (this rank's GPU, or the CPU)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if is_sharded(module):
            # Sum, not FSDP's default mean, for the reason in _sum_gradients.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


@contextmanager
def full_parameters(model: torch.nn.Module):
    """Under FSDP: gather every parameter once for the whole block (generation), not per forward.

    Generation runs a forward per token and ranks stop at different lengths; with the parameters held
    whole, those forwards issue no collectives, so ranks need not run the same number of them.
    """
    if not is_sharded(model):
        yield
        return
    units = [module for module in model.modules() if is_sharded(module)]
    for unit in units:
        unit.unshard()
    model.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for block in model.layers:
            block.set_reshard_after_forward(True)
        for unit in units:
            unit.reshard()


def savable_model(model: Transformer) -> Transformer | None:
    """The model to write in the Hugging Face layout: itself, or under FSDP a whole CPU copy gathered
    from the shards on rank 0 (None on other ranks). Every rank must call it under FSDP."""
    if not is_sharded(model):
        return model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main_process():
        return None
    with torch.device("meta"):
        whole = Transformer(model.config, model.hf_config)
        if model.adapter_settings:
            whole.add_adapters(**model.adapter_settings)
    whole.load_state_dict(state, assign=True)
    whole.tie_weights()
    return whole


def optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """optimizer.state_dict(), or under FSDP the whole state gathered from the shards (every rank calls)."""
    # Before the first step (every update so far skipped), torch's FSDP helper would create the state
    # with a zero-gradient step, which counts as an AdamW step: a resumed run would then differ.
    if not is_sharded(model) or not optimizer.state:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """The inverse of optimizer_state_dict: under FSDP each rank keeps its shard of the whole state."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)  # checks the number of weights, not their shapes:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                for name, value in optimizer.state.get(parameter, {}).items():
                    if torch.is_tensor(value) and value.dim() and value.shape != parameter.shape:
                        raise ValueError(f"{name} of shape {tuple(value.shape)} for a weight of shape "
                                         f"{tuple(parameter.shape)}")
        return
    if not state["state"]:  # saved before the first step: a fresh optimizer is that state
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
