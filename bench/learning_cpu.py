"""Does the CPU demo learn on every seed? Runs it from scratch per seed and writes a table.

    uv run bench/learning_cpu.py [--seeds 3] [--jobs 1] [--config configs/cpu_demo.yaml] [--out runs/learning_cpu]
                                 [--overlay VARIANT.yaml] [--cache-dir DIR] [--set section.key=value ...]

For each seed S (0 .. N-1, or from --first-seed) it runs the demo's stages as `uv run train.py --config configs/cpu_demo.yaml`
does, with S driving all of them: the CountDown dataset (`--seed S`), the random base model
(`--seed S`), the SFT warm-up (seed S) and GRPO (seed S: question order and sampling). It then scores
the SFT model (GRPO's start) and the final GRPO checkpoint on the whole held-out split (task.test_size
questions, one answer each, at T=1 and greedy), and writes OUT/learning_cpu.json, OUT/learning_cpu.md
(the table: per seed, then mean/min/max) and OUT/curves.png (every seed's evaluation curve).

--overlay applies a YAML of config overrides to the GRPO stage only (e.g. a loss variant).
--cache-dir keeps each seed's dataset, base model, SFT model and its held-out scores, keyed by the
seed and every setting they depend on, so a later invocation (say, with another --overlay) reruns
only GRPO. Without --cache-dir they go under OUT, which must be new or empty.
--jobs J runs J seeds at once, each in its own single-threaded process (cpu_threads=1 for SFT and GRPO);
with --jobs 1 (the default) each stage uses its own config's cpu_threads, as the demo command does, so the
times are the demo's own.
"""

import argparse
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import shlex
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's modules; this file runs from bench/

import config as config_lib  # noqa: E402
import countdown_task  # noqa: E402
import tasks  # noqa: E402
import tiny_model  # noqa: E402
import train  # noqa: E402
from evaluate import EvalConfig, evaluate  # noqa: E402
from bench.plot_curves import plot_success_curves, success_curve  # noqa: E402
from bench.report import machine  # noqa: E402
from run_logging import log_to_console  # noqa: E402
from runtime import load_model, resolve_device, set_up_cpu  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402
from train_sft import SFTConfig, train_sft  # noqa: E402

# The bar of issue 42, checked on every seed, greedy on the 3-number questions (fractions): success above the
# best single fixed form's coverage, success on the questions none of the 10 best forms solves, GRPO's own gain.
BAR = {"above_best_form_min": 0.10, "outside_top10_min": 0.10, "gain_min": 0.10, "demo_seconds_max": 600}


def load_avg() -> float:
    return round(os.getloadavg()[0], 1)


def timed(stage_times: dict, name: str, function, *args, **kwargs):
    """Run function, record its wall seconds and the 1-minute load average at its end."""
    start = time.perf_counter()
    result = function(*args, **kwargs)
    stage_times[f"{name}_seconds"] = round(time.perf_counter() - start, 1)
    stage_times[f"{name}_load_avg"] = load_avg()
    return result


def grpo_values(args: argparse.Namespace) -> dict:
    """The demo config with the overlay and --set applied: what the GRPO stage runs."""
    values = config_lib.read_yaml(args.config)
    if args.overlay:
        values = config_lib.merge(values, config_lib.read_yaml(args.overlay))
    for assignment in args.set:
        config_lib.apply_override(values, assignment)
    if args.jobs > 1:  # J processes on J cores: more threads each, in either stage, would only fight over them
        config_lib.apply_override(values, "cpu_threads=1")
        bootstrap = values.setdefault("bootstrap", {})
        bootstrap["sft_overrides"] = [*(bootstrap.get("sft_overrides") or []), "cpu_threads=1"]
    return values


def sft_config_for(config: train.TrainConfig, seed: int, stage_dir: Path) -> SFTConfig:
    """The warm-up bootstrap.py would run for this config, with the seed and paths of this bench."""
    overrides = [*config.bootstrap.sft_overrides, f"output_dir={stage_dir / 'sft-model'}",
                 f"model.dir={stage_dir / 'base-model'}", f"logging.log_dir={stage_dir / 'logs'}", f"seed={seed}",
                 f"checkpoint.dir={stage_dir / 'checkpoints'}", "progress=false"]
    sft_config = config_lib.load(SFTConfig, config.bootstrap.sft_config, overrides)
    sft_config.task = config.task  # as bootstrap.py: the warm-up learns the task GRPO trains on
    return sft_config


def cache_key(config: train.TrainConfig, seed: int) -> str:
    """Everything the dataset, base model and SFT model depend on (not GRPO settings)."""
    sft_values = config_lib.to_dict(sft_config_for(config, seed, Path("<stage>")))
    settings = {"seed": seed, "dataset_args": config.bootstrap.dataset_args, "task": config_lib.to_dict(config.task),
                "base_model_args": config.bootstrap.base_model_args, "sft": sft_values}
    settings["task"].pop("data_dir")
    settings["sft"].pop("cpu_threads")  # the threads change the time, not the model
    settings["sft"].pop("checkpoint")  # where a stopped warm-up would save, not the model
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]


def build_sft_model(config: train.TrainConfig, seed: int, stage_dir: Path) -> dict:
    """Dataset, base model and SFT model of one seed into stage_dir (reused when complete); their times."""
    done_file = stage_dir / "stages.json"
    if done_file.is_file():
        return {**json.loads(done_file.read_text()), "cached": True}
    if stage_dir.exists() and any(stage_dir.iterdir()):
        raise SystemExit(f"{stage_dir} holds an unfinished earlier run; delete it and rerun.")
    times = {}
    seed_arg = ["--seed", str(seed)]  # after the config's own arguments, so it wins
    timed(times, "dataset", countdown_task.main,
          ["generate", "--out", str(stage_dir / "countdown"), *shlex.split(config.bootstrap.dataset_args), *seed_arg])
    timed(times, "base_model", tiny_model.main,
          ["--out", str(stage_dir / "base-model"), *shlex.split(config.bootstrap.base_model_args), *seed_arg])
    sft_config = sft_config_for(config, seed, stage_dir)
    sft_config.task.data_dir = str(stage_dir / "countdown")
    times["sft_steps"] = timed(times, "sft", train_sft, sft_config)["steps"]  # < num_steps: stop_at_success
    done_file.write_text(json.dumps(times, indent=2) + "\n")
    return {**times, "cached": False}


def max_gen_len(config: train.TrainConfig) -> int:
    return config.eval.max_gen_len or config.rollout.max_gen_len


def held_out_scores(model_dir: Path, config: train.TrainConfig, seed: int) -> dict:
    """Success and format rate on the whole held-out split, one answer per question, at T=1 and greedy, with
    the shortcut baseline per number count (`forms_t1`, `forms_greedy`: countdown_forms.py's report)."""
    device = resolve_device(config.device)
    model = load_model(config.model, device, model_dir)
    tokenizer = Tokenizer(model_dir)
    test_set = tasks.load_dataset(config.task, tokenizer, "test")
    baseline = tasks.shortcut_baseline(config.task, tasks.load_dataset(config.task, tokenizer, "train"))
    scores = {}
    for name, temperature in (("t1", 1.0), ("greedy", 0.0)):
        eval_config = EvalConfig(max_questions=None, batch_size=config.eval.batch_size, num_samples=1,
                                 temperature=temperature, max_gen_len=config.eval.max_gen_len)
        generator = torch.Generator(device=device).manual_seed(seed)
        metrics, _ = evaluate(model, tokenizer, test_set, reward=tasks.get(config.task).reward,
                              max_gen_len=max_gen_len(config), config=eval_config, generator=generator, progress=False,
                              baseline=baseline)
        scores[f"success_{name}"] = round(metrics["success_rate"], 4)
        scores[f"format_{name}"] = round(metrics["format_rate"], 4)
        scores[f"forms_{name}"] = {key: value for key, value in metrics.items() if "_numbers/" in key}
        scores[f"exact_tries_{name}"] = round(metrics["mean_try_reward"], 4)
        scores["questions"] = metrics["num_questions"]
    return scores


def run_seed(args: argparse.Namespace, seed: int, cache_dir: Path, out: Path) -> dict:
    values = grpo_values(args)
    config = config_lib.build(train.TrainConfig, values)
    stage_dir = cache_dir / f"seed{seed}-{cache_key(config, seed)}"
    run_dir = out / f"seed{seed}"
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists from an earlier run; pass a new --out or delete it.")
    print(f"== seed {seed}: dataset + SFT model in {stage_dir}, GRPO run in {run_dir}", flush=True)
    stages = build_sft_model(config, seed, stage_dir)

    for assignment in (f"seed={seed}", f"task.data_dir={stage_dir / 'countdown'}",
                       f"model.dir={stage_dir / 'sft-model'}", f"logging.log_dir={run_dir / 'logs'}",
                       f"checkpoint.dir={run_dir / 'checkpoints'}", "progress=false"):
        config_lib.apply_override(values, assignment)
    config = config_lib.build(train.TrainConfig, values)
    set_up_cpu(config.cpu_threads)
    # The SFT model's scores, kept with it: they depend only on it, the seed and these settings.
    before_file = stage_dir / (f"held_out_{config.task.test_size}q_gen{max_gen_len(config)}"
                               f"_batch{config.eval.batch_size}_forms.json")
    if not before_file.is_file():
        before_file.write_text(json.dumps(held_out_scores(stage_dir / "sft-model", config, seed), indent=2) + "\n")
    before = json.loads(before_file.read_text())

    grpo = {}
    timed(grpo, "grpo", train.train, config)
    final_checkpoint = run_dir / "checkpoints" / config.run_name / f"step_{config.optim.num_steps:06d}"
    after = timed(grpo, "final_eval", held_out_scores, final_checkpoint, config, seed)
    steps, curve = success_curve(str(run_dir / "logs" / config.run_name))
    bootstrap_seconds = sum(stages.get(f"{name}_seconds", 0.0) for name in ("dataset", "base_model", "sft"))
    demo_seconds = bootstrap_seconds + grpo["grpo_seconds"]
    return {
        "seed": seed, "held_out_questions": after["questions"], "sft_model": str(stage_dir / "sft-model"),
        "final_checkpoint": str(final_checkpoint), "before": before, "after": after,
        "gain_t1": round(after["success_t1"] - before["success_t1"], 4),
        "gain_greedy": round(after["success_greedy"] - before["success_greedy"], 4),
        "curve_steps": steps, "curve_success_t1": [round(value, 4) for value in curve],
        "curve_questions": config.eval.max_questions or config.task.test_size,
        "stages": {**stages, **grpo}, "demo_seconds": round(demo_seconds, 1),
    }


def configure_logging() -> None:
    log_to_console()


def run_seeds(args: argparse.Namespace, seeds: range, cache_dir: Path, out: Path) -> list[dict]:
    """Every seed's result in seed order; with --jobs > 1, that many seeds at once in their own processes."""
    if args.jobs == 1:
        return [run_seed(args, seed, cache_dir, out) for seed in seeds]
    # spawn, not fork: a forked child would inherit this process's torch thread pools and state.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=context, initializer=configure_logging) as pool:
        repeat = itertools.repeat
        return list(pool.map(run_seed, repeat(args), seeds, repeat(cache_dir), repeat(out)))


def meets_bar(result: dict) -> dict[str, bool]:
    before, after = result["before"]["forms_greedy"], result["after"]["forms_greedy"]
    success = after.get("3_numbers/success", 0.0)
    return {
        "3n>=best form+10": success - after.get("3_numbers/best_form_coverage", 1.0) >= BAR["above_best_form_min"],
        "3n outside top-10>=10%": after.get("3_numbers/success_outside_top10", 0.0) >= BAR["outside_top10_min"],
        "3n gain>=10pts": success - before.get("3_numbers/success", 0.0) >= BAR["gain_min"],
        "demo<=10min": result["demo_seconds"] <= BAR["demo_seconds_max"],
    }


COLUMNS = [  # (header, how to read it from a seed's result, format)
    ("SFT T=1", lambda r: 100 * r["before"]["success_t1"], "{:.1f}"),
    ("GRPO T=1", lambda r: 100 * r["after"]["success_t1"], "{:.1f}"),
    ("gain T=1", lambda r: 100 * r["gain_t1"], "{:+.1f}"),
    ("SFT greedy", lambda r: 100 * r["before"]["success_greedy"], "{:.1f}"),
    ("GRPO greedy", lambda r: 100 * r["after"]["success_greedy"], "{:.1f}"),
    ("gain greedy", lambda r: 100 * r["gain_greedy"], "{:+.1f}"),
    ("format T=1", lambda r: 100 * r["after"]["format_t1"], "{:.1f}"),
    # a result written before the column existed: nan
    ("SFT exact tries", lambda r: 100 * r["before"].get("exact_tries_greedy", math.nan), "{:.0f}"),
    ("GRPO exact tries", lambda r: 100 * r["after"].get("exact_tries_greedy", math.nan), "{:.0f}"),
    ("SFT steps", lambda r: r["stages"].get("sft_steps", 0), "{:.0f}"),
    ("data s", lambda r: r["stages"].get("dataset_seconds", 0.0), "{:.0f}"),
    ("SFT s", lambda r: r["stages"].get("sft_seconds", 0.0), "{:.0f}"),
    ("GRPO s", lambda r: r["stages"]["grpo_seconds"], "{:.0f}"),
    ("demo s", lambda r: r["demo_seconds"], "{:.0f}"),
    ("load", lambda r: r["stages"]["grpo_load_avg"], "{:.1f}"),
]


def form_columns(results: list[dict]) -> list[tuple]:
    """The shortcut baseline's columns, per number count of the held-out questions, greedy (COLUMNS' layout)."""
    counts = sorted({int(key.split("_")[0]) for r in results for key in r["after"].get("forms_greedy", {})})
    columns = []
    for count in counts:
        read = lambda stage, name, count=count: lambda r: 100 * r[stage]["forms_greedy"].get(f"{count}_numbers/{name}", 0.0)
        columns += [(f"{count}n SFT", read("before", "success"), "{:.1f}"),
                    (f"{count}n GRPO", read("after", "success"), "{:.1f}"),
                    (f"{count}n best form", read("after", "best_form_coverage"), "{:.1f}"),
                    (f"{count}n top-10 forms", read("after", "top10_forms_coverage"), "{:.1f}"),
                    (f"{count}n outside top-10", read("after", "success_outside_top10"), "{:.1f}"),
                    (f"{count}n own form share", read("after", "policy_form_share"), "{:.0f}")]
    return columns


def markdown_table(results: list[dict]) -> str:
    questions = results[0]["held_out_questions"]
    standard_error = 100 * math.sqrt(0.25 / questions)
    columns = COLUMNS + form_columns(results)
    lines = ["| seed | " + " | ".join(header for header, _, _ in columns) + " | bar |",
             "|---" * (len(columns) + 2) + "|"]
    for result in results:
        failed = [name for name, ok in meets_bar(result).items() if not ok]
        cells = [form.format(read(result)) for _, read, form in columns]
        verdict = "met" if not failed else "missed: " + ", ".join(failed)
        lines.append(f"| {result['seed']} | " + " | ".join(cells) + f" | {verdict} |")
    for name, reduce in (("mean", statistics.mean), ("min", min), ("max", max)):
        cells = [form.format(reduce([read(r) for r in results])) for _, read, form in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " | |")
    forms = "; ".join(f"seed {r['seed']}: " + ", ".join(
        f"{key.split('_')[0]}n `{value}`" for key, value in r["after"].get("forms_greedy", {}).items()
        if key.endswith("/policy_form")) for r in results)
    lines += ["", f"Success in % on the {questions} held-out questions, one answer each; the standard error of one "
              f"number is at most {standard_error:.2f} points (p = 0.5). SFT = the model GRPO starts from; GRPO = the "
              "final checkpoint. Times in seconds (cached stages: 0 or their first run's time); demo s = dataset + "
              "base model + SFT + GRPO with its evaluations; load = 1-minute load average at the end of GRPO. exact "
              "tries: the mean share of an answer's tries that are exact computations (greedy; "
              "countdown_task.try_reward). "
              "Nn columns (greedy, questions with N numbers): success of the SFT model and of GRPO's final checkpoint; "
              "the share the best single fixed form solves and the 10 best forms together (chosen on training rows); "
              "GRPO's success on the questions none of those 10 solves; the share of its answers in its most used "
              f"form ({forms}). See docs/tasks_and_rewards.md."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="how many seeds: FIRST .. FIRST+N-1")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--config", default="configs/cpu_demo.yaml")
    parser.add_argument("--overlay", help="YAML of overrides applied to the GRPO stage")
    parser.add_argument("--cache-dir", help="reuse each seed's dataset + SFT model from here (default: under --out)")
    parser.add_argument("--out", default="runs/learning_cpu")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="GRPO override")
    parser.add_argument("--json-out", help="also write the JSON here")
    parser.add_argument("--jobs", type=int, default=1, help="seeds run at once, one process each (<= idle cores)")
    args = parser.parse_args()
    configure_logging()
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    try:
        config_lib.build(train.TrainConfig, grpo_values(args))  # a bad value stops here, before any work
    except config_lib.ConfigError as error:
        raise SystemExit(f"config error: {error}") from None
    out = Path(args.out)
    cache_dir = Path(args.cache_dir) if args.cache_dir else out / "cache"
    out.mkdir(parents=True, exist_ok=True)

    results = run_seeds(args, range(args.first_seed, args.first_seed + args.seeds), cache_dir, out)
    report = {"config": args.config, "overlay": args.overlay, "set": args.set, "bar": BAR,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(), "jobs": args.jobs,
              "seeds": results,
              "bar_met_on_every_seed": all(all(meets_bar(r).values()) for r in results)}
    table = markdown_table(results)
    json_text = json.dumps(report, indent=2) + "\n"
    (out / "learning_cpu.json").write_text(json_text)
    (out / "learning_cpu.md").write_text(table)
    if args.json_out:
        Path(args.json_out).write_text(json_text)
    plot_success_curves({f"seed {r['seed']}": (r["curve_steps"], r["curve_success_t1"]) for r in results},
                        str(out / "curves.png"),
                        f"CPU demo, {len(results)} seeds: held-out success ({results[0]['curve_questions']} questions)")
    print(table)


if __name__ == "__main__":
    main()
