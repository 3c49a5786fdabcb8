"""One training run's life, the same for train.py (GRPO) and train_sft.py, in this order:

    run = TrainingRun(plan, script="train.py")  # the process set up; plan: train.plan_run, every input checked
    run.claim()                         # rank 0 owns the run's checkpoint and log directories
    with run.loading():                 # a refusal here releases the claim: no lock or empty directory is left
        ...tokenizer, data, model, optimizer...
        run.restore(model, optimizer)   # resuming: optimizer and random states; run.start_step
    run_logger = run.open_logger()      # TensorBoard, and the config beside the checkpoints (rank 0)
    for step in run.steps(num_steps):   # start_step + 1 .. num_steps, the steps are numbered from 1
        ...the step...
        run.end_step(step, model, optimizer)  # counted; checkpointed when due, always when stopped
    run.finish()                        # marked finished and released, or RunStopped naming the --resume

Ctrl-C or SIGTERM during `steps` ends the run after its current step, once that step is saved; a second
signal stops at once. A checkpoint's trainer state holds the optimizer, every rank's random states and the step.
"""

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Iterator, NoReturn

import torch

import checkpoint
import config as config_lib
import distributed
from config import SFTConfig, TrainConfig
from run_logging import RunLogger, progress_bar
from runtime import rng_state, set_rng_state, set_up_process

logger = logging.getLogger("training_run")


class TrainingRun:
    """See the module's docstring for the order of the calls.

    plan: the start's checkpoint.RunPlan. script: the entry point, named in the command that resumes a stopped
    run. checkpoint_last_step: whether the last step is written as a checkpoint (GRPO); SFT writes its result
    to output_dir instead.
    """

    def __init__(self, plan: checkpoint.RunPlan, *, script: str, checkpoint_last_step: bool = True):
        config = plan.config
        self.plan, self.config, self.script, self.checkpoint_last_step = plan, config, script, checkpoint_last_step
        self.device = set_up_process(config.device, config.cpu_threads, config.seed)
        self.checkpoint_dir = plan.checkpoint_dir
        # The weights the run loads: a checkpoint is a complete model directory, except a LoRA run's, whose
        # adapters (adapter_dir) go on model.dir again.
        lora = config.model.lora.enabled
        self.model_dir = Path(config.model.dir) if lora or not self.checkpoint_dir else self.checkpoint_dir
        self.adapter_dir = self.checkpoint_dir / checkpoint.ADAPTER_SUBDIR if lora and self.checkpoint_dir else None
        # The ranks' plans each named a new run after their own clock: rank 0's name is the run's.
        config.run_name = distributed.all_gather(config.run_name)[0]
        self.directory = Path(config.checkpoint.dir) / config.run_name
        self.log_directory = Path(config.logging.log_dir) / config.run_name
        self.run_claim: checkpoint.RunClaim | None = None
        self.run_logger: RunLogger | None = None
        self.start_step = self.last_step = self.num_steps = 0
        self.bar = None  # the step counter, while `steps` runs
        self.stop_request: StopRequest | None = None
        self.stopping = False
        self.progress = config.progress and distributed.is_main_process()

    def claim(self) -> None:
        """Rank 0 owns the run's directories (checkpoint.claim_run)."""
        if distributed.is_main_process():
            self.run_claim = checkpoint.claim_run(self.directory, self.log_directory, bool(self.checkpoint_dir),
                                                  self.plan.overwrite)

    def loading(self):
        """The block that loads the run: if it raises, the claim is released."""
        return checkpoint.released_on_error(self.run_claim)

    def restore(self, model, optimizer, generator: torch.Generator | None = None) -> dict:
        """Resuming: the optimizer's and this rank's random states from the checkpoint; returns its trainer state
        (a new run: {"step": 0})."""
        if not self.checkpoint_dir:
            return {"step": 0}
        state = restore_trainer_state(self.checkpoint_dir, model, optimizer, generator)
        self.start_step = self.last_step = state["step"]
        return state

    def open_logger(self) -> RunLogger | None:
        """Rank 0: the run's logger, and its config written beside the checkpoints (a run stopped before its
        first checkpoint resumes from it) and into the log."""
        if distributed.is_main_process():
            config = self.config
            self.run_logger = RunLogger(config.logging, config.run_name, config_lib.to_dict(config), self.start_step)
            self.directory.mkdir(parents=True, exist_ok=True)
            config_lib.dump(config, self.directory / checkpoint.RUN_CONFIG)
            self.run_logger.text("config", config_lib.to_yaml(config), self.start_step + 1)
        return self.run_logger

    def steps(self, num_steps: int, desc: str) -> Iterator[int]:
        """start_step + 1 .. num_steps, until a signal asks to stop (end_step saves that step first)."""
        self.num_steps = num_steps
        with StopRequest() as self.stop_request:
            # Counted by hand, once a step is done: a stop saves that step, and the last line names it.
            self.bar = progress_bar(desc=desc, total=num_steps, initial=self.start_step, unit="step",
                                    enabled=self.progress)
            try:
                for step in range(self.start_step + 1, num_steps + 1):
                    yield step
                    if self.stopping:
                        return
            finally:
                self.bar.close()

    def end_step(self, step: int, model, optimizer, *, generator: torch.Generator | None = None,
                 extra_state: dict | None = None, done: bool = False) -> None:
        """Count the step and write its checkpoint when due: every checkpoint.interval steps, when a signal asks
        to stop, and the last step (if checkpoint_last_step). `done`: the run ends here anyway (a stop is no stop)."""
        self.last_step = step
        self.bar.update()
        last = step == self.num_steps
        self.stopping = self.stop_request.requested() and not last and not done
        interval = self.config.checkpoint.interval
        due = self.checkpoint_last_step if last else bool(interval) and step % interval == 0
        if self.stopping or due:
            save_checkpoint(self.config, step, model, optimizer, model_dir=self.model_dir, generator=generator,
                            resumable=self.stopping or last, extra_state=extra_state)

    def finish(self) -> None:
        """Close the log and release the run; stopped by a signal, raise RunStopped (with the --resume to go on),
        else mark the run finished."""
        if self.run_logger:
            self.run_logger.close()
        if self.run_claim:
            if not self.stopping:
                checkpoint.mark_finished(self.directory)
            self.run_claim.release()
        if self.stopping:
            raise RunStopped(self.script, self.stop_request.signal, self.last_step, self.directory)


# ----------------------------------------------------------------------------- the trainer state of a checkpoint


def save_checkpoint(config: TrainConfig | SFTConfig, step: int, model, optimizer, *, model_dir,
                    generator: torch.Generator | None = None, resumable: bool = False,
                    extra_state: dict | None = None) -> None:
    """<checkpoint.dir>/<run_name>/step_NNNNNN, with the trainer state to resume from if `resumable` or
    checkpoint.optimizer_state (else weights only). Every rank takes part (FSDP gathers the shards; each
    rank's random states are kept); rank 0 makes room on the disk first (checkpoint.make_room), writes, then
    prunes to checkpoint.keep_last."""
    savable = distributed.savable_model(model)
    trainer_state = None
    if resumable or config.checkpoint.optimizer_state:
        trainer_state = {"step": step, "optimizer": distributed.optimizer_state_dict(model, optimizer),
                         "rng_per_rank": distributed.all_gather({"generator": generator and generator.get_state(),
                                                                 "rng": rng_state()}), **(extra_state or {})}
    if distributed.is_main_process():
        run_directory = Path(config.checkpoint.dir) / config.run_name
        # A LoRA run's checkpoints hold its adapters, and the merged model only when it ends (the last step).
        merged = not config.model.lora.enabled or step == config.optim.num_steps
        tensors = savable.state_dict().values() if merged else savable.adapter_tensors().values()
        weights = {tensor.data_ptr(): tensor for tensor in tensors}  # tied ones once
        try:
            checkpoint.make_room(run_directory, f"step_{step:06d}", tensor_bytes(weights) + tensor_bytes(trainer_state),
                                 config.checkpoint.keep_last)
            path = checkpoint.save(run_directory / f"step_{step:06d}", savable, model_dir, run_config=config,
                                   trainer_state=trainer_state, weights=merged)
        except checkpoint.CheckpointError as error:  # no room, a full disk, a directory gone read-only
            raise checkpoint.CheckpointError(f"{error}; once it can be written, continue the run with "
                                             f"--resume {run_directory}") from None
        logger.info("saved checkpoint %s", path)
        (run_directory / checkpoint.FINISHED).unlink(missing_ok=True)  # a finished run continued: not finished yet
        checkpoint.prune(run_directory, config.checkpoint.keep_last)
    distributed.barrier()  # no rank goes on (and may read it) before the checkpoint is complete


def tensor_bytes(value) -> int:
    """The bytes of the tensors in a state (nested dicts and lists): about what writing it takes on disk."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(item) for item in value)
    return 0


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
    """What the entry points do when stopped: one line on stderr, no traceback, exit 128 + signal."""
    if isinstance(error, RunStopped):
        print(error, file=sys.stderr)
        raise SystemExit(error.exit_code)
    print("interrupted: stopped at once, without saving; --resume continues from the last checkpoint, if any",
          file=sys.stderr)
    raise SystemExit(128 + signal.SIGINT)
