"""What the entry points (train.py, train_sft.py, evaluate.py) share: device, dtype, model loading,
seeding, data order, checkpoints of the training state, and stopping on Ctrl-C or SIGTERM."""

import logging
import os
import random
import signal
import sys
import threading
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

import checkpoint
import config as config_lib
import distributed
import inputs
from config import ModelSetup, SFTConfig, TrainConfig
from qwen2_model import Transformer

logger = logging.getLogger("runtime")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present, else the CPU; asking for a device this machine lacks is a config error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise config_lib.ConfigError(f"device: {name} was requested but no CUDA GPU is visible; use device: auto or cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise config_lib.ConfigError(f"device: {name} was requested but only {torch.cuda.device_count()} CUDA GPU(s) "
                                     f"are visible (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise config_lib.ConfigError("device: mps was requested but this machine has no Apple GPU; use device: auto or cpu")
    return device


def set_up_process(device: str, cpu_threads: int | None, seed: int) -> torch.device:
    """This rank's device; CPU threads set and every global random generator seeded."""
    rank_device = distributed.rank_device(resolve_device(device))
    set_cpu_threads(cpu_threads)
    seed_everything(seed)
    return rank_device


def agreed_run_name(prefix: str = "") -> str:
    """A name from the time, the same on every rank: rank 0's clock decides it."""
    return distributed.all_gather(prefix + datetime.now().strftime("%Y%m%d-%H%M%S"))[0]


def set_cpu_threads(cpu_threads: int | None) -> None:
    """Tiny models gain nothing from several threads, and oversubscribed cores slow torch down by 10x
    or more when another program is busy, so the CPU demo runs single-threaded."""
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)


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


def load_model(setup: ModelSetup, device: torch.device, model_dir=None) -> Transformer:
    """The model of `model_dir` (default: setup.dir) on `device`, in the configured dtype."""
    model_dir = Path(model_dir or setup.dir)
    inputs.read_hf_config(model_dir)  # what from_pretrained reads, each mistake named with its fix
    inputs.weight_files(model_dir)
    try:
        model = Transformer.from_pretrained(model_dir, device=device, dtype=DTYPES[setup.dtype])
    except SafetensorError as error:  # its message names no file: find the one that is damaged
        damaged = next((file for file in sorted(model_dir.glob("*.safetensors")) if not _readable(file)), model_dir)
        raise config_lib.DataError(f"{damaged} cannot be read ({error}): truncated or damaged; copy or download it "
                                   f"again, or resume from another checkpoint") from None
    model.gradient_checkpointing = setup.gradient_checkpointing
    return model


def _readable(safetensors_file: Path) -> bool:
    try:
        with safe_open(safetensors_file, framework="pt"):
            return True
    except SafetensorError:
        return False


def load_policy(setup: ModelSetup, model_dir, device: torch.device, fsdp: bool) -> tuple[Transformer, torch.nn.Module]:
    """(model, policy): the model for generation, evaluation and saving, and the module the update runs
    (DDP or FSDP2 under torchrun; see distributed.training_model)."""
    # FSDP: load on the CPU, and each block moves to the device already sharded.
    shard = fsdp and distributed.is_initialized()
    model = load_model(setup, torch.device("cpu") if shard else device, model_dir)
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


# ----------------------------------------------------------------------------- the run directory and its checkpoints


def name_run(config: TrainConfig | SFTConfig, resume: str | None, prefix: str = "") -> None:
    """A resumed run goes on in the directory it was resumed from (its name and parent); a new one
    without a run_name is named after the time."""
    checkpoint.continue_in_resumed_run(config, resume)
    config.run_name = config.run_name or agreed_run_name(prefix)


def save_checkpoint(config: TrainConfig | SFTConfig, step: int, model, optimizer, *, model_dir,
                    generator: torch.Generator | None = None, resumable: bool = False,
                    extra_state: dict | None = None) -> None:
    """<checkpoint.dir>/<run_name>/step_NNNNNN, with the trainer state to resume from if `resumable` or
    checkpoint.optimizer_state (else weights only). Every rank takes part (FSDP gathers the shards; each
    rank's random states are kept); rank 0 writes, then prunes to checkpoint.keep_last."""
    savable = distributed.savable_model(model)
    trainer_state = None
    if resumable or config.checkpoint.optimizer_state:
        trainer_state = {"step": step, "optimizer": distributed.optimizer_state_dict(model, optimizer),
                         "rng_per_rank": distributed.all_gather({"generator": generator and generator.get_state(),
                                                                 "rng": rng_state()}), **(extra_state or {})}
    if distributed.is_main_process():
        run_directory = Path(config.checkpoint.dir) / config.run_name
        try:
            path = checkpoint.save(run_directory / f"step_{step:06d}", savable, model_dir, run_config=config,
                                   trainer_state=trainer_state)
        except checkpoint.CheckpointError as error:  # a full disk, a directory gone read-only
            raise checkpoint.CheckpointError(f"{error}; once it can be written, continue the run with "
                                             f"--resume {run_directory}") from None
        logger.info("saved checkpoint %s", path)
        (run_directory / checkpoint.FINISHED).unlink(missing_ok=True)  # a finished run continued: not finished yet
        checkpoint.prune(run_directory, config.checkpoint.keep_last)
    distributed.barrier()  # no rank goes on (and may read it) before the checkpoint is complete


def restore_trainer_state(checkpoint_dir: Path, model, optimizer, generator: torch.Generator | None = None) -> dict:
    """Load the optimizer and this rank's random states from a checkpoint; returns its trainer state."""
    state = checkpoint.load_trainer_state(checkpoint_dir)
    if len(state["rng_per_rank"]) != distributed.world_size():
        raise ValueError(f"{checkpoint_dir} was written by {len(state['rng_per_rank'])} ranks; resume it with "
                         f"as many (torchrun --nproc_per_node ...), not {distributed.world_size()}.")
    try:
        distributed.load_optimizer_state_dict(model, optimizer, state["optimizer"])
    except (ValueError, KeyError, RuntimeError) as error:  # torch's words name no file and no cause
        raise checkpoint.CheckpointError(
            f"{checkpoint_dir}: its optimizer state does not fit its weights ({error}); the weights were replaced "
            f"after it was saved, or the model's settings differ: resume from another step "
            f"(--resume {checkpoint_dir.parent}/step_...), or start over with --overwrite") from None
    saved_generator = state["rng_per_rank"][distributed.rank()]["generator"]
    if generator is not None and saved_generator is None:  # train.py never writes one without it
        raise checkpoint.CheckpointError(f"{checkpoint_dir} holds no sampling state: it was not written by train.py; "
                                         f"continue it with the trainer that wrote it")
    if generator is not None:
        generator.set_state(saved_generator)
    set_rng_state(state["rng_per_rank"][distributed.rank()]["rng"])
    logger.info("resumed from %s at step %d", checkpoint_dir, state["step"])
    return state


# ----------------------------------------------------------------------------- Ctrl-C and SIGTERM


class RunStopped(Exception):
    """A run stopped by a signal once its step's checkpoint was written; the message says how to go on."""

    def __init__(self, script: str, stop_signal: signal.Signals, step: int, run_directory: Path):
        launcher = f"torchrun --nproc_per_node {distributed.world_size()} " if distributed.world_size() > 1 else ""
        self.stopped = f"stopped by {stop_signal.name} after step {step}, saved in {run_directory / f'step_{step:06d}'}"
        self.continue_with(f"uv run {launcher}{script} --resume {run_directory}")
        self.exit_code = 128 + stop_signal  # the shell's convention: 130 for SIGINT, 143 for SIGTERM

    def continue_with(self, command: str) -> None:
        """Name `command` as the way to go on (a stage inside a larger command: that command)."""
        self.args = (f"{self.stopped}; continue with: {command}",)


class StopRequest:
    """Within `with StopRequest() as stop:`, Ctrl-C (SIGINT) or SIGTERM asks the training loop to stop
    after its current step (`stop.requested()`), so the step's work is saved; a second signal stops at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    warned_sigint_ignored = False

    def __init__(self):
        self.signal: signal.Signals | None = None
        self.previous = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            # An ignored signal stays ignored (SIGINT in a script's background job); None: set outside Python.
            self.previous = {number: signal.signal(number, self.handle) or signal.SIG_DFL for number in self.SIGNALS
                             if signal.getsignal(number) != signal.SIG_IGN}
            if signal.SIGINT not in self.previous and not StopRequest.warned_sigint_ignored:
                StopRequest.warned_sigint_ignored = True  # once a process: train.py's warm-up and GRPO both enter
                logger.warning("Ctrl-C (SIGINT) is ignored by this process (started in the background by a script?); "
                               "SIGTERM (kill %d) still stops the run cleanly after its current step", os.getpid())
        return self

    def __exit__(self, *exception) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)

    def handle(self, number: int, frame) -> None:
        self.signal = signal.Signals(number)
        signal.signal(number, self.previous[number])  # the next one acts at once
        logger.warning("%s: stopping after this step, once it is saved (%s again stops at once, unsaved)",
                       self.signal.name, self.signal.name)

    def requested(self) -> bool:
        """Whether any rank got a signal: every rank stops after the same step (and names the same signal)."""
        number = int(distributed.global_max(float(self.signal or 0)))
        self.signal = signal.Signals(number) if number else None
        return self.signal is not None


def exit_on_interrupt(error: RunStopped | KeyboardInterrupt) -> NoReturn:
    """What the training entry points do when stopped: one line on stderr, no traceback, exit 128 + signal."""
    if isinstance(error, RunStopped):
        print(error, file=sys.stderr)
        raise SystemExit(error.exit_code)
    print("interrupted: stopped at once, without saving; --resume continues from the last checkpoint, if any",
          file=sys.stderr)
    raise SystemExit(128 + signal.SIGINT)
