"""Where a run's curves go: TensorBoard always, Weights & Biases when asked for."""

import html
import logging
import sys
from pathlib import Path

from config import LoggingConfig

logger = logging.getLogger(__name__)


def show_progress(requested: bool) -> bool:
    """Progress bars only on a terminal: redirected to a file they are mostly redraws; the log lines stay."""
    return requested and sys.stderr.isatty()
WANDB_STEP = "step"  # the x-axis of every W&B chart


class RunLogger:
    """One call site for scalars and text, fanned out to TensorBoard and optionally W&B."""

    def __init__(self, config: LoggingConfig, run_name: str, run_config: dict, resume_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter  # here, so validating a config stays quick

        self.directory = Path(config.log_dir) / run_name
        # purge_step drops events a crashed run wrote after the checkpoint we resume from.
        self.writer = SummaryWriter(self.directory, purge_step=resume_step + 1 if resume_step else None)
        self.wandb_run = None
        if config.wandb:
            try:
                import wandb
            except ImportError as error:
                raise ImportError("logging.wandb is true but wandb is not installed: run `uv sync --extra wandb`.") from error
            self.wandb_run = wandb.init(project=config.wandb_project, name=run_name, config=run_config, resume="allow")
            # W&B drops rows logged below its own step, which only increases: the config text at step 1 would
            # make it drop the evaluation at step 0. Plotting against our step as a logged value takes any order.
            self.wandb_run.define_metric(WANDB_STEP)
            self.wandb_run.define_metric("*", step_metric=WANDB_STEP)

    def scalars(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log({**values, WANDB_STEP: step})

    def text(self, tag: str, text: str, step: int) -> None:
        # TensorBoard renders text as markdown/HTML; escaping keeps <think> tags visible.
        self.writer.add_text(tag, f"<pre>{html.escape(text)}</pre>", step)
        if self.wandb_run is not None:
            self.wandb_run.log({tag: text, WANDB_STEP: step})

    def close(self) -> None:
        self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
