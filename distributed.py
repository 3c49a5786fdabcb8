"""torch.distributed helpers that are no-ops in a plain single-process run."""

import torch
import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main_process() -> bool:
    return rank() == 0


def global_sum(value: float) -> float:
    """Sum of a Python number over all ranks (the value itself when single-process)."""
    if not is_initialized():
        return value
    tensor = torch.tensor(float(value), dtype=torch.float64, device=_device())
    dist.all_reduce(tensor)
    return tensor.item()


def all_reduce_gradients(model: torch.nn.Module) -> None:
    """Sum gradients over ranks.

    Each rank's loss is already divided by the *global* token (or sequence) count, so the sum of
    the ranks' gradients is exactly the single-process gradient.
    """
    if not is_initialized():
        return
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
