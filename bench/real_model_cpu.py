"""Does a real pretrained model learn CountDown through this code on a CPU? The SmolLM2 recipe, per seed.

    uv run bench/real_model_cpu.py --model DIR_OR_HUB_ID (--seeds N | --seed S) [--out FILE.json]
                                   [--work runs/real_model_cpu] [--threads 2] [--variant LABEL=KEY=VALUE,...]
                                   [--reuse EARLIER.json] [--config configs/smollm2_cpu.yaml ...]

For each seed it runs the recipe's stages as a user would, each as its own process with that seed:
the CountDown dataset (`countdown_task.py generate`, configs/smollm2_cpu.yaml's bootstrap.dataset_args),
the SFT warm-up (`train_sft.py --config configs/smollm2_cpu_sft.yaml`), GRPO (`train.py --config
configs/smollm2_cpu.yaml`; --config, repeatable as train.py's, names other GRPO configs, whose
bootstrap.sft_config and sft_overrides are the warm-up's), and `evaluate.py` on the SFT model (GRPO's start)
and on the final checkpoint, greedy and at T=1, over the held-out questions (task.test_size, never trained on). Each --variant runs GRPO
again from the same SFT model with those overrides (e.g. lora=model.lora.rank=1,optim.learning_rate=3e-4),
and its final checkpoint is scored the same way: the recipe as configured is the row `recipe`. It prints a
table, and with --out writes JSON: per seed and variant the success fractions, the recipe's wall seconds (data,
SFT and GRPO: what `train.py --config configs/smollm2_cpu.yaml` runs), the evaluations' apart, and the peak RSS
of the largest stage. `--reuse EARLIER.json` (same --work) runs only the --variant rows, from the seeds' data, SFT
models and SFT scores of that earlier run, and reports them beside its rows.

A small model can raise its score by writing one fixed form for every question (say `a + b - c`, the numbers
in the order given) when the data holds many questions that form solves. So the bench reports, per number
count, the shortcut baseline (countdown_forms.py) beside the greedy scores: what the best single form and the
10 best forms chosen on training rows solve, the success on the questions none of them solves, and the share
of the final answers in their most used form.
"""

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import config as config_lib  # noqa: E402
from bench.report import machine  # noqa: E402
from config import TrainConfig  # noqa: E402
from countdown_task import CountdownDataset, shortcut_baseline, try_reward  # noqa: E402

RECIPE_CONFIG = REPO / "configs" / "smollm2_cpu.yaml"
# The bar of issue 42, per seed, greedy on the 3-number questions (fractions, seconds, MiB): success above the best
# single fixed form's coverage, success on the questions none of the 10 best forms solves, GRPO's own gain.
BAR = {"above_best_form_min": 0.10, "outside_top10_min": 0.10, "gain_min": 0.10, "seconds_max": 2700,
       "peak_rss_mib_max": 4096}


def run_stage(name: str, arguments: list[str], log_dir: Path) -> dict:
    """Run one entry point of the repository to completion; its wall seconds and peak RSS (MiB)."""
    command = [sys.executable, *arguments]
    print(f"  {name}: {shlex.join(arguments)}", flush=True)
    start = time.perf_counter()
    with open(log_dir / f"{name}.log", "w") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"stage {name} failed (exit {os.waitstatus_to_exitcode(status)}); see {log_dir / name}.log")
    return {"seconds": round(seconds, 1), "peak_rss_mib": round(usage.ru_maxrss / 1024)}  # ru_maxrss: KiB on Linux


def success(samples: list[dict]) -> float:
    return sum(sample["reward_info"]["answer_reward"] > 0 for sample in samples) / len(samples)


def exact_tries(samples: list[dict]) -> float:
    """The mean share of an answer's tries that are exact computations (countdown_task.try_reward): real or
    made-up arithmetic."""
    return sum(try_reward(sample["response"], sample["nums"]) for sample in samples) / len(samples)


def unfinished(samples: list[dict]) -> float:
    """The share of answers cut at the length limit: on the search warm-up, mostly one try written again."""
    return sum(not sample["finished"] for sample in samples) / len(samples)


def evaluate_stage(name: str, model_dir: Path, temperature: float, config: TrainConfig, work: Path,
                   threads: int) -> tuple[dict, list[dict]]:
    out = work / f"{name}.jsonl"
    stage = run_stage(name, [
        "evaluate.py", "--model", str(model_dir), "--data", config.task.data_dir, "--split", "test",
        "--temperature", str(temperature), "--samples", "1", "--threads", str(threads),
        "--max-questions", str(config.task.test_size), "--out", str(out),
        "--set", f"task.test_size={config.task.test_size}", "--set", f"task.question_last={config.task.question_last}",
        "--set", f"eval.batch_size={config.eval.batch_size}", "--set", f"eval.max_gen_len={config.rollout.max_gen_len}",
        "--set", f"seed={config.seed}", "--set", "progress=false"], work)
    return stage, read_samples(out)


def seed_config(grpo_configs: list[str], seed: int, work: Path) -> TrainConfig:
    return config_lib.load(TrainConfig, grpo_configs, [f"seed={seed}", f"task.data_dir={work / 'countdown'}"])


def read_samples(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def warm_up(grpo_configs: list[str], model: str, seed: int, work: Path, threads: int) -> tuple[dict, dict]:
    """The seed's data and SFT model, and the SFT model's answers: (stages, samples)."""
    work.mkdir(parents=True)
    config = seed_config(grpo_configs, seed, work)
    sft_settings = [*config.bootstrap.sft_overrides, f"model.dir={model}", f"output_dir={work / 'sft-model'}",
                    f"seed={seed}", f"cpu_threads={threads}", f"task.data_dir={work / 'countdown'}", f"logging.log_dir={work / 'logs'}", "run_name=sft",
                    "progress=false"]
    stages, samples = {}, {}
    stages["data"] = run_stage("data", ["countdown_task.py", "generate", "--out", str(work / "countdown"),
                                        *shlex.split(config.bootstrap.dataset_args), "--seed", str(seed)], work)
    stages["sft"] = run_stage("sft", ["train_sft.py", "--config", config.bootstrap.sft_config,
                                      *[f"--set={setting}" for setting in sft_settings]], work)
    for kind, temperature in (("greedy", 0.0), ("t1", 1.0)):
        stages[f"eval_sft_{kind}"], samples[f"sft_{kind}"] = evaluate_stage(
            f"eval_sft_{kind}", work / "sft-model", temperature, config, work, threads)
    return stages, samples


def reused_warm_up(earlier: dict, work: Path) -> tuple[dict, dict]:
    """warm_up's result as an earlier run in `work` left it (its stages' records, its SFT answers)."""
    stages = {name: earlier["stages"][name] for name in ("data", "sft", "eval_sft_greedy", "eval_sft_t1")}
    return stages, {f"sft_{kind}": read_samples(work / f"eval_sft_{kind}.jsonl") for kind in ("greedy", "t1")}


def run_seed(grpo_configs: list[str], seed: int, work: Path, threads: int, variants: dict[str, list[str]], stages: dict,
             samples: dict) -> list[dict]:
    """One result per variant (`recipe`: the config as it is), all from this seed's data and SFT model."""
    config = seed_config(grpo_configs, seed, work)
    baseline = shortcut_baseline(CountdownDataset(work / "countdown", None, "train", test_size=config.task.test_size))
    results = []
    for variant, overrides in variants.items():
        grpo_settings = [f"model.dir={work / 'sft-model'}", f"seed={seed}", f"cpu_threads={threads}",
                         f"task.data_dir={work / 'countdown'}", f"logging.log_dir={work / 'logs'}",
                         f"checkpoint.dir={work / 'checkpoints'}", f"run_name=grpo-{variant}", "progress=false",
                         *overrides]
        final = work / "checkpoints" / f"grpo-{variant}" / f"step_{config.optim.num_steps:06d}"
        # The stages run in the repository: configs named from elsewhere go to them as absolute paths.
        configs = [f"--config={Path(path).resolve()}" for path in grpo_configs]
        own = {**stages, "grpo": run_stage(f"grpo-{variant}", ["train.py", *configs, *[
            f"--set={setting}" for setting in grpo_settings]], work)}
        scored = {key: value for key, value in samples.items()}
        for kind, temperature in (("greedy", 0.0), ("t1", 1.0)):
            own[f"eval_final_{kind}"], scored[f"final_{kind}"] = evaluate_stage(
                f"eval_{variant}_{kind}", final, temperature, config, work, threads)
        scores = {key: success(answers) for key, answers in scored.items()}
        results.append({
            "seed": seed, "variant": variant, "overrides": overrides,
            **{key: round(value, 4) for key, value in scores.items()},
            **{f"forms_{key}": baseline.report(answers) for key, answers in scored.items()},
            **{f"exact_tries_{key}": round(exact_tries(scored[key]), 4) for key in ("sft_greedy", "final_greedy")},
            **{f"unfinished_{key}": round(unfinished(scored[key]), 4) for key in ("sft_greedy", "final_greedy")},
            "gain_greedy": round(scores["final_greedy"] - scores["sft_greedy"], 4),
            "gain_t1": round(scores["final_t1"] - scores["sft_t1"], 4), "held_out_questions": config.task.test_size,
            "seconds": round(sum(own[name]["seconds"] for name in RECIPE_STAGES), 1),
            "eval_seconds": round(sum(stage["seconds"] for name, stage in own.items() if name.startswith("eval")), 1),
            "peak_rss_mib": max(stage["peak_rss_mib"] for stage in own.values()), "stages": own})
    return results


RECIPE_STAGES = ("data", "sft", "grpo")  # what `train.py --config configs/smollm2_cpu.yaml` runs on a fresh clone


def meets_bar(result: dict) -> bool:
    before, after = result["forms_sft_greedy"], result["forms_final_greedy"]
    success = after.get("3_numbers/success", 0.0)
    return (success - after.get("3_numbers/best_form_coverage", 1.0) >= BAR["above_best_form_min"]
            and after.get("3_numbers/success_outside_top10", 0.0) >= BAR["outside_top10_min"]
            and success - before.get("3_numbers/success", 0.0) >= BAR["gain_min"]
            and result["seconds"] <= BAR["seconds_max"] and result["peak_rss_mib"] <= BAR["peak_rss_mib_max"])


COLUMNS = [("SFT greedy", "sft_greedy", 100, "{:.1f}"), ("final greedy", "final_greedy", 100, "{:.1f}"),
           ("gain greedy", "gain_greedy", 100, "{:+.1f}"), ("SFT T=1", "sft_t1", 100, "{:.1f}"),
           ("final T=1", "final_t1", 100, "{:.1f}"), ("gain T=1", "gain_t1", 100, "{:+.1f}"),
           ("SFT exact tries", "exact_tries_sft_greedy", 100, "{:.0f}"),
           ("final exact tries", "exact_tries_final_greedy", 100, "{:.0f}"),
           ("SFT unfinished", "unfinished_sft_greedy", 100, "{:.0f}"),
           ("final unfinished", "unfinished_final_greedy", 100, "{:.0f}"),
           ("minutes", "seconds", 1 / 60, "{:.1f}"), ("peak RSS MiB", "peak_rss_mib", 1, "{:.0f}")]
FORM_COLUMNS = [  # per number count, greedy: (header, samples, countdown_forms report key, format)
    ("SFT", "forms_sft_greedy", "success", "{:.1f}"), ("final", "forms_final_greedy", "success", "{:.1f}"),
    ("best form", "forms_final_greedy", "best_form_coverage", "{:.1f}"),
    ("top-10 forms", "forms_final_greedy", "top10_forms_coverage", "{:.1f}"),
    ("outside top-10", "forms_final_greedy", "success_outside_top10", "{:.1f}"),
    ("own form share", "forms_final_greedy", "policy_form_share", "{:.0f}")]


def table_columns(results: list[dict]) -> list[tuple]:
    """COLUMNS, then the shortcut baseline's per number count, each as (header, read, format)."""
    # Results of an earlier run (--reuse) may predate a column: nan.
    columns = [(header, lambda r, key=key, scale=scale: r.get(key, math.nan) * scale, form)
               for header, key, scale, form in COLUMNS]
    counts = sorted({int(key.split("_")[0]) for r in results for key in r["forms_final_greedy"]})
    for count in counts:
        columns += [(f"{count}n {header}", lambda r, forms=forms, key=f"{count}_numbers/{name}":
                     100 * r[forms].get(key, 0.0), form) for header, forms, name, form in FORM_COLUMNS]
    return columns


def markdown_table(results: list[dict]) -> str:
    columns = table_columns(results)
    lines = ["| variant | seed | " + " | ".join(header for header, *_ in columns) + " | bar |",
             "|---" * (len(columns) + 3) + "|"]
    variants = list(dict.fromkeys(result.get("variant", "recipe") for result in results))
    for variant in variants:
        rows = [result for result in results if result.get("variant", "recipe") == variant]
        for result in rows:
            cells = [form.format(read(result)) for _, read, form in columns]
            lines.append(f"| {variant} | {result['seed']} | " + " | ".join(cells) +
                         f" | {'met' if meets_bar(result) else 'missed'} |")
        if len(rows) > 1:
            for name, reduce in (("mean", statistics.mean), ("min", min), ("max", max)):
                cells = [form.format(reduce(read(r) for r in rows)) for _, read, form in columns]
                lines.append(f"| {variant} | {name} | " + " | ".join(cells) + " | |")
    questions = results[0]["held_out_questions"]
    forms = "; ".join(f"{r.get('variant', 'recipe')} seed {r['seed']}: " + ", ".join(f"{key.split('_')[0]}n `{value}`" for key, value in
                                                         r["forms_final_greedy"].items() if key.endswith("/policy_form"))
                      for r in results)
    lines += ["", f"Success in % on {questions} held-out questions (one answer each; standard error <= "
              f"{100 * (0.25 / questions) ** 0.5:.1f} points). SFT = GRPO's start. minutes: the whole recipe (data, "
              "SFT, GRPO; the evaluations apart); peak RSS: its largest stage. exact tries: the mean share of an "
              "answer's tries that are exact computations over every number (greedy; 0 for an answer without steps); "
              "unfinished: the share of greedy answers cut at the length limit. "
              "Nn columns (greedy, questions with N numbers): the SFT and final success; the share the best single fixed form and the 10 best forms "
              "together solve (chosen on training rows); the final success on the questions none of those 10 solves; "
              f"the share of the final answers in their most used form ({forms}). See docs/tasks_and_rewards.md."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the base model: a Hugging Face directory or Hub id")
    seeds = parser.add_mutually_exclusive_group(required=True)
    seeds.add_argument("--seeds", type=int, help="run seeds 0 .. N-1")
    seeds.add_argument("--seed", type=int, help="run this one seed")
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--work", default="runs/real_model_cpu", help="each seed's data, models and logs go in WORK/seedS")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads of every stage")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=KEY=VALUE[,KEY=VALUE]",
                        help="also run GRPO from the same SFT model with these overrides (repeatable)")
    parser.add_argument("--reuse", metavar="EARLIER.json", help="an earlier --out of this bench with the same --work: "
                        "run only the --variant rows from its seeds' data and SFT models")
    parser.add_argument("--config", action="append", help="the GRPO config; repeat to merge several in order, as "
                        "train.py does (default: configs/smollm2_cpu.yaml)")
    args = parser.parse_args()
    args.config = args.config or [str(RECIPE_CONFIG.relative_to(REPO))]
    for path in args.config:
        if not Path(path).is_file():
            parser.error(f"--config {path}: no such file")
    earlier = json.loads(Path(args.reuse).read_text()) if args.reuse else None
    earlier_configs = earlier and earlier.get("config", [str(RECIPE_CONFIG.relative_to(REPO))])  # older: the recipe's
    if earlier and earlier_configs != args.config:
        parser.error(f"--reuse {args.reuse} ran --config {' '.join(earlier_configs)}: pass the same --config")
    variants = dict(earlier["variants"]) if earlier else {"recipe": []}
    for variant in args.variant:
        label, _, overrides = variant.partition("=")
        if not label or "=" not in overrides or label in variants:
            parser.error(f"--variant {variant!r}: expected a new LABEL=section.key=value[,section.key=value]")
        variants[label] = overrides.split(",")
    if args.seeds is not None and args.seeds < 1:
        parser.error("--seeds must be >= 1")
    seed_list = [args.seed] if args.seed is not None else list(range(args.seeds))
    work = Path(args.work).resolve()
    earlier_rows = {row["seed"]: row for row in earlier["seeds"] if row["variant"] == "recipe"} if earlier else {}
    for seed in seed_list:
        if earlier and not (seed in earlier_rows and (work / f"seed{seed}" / "sft-model").is_dir()):
            parser.error(f"--reuse {args.reuse}: seed {seed} has no recipe row there or no SFT model in "
                         f"{work / f'seed{seed}'}: pass the --work and seeds of that run")
        if not earlier and (work / f"seed{seed}").exists():
            parser.error(f"{work / f'seed{seed}'} exists from an earlier run: delete it or pass another --work")
    new_variants = {label: overrides for label, overrides in variants.items()
                    if not earlier or label not in earlier["variants"]}
    if earlier and not new_variants:
        parser.error("--reuse runs only --variant rows: name at least one new LABEL")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    results = [row for row in earlier["seeds"] if row["seed"] in seed_list] if earlier else []
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for seed in seed_list:
        seed_work = work / f"seed{seed}"
        print(f"== seed {seed} in {seed_work}", flush=True)
        stages, samples = (reused_warm_up(earlier_rows[seed], seed_work) if earlier
                           else warm_up(args.config, args.model, seed, seed_work, args.threads))
        results += run_seed(args.config, seed, seed_work, args.threads, new_variants, stages, samples)
        results.sort(key=lambda row: (list(variants).index(row["variant"]), row["seed"]))
        print(markdown_table([row for row in results if row["seed"] == seed]), flush=True)
        if args.out:  # after every seed: a run stopped later keeps the seeds it finished
            report = {"model": args.model, "config": args.config, "threads": args.threads,
                      "machine": machine(), "bar": BAR, "variants": variants, "date": f"{started} to {time.strftime('%H:%M UTC', time.gmtime())}",
                      "seeds": results, **({"reused": {"file": args.reuse, "date": earlier["date"]}} if earlier else {}),
                      "bar_met_on_every_seed": all(meets_bar(result) for result in results)}
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(markdown_table(results))


if __name__ == "__main__":
    main()
