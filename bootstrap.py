"""Create a run's missing inputs before training: the CPU demo's one-command start.

On a fresh clone nothing can be downloaded, so configs/cpu_demo.yaml names the commands that make what is
missing: a CountDown dataset (countdown_task.py generate), a tiny random base model (tiny_model.py)
and its SFT warm-up (train_sft.py). Each runs only if its output does not exist yet, so a rerun goes
straight to GRPO.

The bootstrap builds only at the paths its own section names (`data_dir`, `model_dir`). Elsewhere a
Hub id is fetched (hub.py), and a model or data directory that is missing (a typo in
`--set model.dir=...`, a GSM8K directory, a real model) stops the run with the command that fetches
or generates it, before anything is built.
"""

import contextlib
import logging
import re
import shlex
import shutil
import sys
from pathlib import Path

import checkpoint
import config as config_lib
import inputs
from config import BootstrapConfig, MissingInputError, ModelSetup, TaskConfig  # noqa: F401 (MissingInputError: bootstrap's error)

logger = logging.getLogger("bootstrap")


def prepare_missing_inputs(config: BootstrapConfig, task: TaskConfig, model: ModelSetup | None,
                           max_prompt_len: int | None = None) -> None:
    """Generate task.data_dir, then build the base model and SFT it into model.dir, where missing and
    named by the bootstrap section; `model` None: no model needed (resuming from a checkpoint).
    max_prompt_len (rollout.max_prompt_len) is checked against the base model's tokenizer before any data
    is generated or the warm-up runs, so a prompt limit nothing fits costs a second, not the warm-up.
    The run's own inputs were checked by its plan (train.plan_run), which also says what is missing."""
    import countdown_task
    import tiny_model
    from training_run import RunStopped
    from train_sft import train_sft

    sft_config = None
    if model is not None and not Path(model.dir).exists():
        sft_config = config_lib.warm_up_config(config, task, model.dir)
        builds_base = bool(config.base_model_args) and not Path(sft_config.model.dir).exists()
        if builds_base:
            logger.info("building the base model %s", sft_config.model.dir)
            tiny_model.main(["--out", sft_config.model.dir, *shlex.split(config.base_model_args)])
        with _removed_on_error(Path(sft_config.model.dir)) if builds_base else contextlib.nullcontext():
            inputs.check_model_and_data(None, sft_config.model)  # a base model given by Hub id: fetched
            _check_shortest_prompt(config, task, Path(sft_config.model.dir), max_prompt_len)
    if config.builds_data(task) and not Path(task.data_dir).exists():
        logger.info("generating the CountDown dataset %s", task.data_dir)
        countdown_task.main(["generate", "--out", task.data_dir, *shlex.split(config.dataset_args)])
    if sft_config is not None:
        sft_config.run_name, interrupted = warm_up_run(sft_config)
        logger.info("SFT warm-up: %s -> %s, run %s%s", sft_config.model.dir, model.dir, sft_config.run_name,
                    f", continuing from {interrupted}" if interrupted else "")
        try:
            train_sft(sft_config, resume=interrupted and str(interrupted))
        except RunStopped as stop:  # rerunning the user's command finishes the warm-up, then trains
            stop.continue_with(rerun_hint())
            raise


def warm_up_run(sft_config) -> tuple[str, Path | None]:
    """The warm-up's run name, after its output (`sft-<output_dir>`, then `-2`, `-3`, ...), and the checkpoint
    it continues from: that of a warm-up of this output that was stopped before it ended and was made as this
    one is (model, data, seed). Else the first of those names an earlier run has not used: no warm-up's
    checkpoints or curves are ever reused by another or replaced."""
    base = sft_config.run_name or warm_up_name(sft_config.output_dir)
    identity = checkpoint.run_identity(config_lib.to_dict(sft_config))
    names = [base]
    while checkpoint.holds_a_run(*run_directories(sft_config, names[-1])):
        names.append(f"{base}-{len(names) + 1}")
    for name in reversed(names[:-1]):  # the newest first
        run_dir = run_directories(sft_config, name)[0]
        latest = checkpoint.latest_resumable(run_dir)
        if latest and not checkpoint.is_finished(run_dir) and checkpoint.run_identity(
                config_lib.read_yaml(latest / checkpoint.RUN_CONFIG)) == identity:
            return name, latest
    return names[-1], None


def warm_up_name(output_dir: str) -> str:
    """`sft-` and the output's path (from here, if inside), one word: artifacts/cpu-demo/sft-model ->
    sft-artifacts-cpu-demo-sft-model."""
    absolute = Path(output_dir).absolute()
    path = absolute.relative_to(Path.cwd()) if absolute.is_relative_to(Path.cwd()) else absolute
    return "sft-" + re.sub(r"[^A-Za-z0-9._]+", "-", str(path)).strip("-")


def run_directories(sft_config, name: str) -> tuple[Path, Path]:
    return Path(sft_config.checkpoint.dir) / name, Path(sft_config.logging.log_dir) / name


def rerun_hint() -> str:
    """The command that goes on after a stopped warm-up: the user's own train.py command again."""
    if Path(sys.argv[0]).name == "train.py":
        return f"uv run {shlex.join(['train.py', *sys.argv[1:]])} (the same command: it finishes the warm-up, then trains)"
    return "the same train.py command again (it finishes the warm-up, then trains)"


def _check_shortest_prompt(config: BootstrapConfig, task: TaskConfig, tokenizer_dir: Path,
                           max_prompt_len: int | None) -> None:
    """Refuse a rollout.max_prompt_len that even the shortest prompt the bootstrap's dataset can hold exceeds."""
    if max_prompt_len is None or not config.builds_data(task) or Path(task.data_dir).exists():
        return  # existing data: train.py checks its first prompts as it loads them, in a second
    import countdown_task
    from tokenizer import Tokenizer

    args = countdown_task.command_line_parser().parse_args(
        ["generate", "--out", task.data_dir, *shlex.split(config.dataset_args)])
    shortest = len(countdown_task.shortest_prompt(Tokenizer(tokenizer_dir), args, task.question_last))
    config_lib.check(shortest <= max_prompt_len, "rollout.max_prompt_len", f"even the shortest prompt of the "
                     f"bootstrap's dataset has {shortest} tokens: raise it to at least {shortest}", max_prompt_len)


@contextlib.contextmanager
def _removed_on_error(directory: Path):
    """Remove `directory` (just built) if the block raises: a refused run leaves nothing behind."""
    try:
        yield
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
