"""Create a run's missing inputs before training: the CPU demo's one-command start.

On a fresh clone nothing can be downloaded, so config_cpu.yaml names the commands that make what is
missing: a CountDown dataset (countdown_task.py generate), a tiny random base model (tiny_model.py)
and its SFT warm-up (train_sft.py). Each runs only if its output does not exist yet, so a rerun goes
straight to GRPO.
"""

import logging
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import config as config_lib
import countdown_task
import tiny_model
from tasks import TaskConfig
from train_sft import SFTConfig, train_sft

logger = logging.getLogger("bootstrap")


@dataclass
class BootstrapConfig:
    dataset_args: str | None = None  # `countdown_task.py generate` arguments for a missing task.data_dir
    base_model_args: str | None = None  # `tiny_model.py` arguments for a missing SFT base model
    sft_config: str | None = None  # train_sft.py config that produces a missing model.dir
    sft_overrides: list[str] = field(default_factory=list)  # `section.key=value` changes to sft_config


def prepare_missing_inputs(config: BootstrapConfig, task: TaskConfig, model_dir: str) -> None:
    """Generate task.data_dir, then build the base model and SFT it into model_dir, where missing."""
    if config.dataset_args and not Path(task.data_dir).exists():
        logger.info("generating the CountDown dataset %s", task.data_dir)
        countdown_task.main(["generate", "--out", task.data_dir, *shlex.split(config.dataset_args)])
    if config.sft_config and not Path(model_dir).exists():
        sft_config = config_lib.load(SFTConfig, config.sft_config, [*config.sft_overrides, f"output_dir={model_dir}"])
        sft_config.task = task  # the warm-up learns the task GRPO will train on, from the same data
        if config.base_model_args and not Path(sft_config.model.dir).exists():
            logger.info("building the base model %s", sft_config.model.dir)
            tiny_model.main(["--out", sft_config.model.dir, *shlex.split(config.base_model_args)])
        logger.info("SFT warm-up: %s -> %s", sft_config.model.dir, model_dir)
        train_sft(sft_config)
