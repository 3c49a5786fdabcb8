"""Ablation suite: run every config override in a directory as a GRPO run, then tabulate the results.

    uv run ablate.py configs/ablations [--base config.yaml] [--set section.key=value ...] [--out DIR] [--force]

Each DIR/*.yaml holds the keys its experiment sets (an ablation: the one it changes; a preset of
configs/variants: its whole algorithm), and the table lists those whose value differs from the base's.
It is merged on top of the base config (--set changes the base, so every experiment) and run in this
process by train.train(), in file
name order, named after the file. Every run logs to OUT/logs/<name> (`tensorboard --logdir OUT/logs`
overlays them) and checkpoints to OUT/checkpoints/<name>; they share the base's seed, so they train
on the same questions. After each run OUT/runs/<name>.json records its numbers and OUT/results.md
and OUT/results.csv are rewritten. A rerun skips experiments recorded with the same config (--force
runs them again); an interrupted experiment starts over.
"""

import argparse
import csv
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import checkpoint
import config as config_lib
from bootstrap import prepare_missing_inputs
from config import TrainConfig
from run_logging import log_to_console

logger = logging.getLogger("ablate")

# Keys only some tasks read: elsewhere the experiment would silently repeat the base run.
TASK_SPECIFIC_KEYS = {"task.prompt_template": ("gsm8k",), "task.question_last": ("countdown",)}
COLUMNS = ("experiment", "changes", "final_eval_success", "best_eval_success", "final_format_rate", "steps",
           "wall_seconds", "note")


@dataclass
class Experiment:
    name: str
    changes: dict  # "section.key" -> value, as written in the experiment's file
    config: TrainConfig
    differences: dict  # the changes whose value differs from the base's: what the results table lists


def flatten(values: dict, prefix: str = "") -> dict:
    """{"loss": {"clip": "ppo"}} -> {"loss.clip": "ppo"}."""
    flat = {}
    for key, value in values.items():
        name = f"{prefix}.{key}" if prefix else key
        flat.update(flatten(value, name) if isinstance(value, dict) else {name: value})
    return flat


def value_at(config, dotted_key: str):
    for name in dotted_key.split("."):
        config = getattr(config, name)
    return config


def load_experiments(directory, base_path, overrides: list[str], out_dir) -> list[Experiment]:
    """Every DIR/*.yaml merged onto the base and validated, so a typo stops the suite before any run."""
    paths = sorted(Path(directory).glob("*.yaml"))
    if not paths:
        raise config_lib.ConfigError(f"no experiments: {directory} has no *.yaml files (one override file each)")
    base = config_lib.read_yaml(base_path)
    for assignment in overrides:
        config_lib.apply_override(base, assignment)
    try:
        base_config = config_lib.build(TrainConfig, base)
    except config_lib.ConfigError as error:
        raise config_lib.ConfigError(f"{base_path}: {error}") from None
    experiments = []
    for path in paths:
        changes = config_lib.read_yaml(path)
        # Run names and output directories belong to the suite: each experiment gets its own.
        suite_keys = {"run_name": path.stem, "logging": {"log_dir": str(Path(out_dir) / "logs")},
                      "checkpoint": {"dir": str(Path(out_dir) / "checkpoints")}}
        try:
            config = config_lib.build(TrainConfig, config_lib.merge(config_lib.merge(base, changes), suite_keys))
        except config_lib.ConfigError as error:
            raise config_lib.ConfigError(f"{path}: {error}") from None
        changes = flatten(changes)
        differences = {key: value for key, value in changes.items() if value_at(config, key) != value_at(base_config, key)}
        experiments.append(Experiment(path.stem, changes, config, differences))
    return experiments


def not_applicable_reason(experiment: Experiment) -> str | None:
    task = experiment.config.task.name
    for key, task_names in TASK_SPECIFIC_KEYS.items():
        if key in experiment.changes and task not in task_names:
            return f"not applicable: {key} is read only by the {' and '.join(task_names)} task, not {task}"
    return None


def describe_changes(changes: dict) -> str:
    return ", ".join(f"{key}={value if isinstance(value, str) else json.dumps(value)}"
                     for key, value in changes.items()) or "none (reference run)"


def read_run_metrics(log_dir) -> dict:
    """Final and best held-out success, final format rate and steps run, from a run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # slow to import

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0}).Reload()

    def logged(tag: str) -> list:
        return events.Scalars(tag) if tag in events.Tags()["scalars"] else []

    success = [event.value for event in logged("eval/success_rate")]
    format_rate = [event.value for event in logged("eval/format_rate")]
    return {
        "final_eval_success": success[-1] if success else None,
        "best_eval_success": max(success, default=None),
        "final_format_rate": format_rate[-1] if format_rate else None,
        "steps": max((event.step for event in logged("reward/mean")), default=0),
    }


def run_experiment(experiment: Experiment) -> dict:
    import train  # here, not at the top: torch loads only after --help, and once every experiment's config is valid

    config = experiment.config
    log_dir = Path(config.logging.log_dir) / experiment.name
    for stale in (log_dir, Path(config.checkpoint.dir) / experiment.name):  # from an interrupted or forced run
        shutil.rmtree(stale, ignore_errors=True)
    if config.eval.interval and config.optim.num_steps % config.eval.interval:
        logger.warning("%s: optim.num_steps is not a multiple of eval.interval, so the final evaluation is at step %d",
                       experiment.name, config.optim.num_steps // config.eval.interval * config.eval.interval)
    plan = train.plan_run(config)  # every input checked, Hub ids fetched
    prepare_missing_inputs(config.bootstrap, config.task, config.model)  # not part of the timed run
    start = time.perf_counter()
    train.train_from(plan)
    return {**read_run_metrics(log_dir), "wall_seconds": time.perf_counter() - start}


def run_suite(directory, base_path, overrides: list[str], out_dir, *, force: bool = False) -> list[dict]:
    """Run (or reuse) every experiment of `directory`; returns the result rows, also written to out_dir."""
    out_dir = Path(out_dir)
    experiments = load_experiments(directory, base_path, overrides, out_dir)
    # One suite per output directory: a second one would delete the first one's live runs as "stale".
    claim = checkpoint.RunClaim([out_dir], "wait for it to end or pass another --out")
    try:
        return run_experiments(experiments, out_dir, directory=directory, base_path=base_path, overrides=overrides,
                               force=force)
    finally:
        claim.release()


def run_experiments(experiments: list[Experiment], out_dir: Path, *, directory, base_path, overrides: list[str],
                    force: bool) -> list[dict]:
    (out_dir / "runs").mkdir(parents=True, exist_ok=True)
    rows = []
    for number, experiment in enumerate(experiments, 1):
        row = {"experiment": experiment.name, "changes": describe_changes(experiment.differences)}
        record_path = out_dir / "runs" / f"{experiment.name}.json"
        config_yaml = config_lib.to_yaml(experiment.config)
        record = json.loads(record_path.read_text()) if record_path.is_file() else None
        reason = not_applicable_reason(experiment)
        if reason:
            logger.info("[%d/%d] %s: %s", number, len(experiments), experiment.name, reason)
            row["note"] = reason
        elif record and record["config"] == config_yaml and not force:
            logger.info("[%d/%d] %s: already done (%s); --force reruns it", number, len(experiments), experiment.name,
                        record_path)
            row.update(record["metrics"])
        else:
            if record and not force:
                logger.info("%s: the config changed since %s was recorded; running it again", experiment.name,
                            record_path)
            logger.info("[%d/%d] %s: %s", number, len(experiments), experiment.name, row["changes"])
            metrics = run_experiment(experiment)
            row.update(metrics)
            record_path.write_text(json.dumps({"config": config_yaml, "metrics": metrics}, indent=2))
        rows.append(row)
        write_results(rows, out_dir, directory=directory, base_path=base_path, overrides=overrides)
    return rows


def format_percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def format_duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


def write_results(rows: list[dict], out_dir: Path, *, directory, base_path, overrides: list[str]) -> None:
    with open(out_dir / "results.csv", "w", newline="") as csv_file:
        writer = csv.DictWriter(csv_file, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        "# Ablation results", "",
        f"Experiments `{directory}` on base `{base_path}`" + "".join(f" `--set {o}`" for o in overrides) + ".",
        "Success is a correct final answer on the held-out split at the last evaluation (final) and the best "
        "of all evaluations, step 0 included (best).",
        f"Curves: `tensorboard --logdir {out_dir / 'logs'}`.", "",
        "| Experiment | What changed | Final eval success | Best eval success | Final format rate | Steps "
        "| Wall time |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.get("note"):
            lines.append(f"| {row['experiment']} | {row['changes']} ({row['note']}) | n/a | n/a | n/a | - | - |")
            continue
        lines.append(f"| {row['experiment']} | {row['changes']} | {format_percent(row['final_eval_success'])} | "
                     f"{format_percent(row['best_eval_success'])} | {format_percent(row['final_format_rate'])} | "
                     f"{row['steps']} | {format_duration(row['wall_seconds'])} |")
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    log_to_console()
    logging.getLogger("tensorboard").setLevel(logging.WARNING)  # its event reader chats at INFO
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="a directory of override YAMLs, one experiment each")
    parser.add_argument("--base", default="config.yaml", help="the config every experiment starts from")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a key of the base config (so of every experiment)")
    parser.add_argument("--out", help="results, logs and checkpoints (default: artifacts/ablations/<base name>)")
    parser.add_argument("--force", action="store_true", help="rerun experiments that already have results")
    args = parser.parse_args(argv)
    out_dir = Path(config_lib.expand_path(args.out)) if args.out else Path("artifacts") / "ablations" / Path(args.base).stem
    try:
        rows = run_suite(args.directory, args.base, args.set, out_dir, force=args.force)
    except config_lib.InputError as error:  # config, data, or the output directory in use: one line, exit code 2
        config_lib.exit_on_input_error(error)
    logger.info("%d experiments; results in %s", len(rows), Path(out_dir) / "results.md")


if __name__ == "__main__":
    main()
