"""Create a run's missing inputs before training: the CPU demo's one-command start.

On a fresh clone nothing can be downloaded, so config_cpu.yaml names the commands that make what is
missing: a CountDown dataset (countdown_task.py generate), a tiny random base model (tiny_model.py)
and its SFT warm-up (train_sft.py). Each runs only if its output does not exist yet, so a rerun goes
straight to GRPO.

The bootstrap builds only at the paths its own section names (`data_dir`, `model_dir`): a model or
data directory that is missing anywhere else (a typo in `--set model.dir=...`, a GSM8K directory, a
real model) stops the run with the command that fetches or generates it, before anything is built.
"""

import logging
import shlex
from pathlib import Path

import checkpoint
import config as config_lib
from config import BootstrapConfig, TaskConfig

logger = logging.getLogger("bootstrap")


class MissingInputError(config_lib.InputError, FileNotFoundError):
    label = "missing input"


def _same(path: str | None, other: str) -> bool:
    return path is not None and Path(path).resolve() == Path(other).resolve()


def builds_data(config: BootstrapConfig, task: TaskConfig) -> bool:
    return bool(config.dataset_args) and task.name == "countdown" and _same(config.data_dir, task.data_dir)


def builds_model(config: BootstrapConfig, model_dir: str) -> bool:
    return bool(config.sft_config) and _same(config.model_dir, model_dir)


def check_inputs(config: BootstrapConfig, task: TaskConfig | None, model_dir: str | None) -> None:
    """Stop, with the command that makes it, at a missing input the bootstrap does not build
    (None: that input is not needed)."""
    import countdown_task  # here, so a config can be checked before torch loads
    import gsm8k_task
    from qwen2_model import download_hint

    if task is not None and not Path(task.data_dir).exists() and not builds_data(config, task):
        message = (countdown_task.missing_data_message(Path(task.data_dir)) if task.name == "countdown"
                   else f"GSM8K directory {task.data_dir} does not exist; {gsm8k_task.DOWNLOAD_HINT}")
        raise MissingInputError(f"task.data_dir: {message}")
    if model_dir is not None and not Path(model_dir).exists() and not builds_model(config, model_dir):
        raise MissingInputError(f"model.dir: model directory '{model_dir}' does not exist. "
                                + download_hint(Path(model_dir)).replace("\n ", ""))


def prepare_missing_inputs(config: BootstrapConfig, task: TaskConfig, model_dir: str | None) -> None:
    """Generate task.data_dir, then build the base model and SFT it into model_dir, where missing and
    named by the bootstrap section; `model_dir` None: no model needed (resuming from a checkpoint)."""
    check_inputs(config, task, model_dir)
    import countdown_task
    import tiny_model
    from train_sft import SFTConfig, train_sft

    if not Path(task.data_dir).exists():
        logger.info("generating the CountDown dataset %s", task.data_dir)
        countdown_task.main(["generate", "--out", task.data_dir, *shlex.split(config.dataset_args)])
    if model_dir is not None and not Path(model_dir).exists():
        sft_config = config_lib.load(SFTConfig, config.sft_config, [*config.sft_overrides, f"output_dir={model_dir}"])
        sft_config.task = task  # the warm-up learns the task GRPO will train on, from the same data
        if config.base_model_args and not Path(sft_config.model.dir).exists():
            logger.info("building the base model %s", sft_config.model.dir)
            tiny_model.main(["--out", sft_config.model.dir, *shlex.split(config.base_model_args)])
        # A warm-up stopped by Ctrl-C goes on from its checkpoint; else it starts over (its old logs deleted).
        interrupted = sft_config.run_name and checkpoint.latest_resumable(
            Path(sft_config.checkpoint.dir) / sft_config.run_name)
        logger.info("SFT warm-up: %s -> %s%s", sft_config.model.dir, model_dir,
                    f", continuing from {interrupted}" if interrupted else "")
        train_sft(sft_config, resume=interrupted and str(interrupted), overwrite=not interrupted)
