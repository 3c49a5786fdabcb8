"""GRPO variants over seeds on the CPU demo's recipe: one table, resumable (docs/variants.md).

    uv run bench/variants_table.py [--seeds 3] [--first-seed 0] [--config configs/cpu_demo.yaml] [--out runs/variants]
                                   [--variants grpo dapo ...] [--set section.key=value ...]

Per seed, bench/learning_cpu.py builds the seed's dataset, base model and SFT model once (kept in
OUT/cache), and every variant's GRPO starts from that one SFT model: configs/variants/<variant>.yaml over
--config, so the demo's model, data, steps, learning rate and evaluation with the variant's whole
algorithm. The SFT model and each final checkpoint are scored on the whole held-out split at T=1 and
greedy. After a seed's variants comes the same-compute control, grpo_same_compute: plain GRPO
(configs/variants/grpo.yaml) given as many steps as it takes to sample as many answers as the costliest
variant of that seed sampled.

Each finished run is kept as OUT/rows/<variant>-s<seed>.json with the config it ran; a rerun skips those
(it redoes one whose config changed, and an interrupted run starts over), so the runs can be spread over
several sessions. The table, mean [min, max] over seeds, goes to OUT/variants.md and stdout.
"""

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's modules; this file runs from bench/

import torch  # noqa: E402

import config as config_lib  # noqa: E402
from bench import learning_cpu  # noqa: E402
from bench.plot_curves import read_scalars  # noqa: E402
from train import TrainConfig  # noqa: E402

VARIANTS_DIR = Path(__file__).resolve().parents[1] / "configs" / "variants"
VARIANTS = ("grpo", "dapo", "dr_grpo", "gspo", "cispo", "sapo", "rloo", "ppo_k2")
SAME_COMPUTE = "grpo_same_compute"  # plain GRPO given the sampled answers of the seed's costliest variant


def run_arguments(args: argparse.Namespace, preset: str, more_set: list[str]) -> argparse.Namespace:
    """bench/learning_cpu.py's arguments for one GRPO run: the preset over --config, then --set, then more_set."""
    return argparse.Namespace(config=args.config, overlay=str(VARIANTS_DIR / f"{preset}.yaml"),
                              set=[*args.set, *more_set], jobs=1)


def rollout_cost(log_dir: Path, config: TrainConfig) -> dict[str, int]:
    """Answers sampled and optimizer steps taken by a finished run, from its TensorBoard log."""
    scalars = read_scalars(str(log_dir))
    steps = config.optim.num_steps
    if "train/questions_sampled" in scalars:  # dynamic sampling: rounds vary per step
        answers = round(sum(scalars["train/questions_sampled"][1])) * config.rollout.num_answers_per_question
    else:
        answers = steps * config.rollout.episodes_per_step
    updated_steps = steps - round(sum(scalars["train/update_skipped"][1]))
    return {"answers_sampled": answers, "optimizer_steps": updated_steps * config.loss.epochs_per_rollout}


def run_variant(args: argparse.Namespace, name: str, seed: int, preset: str, more_set: list[str]) -> dict:
    """One variant on one seed: its recorded row if it ran with this config, else a fresh run (recorded)."""
    out = Path(args.out)
    row_path = out / "rows" / f"{name}-s{seed}.json"
    arguments = run_arguments(args, preset, more_set)
    values = json.loads(json.dumps(learning_cpu.grpo_values(arguments)))  # as it reads back from the row
    if row_path.is_file():
        row = json.loads(row_path.read_text())
        if row["grpo_config"] == values:
            print(f"== {name}, seed {seed}: done ({row_path})", flush=True)
            return row
        print(f"== {name}, seed {seed}: its config changed since {row_path}; running it again", flush=True)
    run_out = out / "runs" / name
    shutil.rmtree(run_out / f"seed{seed}", ignore_errors=True)  # what an interrupted or outdated run left
    result = learning_cpu.run_seed(arguments, seed, out / "cache", run_out)
    config = config_lib.build(TrainConfig, values)
    row = {"variant": name, "seed": seed, "grpo_config": values, "result": result,
           **rollout_cost(run_out / f"seed{seed}" / "logs" / config.run_name, config)}
    row_path.parent.mkdir(parents=True, exist_ok=True)
    row_path.write_text(json.dumps(row, indent=2) + "\n")
    return row


def run_all_variants(args: argparse.Namespace, seed: int) -> None:
    """Every variant of one seed, then the same-compute control sized by the costliest of them."""
    rows = [run_variant(args, name, seed, name, []) for name in args.variants]
    costliest = max(rows, key=lambda row: row["answers_sampled"])
    plain = config_lib.build(TrainConfig, learning_cpu.grpo_values(run_arguments(args, "grpo", [])))
    steps = math.ceil(costliest["answers_sampled"] / plain.rollout.episodes_per_step)
    print(f"== seed {seed}: {costliest['variant']} sampled the most answers ({costliest['answers_sampled']}): "
          f"{SAME_COMPUTE} runs {steps} steps", flush=True)
    run_variant(args, SAME_COMPUTE, seed, "grpo", [f"optim.num_steps={steps}"])


def spread(values: list[float], scale: float = 100, form: str = "{:.1f}") -> str:
    mean, low, high = (form.format(scale * v) for v in (statistics.mean(values), min(values), max(values)))
    return f"{mean} [{low}, {high}]"


COLUMNS = [  # (header, how to read it from a row, scale, format)
    ("SFT T=1", lambda row: row["result"]["before"]["success_t1"], 100, "{:.1f}"),
    ("GRPO T=1", lambda row: row["result"]["after"]["success_t1"], 100, "{:.1f}"),
    ("gain T=1", lambda row: row["result"]["gain_t1"], 100, "{:+.1f}"),
    ("SFT greedy", lambda row: row["result"]["before"]["success_greedy"], 100, "{:.1f}"),
    ("GRPO greedy", lambda row: row["result"]["after"]["success_greedy"], 100, "{:.1f}"),
    ("gain greedy", lambda row: row["result"]["gain_greedy"], 100, "{:+.1f}"),
    ("answers sampled", lambda row: row["answers_sampled"], 1, "{:.0f}"),
    ("optimizer steps", lambda row: row["optimizer_steps"], 1, "{:.0f}"),
    ("GRPO wall s", lambda row: row["result"]["stages"]["grpo_seconds"], 1, "{:.0f}"),
]


def read_rows(out: Path) -> dict[str, list[dict]]:
    """variant -> its recorded rows in seed order."""
    rows = {}
    for path in sorted((out / "rows").glob("*.json")):
        row = json.loads(path.read_text())
        rows.setdefault(row["variant"], []).append(row)
    return {variant: sorted(seed_rows, key=lambda row: row["seed"]) for variant, seed_rows in rows.items()}


def table(rows: dict[str, list[dict]], order: list[str]) -> str:
    lines = ["| variant | seeds | " + " | ".join(header for header, *_ in COLUMNS) + " |",
             "|---" * (len(COLUMNS) + 2) + "|"]
    for variant in [name for name in order if name in rows] + sorted(set(rows) - set(order)):
        seed_rows = rows[variant]
        cells = [spread([read(row) for row in seed_rows], scale, form) for _, read, scale, form in COLUMNS]
        lines.append(f"| {variant} | {','.join(str(row['seed']) for row in seed_rows)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report(rows: dict[str, list[dict]], order: list[str], args: argparse.Namespace) -> str:
    results = [row["result"] for seed_rows in rows.values() for row in seed_rows]
    questions = results[0]["held_out_questions"] if results else 0
    command = shlex.join(["uv", "run", "bench/variants_table.py", *sys.argv[1:]])
    return "\n".join([
        f"# GRPO variants on `{args.config}`", "",
        f"`{command}`, written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.machine()} with "
        f"{os.cpu_count()} CPUs (torch {torch.__version__}).", "",
        table(rows, order),
        f"Success in % on the {questions} held-out questions, one answer each, at T=1 and greedy: mean [min, max] "
        "over seeds. SFT = the seed's one SFT model every variant starts from; GRPO = the variant's final "
        f"checkpoint. {SAME_COMPUTE}: plain GRPO sampling as many answers as the seed's costliest variant. "
        "Wall times are comparable only within one machine and load.", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="how many seeds: FIRST .. FIRST+N-1")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--config", default="configs/cpu_demo.yaml", help="the recipe every variant runs over")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), help="configs/variants/ presets to run")
    parser.add_argument("--out", default="runs/variants", help="rows, runs and the seeds' SFT models (the cache)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="GRPO override")
    args = parser.parse_args()
    learning_cpu.configure_logging()
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    missing = [name for name in args.variants if not (VARIANTS_DIR / f"{name}.yaml").is_file()]
    if missing:
        parser.error(f"no preset configs/variants/{missing[0]}.yaml; the presets: "
                     + ", ".join(sorted(path.stem for path in VARIANTS_DIR.glob("*.yaml"))))
    for name in args.variants:  # a bad value stops here, before any work
        try:
            config_lib.build(TrainConfig, learning_cpu.grpo_values(run_arguments(args, name, [])))
        except config_lib.ConfigError as error:
            config_lib.exit_on_input_error(config_lib.ConfigError(f"{name}: {error}"))
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        run_all_variants(args, seed)
    out = Path(args.out)
    text = report(read_rows(out), [*args.variants, SAME_COMPUTE], args)
    (out / "variants.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
