"""What a process of train.py, train_sft.py or evaluate.py sets up for itself: its device, CPU threads and
seeds (and the random states a checkpoint keeps), the model in its dtype, and the seeded order of the data.
The life of a training run (claim, resume, steps, checkpoints, stop) is training_run.py's."""

import ctypes
import os
import random
import re
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

import config as config_lib
import distributed
import inputs
from config import ModelSetup
from qwen2_model import Transformer, read_adapter_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# CPU instruction sets with bf16 matrix products; without them oneDNN converts bf16 to float32 on the way and a
# bf16 matmul runs no faster than a float32 one (docs/lora.md).
BF16_MATMUL_FLAGS = ("avx512_bf16", "amx_bf16")


# The oldest NVIDIA driver branch each CUDA major runs on (NVIDIA's minor-version compatibility table).
MIN_DRIVER_FOR_CUDA = {11: 450, 12: 525, 13: 580}
CPU_DEMO = "on a machine without a GPU, run the CPU demo: uv run train.py --config configs/cpu_demo.yaml"


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present, else the CPU; asking for a device this machine lacks is a config error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise config_lib.ConfigError(f"device: {name} was requested but CUDA is not usable: {cuda_unusable_reason()}")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise config_lib.ConfigError(f"device: {name} was requested but only {torch.cuda.device_count()} CUDA GPU(s) "
                                     f"are visible (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise config_lib.ConfigError("device: mps was requested but this machine has no Apple GPU; use device: auto or cpu")
    return device


def cuda_unusable_reason(driver: str | None = None) -> str:
    """Why torch cannot use a GPU here, and what to do; `driver`: the NVIDIA driver's version (default: the
    loaded one's)."""
    built_for = torch.version.cuda  # None: a torch built without CUDA
    if built_for is None:
        return (f"this torch ({torch.__version__}) is built without CUDA; `uv sync --locked` installs the locked "
                f"one, or {CPU_DEMO}")
    driver = driver or nvidia_driver_version()
    if driver is None:
        return f"no NVIDIA driver is loaded (no /proc/driver/nvidia/version), so no GPU is visible; {CPU_DEMO}"
    needed = MIN_DRIVER_FOR_CUDA.get(int(built_for.split(".")[0]))
    if needed and int(driver.split(".")[0]) < needed:
        return (f"the NVIDIA driver is {driver}, and this torch ({torch.__version__}, built for CUDA {built_for}) "
                f"needs a driver >= {needed}: update the driver (docs/gpu.md), or {CPU_DEMO}")
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None:
        return f"CUDA_VISIBLE_DEVICES={hidden!r} may hide the GPUs from this process: unset it or name one (0, 1, ...)"
    return (f"the NVIDIA driver {driver} is new enough for CUDA {built_for}, but torch finds no GPU: `nvidia-smi` "
            f"shows what the driver sees; {CPU_DEMO}")


def nvidia_driver_version(version_file: Path = Path("/proc/driver/nvidia/version")) -> str | None:
    """The loaded NVIDIA kernel driver's version ('580.65.06'), or None when none is loaded."""
    try:
        text = Path(version_file).read_text()
    except OSError:
        return None
    match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return match and match.group(1)


def set_up_process(device: str, cpu_threads: int | None, seed: int) -> torch.device:
    """This rank's device; CPU threads set and every global random generator seeded."""
    rank_device = distributed.rank_device(resolve_device(device))
    set_up_cpu(cpu_threads)
    seed_everything(seed)
    return rank_device


def set_up_cpu(cpu_threads: int | None) -> None:
    """CPU threads, and large CPU tensors on 2 MiB pages.

    Tiny models gain nothing from several threads, and oversubscribed cores slow torch down by 10x or more when
    another program is busy, so the CPU demo runs single-threaded.
    glibc's heap keeps freed activations and cannot reuse them for the next micro-batch's other lengths. With
    torch's THP_MEM_ALLOC_ENABLE, tensors of 2 MiB or more are page-aligned and advised onto huge pages, and the
    SmolLM2 search-KL recipe's GRPO step peaks ~0.5 GB lower, step times overlapping, though a float32 LoRA step
    peaks ~0.1 GB higher (docs/performance.md). torch reads the variable at its first large allocation, so this runs
    before any weight loads; a user's own setting wins (THP_MEM_ALLOC_ENABLE=0 turns it off)."""
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    if sys.platform == "linux":
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


@lru_cache(maxsize=1)
def _glibc():
    """The C library when it is glibc, else None (musl, macOS and Windows have no malloc_trim)."""
    if sys.platform != "linux":
        return None
    libc = ctypes.CDLL(None)  # the libraries this process has loaded, the C library among them
    return libc if hasattr(libc, "malloc_trim") else None


def release_freed_cpu_memory(device: torch.device) -> None:
    """Give the system back the pages glibc's heap holds for freed CPU tensors.

    An update frees its activations, but glibc keeps their pages (~0.6 GB for the SmolLM2 recipe's float32 LoRA
    update), and a rollout's KV cache is then mapped on top of them: the GRPO stage's peak is that sum. Called
    before each rollout (rollout.release_cpu_memory), the peak is the larger of the two instead
    (docs/performance.md). CUDA memory is the caching allocator's, which reuses it."""
    libc = _glibc()
    if device.type == "cpu" and libc is not None:
        libc.malloc_trim(0)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def model_dtype(name: str, device: torch.device) -> torch.dtype:
    """model.dtype as a torch dtype. auto: bfloat16 on a GPU and on a CPU with bf16 matrix instructions (the
    update's and the sampler's matmuls 2-4x faster there), float32 on any other CPU or device."""
    if name != "auto":
        return DTYPES[name]
    fast_bf16 = device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16_matmul())
    return torch.bfloat16 if fast_bf16 else torch.float32


@lru_cache(maxsize=1)
def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (/proc/cpuinfo's flags; False where there is none)."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    return bool(flags & set(BF16_MATMUL_FLAGS)) and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def load_model(setup: ModelSetup, device: torch.device, model_dir=None) -> Transformer:
    """The model of `model_dir` (default: setup.dir) on `device`, in the configured dtype. A LoRA adapter (a PEFT
    adapter directory, or a LoRA run's checkpoint before its last step) is the model it stands for: its base model
    with the adapter merged into the weights."""
    model_dir = Path(model_dir or setup.dir)
    adapter = inputs.adapter_dir(model_dir)
    weights_dir = inputs.weights_dir(model_dir)
    inputs.read_hf_config(weights_dir)  # what from_pretrained reads, each mistake named with its fix
    inputs.weight_files(weights_dir)
    try:
        model = Transformer.from_pretrained(weights_dir, device=device, dtype=model_dtype(setup.dtype, device))
        if adapter:
            merge_adapter(model, adapter)
    except SafetensorError as error:  # its message names no file: find the one that is damaged
        files = sorted([*weights_dir.glob("*.safetensors"), *(adapter.glob("*.safetensors") if adapter else [])])
        damaged = next((file for file in files if not _readable(file)), model_dir)
        raise config_lib.DataError(f"{damaged} cannot be read ({error}): truncated or damaged; copy or download it "
                                   f"again, or resume from another checkpoint") from None
    model.gradient_checkpointing = setup.gradient_checkpointing
    return model


def merge_adapter(model: Transformer, adapter: Path) -> None:
    """The LoRA adapter in `adapter` folded into the model's weights."""
    try:
        saved = read_adapter_config(adapter)
        model.add_adapters(saved["r"], saved["lora_alpha"], saved["target_modules"])
        model.load_adapter(adapter)
    except ValueError as error:  # settings or tensors this model cannot take
        raise config_lib.DataError(str(error)) from None
    model.merge_adapters()


def _readable(safetensors_file: Path) -> bool:
    try:
        with safe_open(safetensors_file, framework="pt"):
            return True
    except SafetensorError:
        return False


def load_policy(setup: ModelSetup, model_dir, device: torch.device, fsdp: bool, *, adapter_dir: Path | None = None,
                seed: int = 0) -> tuple[Transformer, torch.nn.Module]:
    """(model, policy): the model for generation, evaluation and saving, and the module the update runs
    (DDP or FSDP2 under torchrun; see distributed.training_model). With model.lora, the model is frozen and
    carries the adapters that train: new ones (from `seed`), or a resumed run's, read from `adapter_dir`."""
    # FSDP: load on the CPU, and each block moves to the device already sharded.
    shard = fsdp and distributed.is_initialized()
    model = load_model(setup, torch.device("cpu") if shard else device, model_dir)
    if setup.lora.enabled:
        model.add_adapters(setup.lora.rank, setup.lora.alpha, setup.lora.layers, seed=seed)
        if adapter_dir:
            model.load_adapter(adapter_dir)
    return model, distributed.training_model(model, device, fsdp)


@lru_cache(maxsize=4)
def _epoch_permutation(seed: int, epoch: int, num_items: int) -> list[int]:
    return torch.randperm(num_items, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


def step_indices(step: int, count: int, num_items: int, seed: int) -> list[int]:
    """Dataset indices for a step: a fresh shuffle each epoch, and a fixed function of the step,
    so resuming a run needs only the step number."""
    indices = []
    for position in range(step * count, (step + 1) * count):
        epoch, offset = divmod(position, num_items)
        indices.append(_epoch_permutation(seed, epoch, num_items)[offset])
    return indices
