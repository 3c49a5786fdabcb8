"""Where a run's curves go: TensorBoard always, Weights & Biases when asked for."""

import html
import logging
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from tqdm import tqdm

from config import LoggingConfig

logger = logging.getLogger(__name__)
PROGRESS_LINE_SECONDS = 30.0  # off a terminal, a long stage reports at most this often


def log_to_console(level: int = logging.INFO) -> None:
    """The entry points' log lines on stderr: time and message."""
    logging.basicConfig(level=level, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", handlers=[AboveBars()])


class AboveBars(logging.StreamHandler):
    """Log lines to stderr through tqdm.write: on a terminal they go above the progress bars, not across them."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def progress_bar(iterable: Iterable | None = None, *, desc: str, total: int | None = None, initial: int = 0,
                 unit: str = "it", enabled: bool = True, leave: bool = True):
    """The progress of a long stage, with tqdm's interface (iterate, update, set_postfix, close); `initial`:
    the units done before (a resumed run's steps), counted in the total but not in the rate.

    On a terminal, a tqdm bar. Elsewhere (a log file, a pipe) redraws would fill the file, so a plain log
    line every PROGRESS_LINE_SECONDS with done/total, rate and ETA; a stage that ends sooner prints nothing.
    Nothing at all when not `enabled` (the config's `progress: false`, or a rank other than 0).
    """
    if enabled and sys.stderr.isatty():
        return tqdm(iterable, desc=desc, total=total, initial=initial, unit=unit, leave=leave)
    return ProgressLines(iterable, desc=desc, total=total, initial=initial, unit=unit, enabled=enabled, leave=leave)


class ProgressLines:
    """progress_bar off a terminal: one log line per PROGRESS_LINE_SECONDS, at the update that crosses it."""

    def __init__(self, iterable: Iterable | None, *, desc: str, total: int | None, initial: int, unit: str,
                 enabled: bool, leave: bool):
        self.iterable, self.desc, self.unit, self.enabled, self.leave = iterable, desc, unit, enabled, leave
        self.total = total if total is not None or not hasattr(iterable, "__len__") else len(iterable)
        self.n, self.initial, self.postfix, self.printed = initial, initial, "", False
        self.start = self.last_line = time.monotonic()

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update()
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self.enabled and now - self.last_line >= PROGRESS_LINE_SECONDS:
            self.last_line, self.printed = now, True
            logger.info(self.line(now - self.start))

    def set_postfix(self, **values) -> None:
        self.postfix = "".join(f" | {key} {value}" for key, value in values.items())

    def close(self) -> None:
        """A stage that reported ends with a line of its totals (unless leave=False, as tqdm clears its bar)."""
        if self.printed and self.leave:
            logger.info(self.line(time.monotonic() - self.start, done=True))
        self.printed = False

    def line(self, elapsed: float, done: bool = False) -> str:
        rate = (self.n - self.initial) / max(elapsed, 1e-9)
        speed = f"{rate:.2f} {self.unit}/s" if rate >= 1 else f"{1 / rate:.1f} s/{self.unit}" if rate else "-"
        if self.total is None:
            return f"{self.desc}: {self.n} {self.unit} | {speed} | elapsed {tqdm.format_interval(elapsed)}{self.postfix}"
        head = f"{self.desc}: {self.n}/{self.total} ({100 * self.n / max(self.total, 1):.0f}%) | {speed}"
        if done:
            return f"{head} | took {tqdm.format_interval(elapsed)}{self.postfix}"
        eta = tqdm.format_interval((self.total - self.n) / rate) if rate else "?"
        return f"{head} | elapsed {tqdm.format_interval(elapsed)} | ETA {eta}{self.postfix}"


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
