"""Does a real pretrained model learn CountDown through this code on a CPU? The SmolLM2 recipe, per seed.

    uv run bench/real_model_cpu.py --model DIR_OR_HUB_ID (--seeds N | --seed S) [--out FILE.json]
                                   [--work runs/real_model_cpu] [--threads 2]

For each seed it runs the recipe's stages as a user would, each as its own process with that seed:
the CountDown dataset (`countdown_task.py generate`, configs/smollm2_cpu.yaml's bootstrap.dataset_args),
the SFT warm-up (`train_sft.py --config configs/smollm2_cpu_sft.yaml`), GRPO (`train.py --config
configs/smollm2_cpu.yaml`), and `evaluate.py` on the SFT model (GRPO's start) and on the final checkpoint,
greedy and at T=1, over the held-out questions (task.test_size, never trained on). It prints a table, and
with --out writes JSON: per seed the success fractions, the whole recipe's wall seconds and the peak RSS
of its largest stage.

A small model can raise its score by writing one fixed form for every question (say `a + b - c`, the numbers
in the order given) when the data holds many questions that form solves. So the bench also reports the final
greedy answers' most common form, its share of the answers, and the success that form alone would score on
every held-out question: a final score at that form's own success is a learned shortcut, not arithmetic.
"""

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import config as config_lib  # noqa: E402
from answer_format import extract_answer_text  # noqa: E402
from config import TrainConfig  # noqa: E402
from countdown_task import answer_reward  # noqa: E402

GRPO_CONFIG = REPO / "configs" / "smollm2_cpu.yaml"
# The bar of the real-model issue, per seed (fractions, seconds, MiB).
BAR = {"final_greedy_min": 0.25, "gain_greedy_min": 0.10, "seconds_max": 1800, "peak_rss_mib_max": 4096}


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


POSITIONS = "abcd"  # the question's numbers, in the order the prompt gives them


def answer_form(response: str, numbers: list[int]) -> str | None:
    """The answer with each of the question's numbers written as its position and the spaces dropped:
    `<answer> 34 + 66 - 10 </answer>` for [34, 66, 10] is `a+b-c`. None without a single answer pair."""
    text = extract_answer_text(response)
    if text is None:
        return None
    unused = dict(enumerate(numbers))

    def position(literal: re.Match) -> str:
        index = next((index for index, number in unused.items() if number == int(literal.group())), None)
        if index is None:
            return literal.group()
        del unused[index]
        return POSITIONS[index]

    return re.sub(r"\d+", position, "".join(text.split()))


def shortcut_check(samples: list[dict]) -> dict:
    """The answers' most common form, its share of them, and the success that one form would score if it
    were written for every question (a form with anything but positions, digits and + - * / ( ) scores 0)."""
    forms = Counter(answer_form(sample["response"], sample["nums"]) for sample in samples)
    top_form, count = forms.most_common(1)[0]
    solved = 0
    if top_form is not None and re.fullmatch(r"[abcd\d+\-*/()]+", top_form):
        solved = sum(answer_reward(f"<answer>{fill_form(top_form, sample['nums'])}</answer>", sample["nums"],
                                   sample["target"]) > 0 for sample in samples)
    return {"top_form": top_form, "top_form_share": count / len(samples), "top_form_success": solved / len(samples)}


def fill_form(form: str, numbers: list[int]) -> str:
    return re.sub("[abcd]", lambda letter: str(numbers[POSITIONS.index(letter.group())]), form)


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
    return stage, [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def run_seed(model: str, seed: int, work: Path, threads: int) -> dict:
    work.mkdir(parents=True)
    config = config_lib.load(TrainConfig, [str(GRPO_CONFIG)], [f"seed={seed}", f"task.data_dir={work / 'countdown'}"])
    sft_settings = [f"model.dir={model}", f"output_dir={work / 'sft-model'}", f"seed={seed}", f"cpu_threads={threads}",
                    f"task.data_dir={work / 'countdown'}", f"logging.log_dir={work / 'logs'}", "run_name=sft",
                    "progress=false"]
    grpo_settings = [f"model.dir={work / 'sft-model'}", f"seed={seed}", f"cpu_threads={threads}",
                     f"task.data_dir={work / 'countdown'}", f"logging.log_dir={work / 'logs'}",
                     f"checkpoint.dir={work / 'checkpoints'}", "run_name=grpo", "progress=false"]
    final = work / "checkpoints" / "grpo" / f"step_{config.optim.num_steps:06d}"
    stages, samples = {}, {}
    stages["data"] = run_stage("data", ["countdown_task.py", "generate", "--out", str(work / "countdown"),
                                        *shlex.split(config.bootstrap.dataset_args), "--seed", str(seed)], work)
    stages["sft"] = run_stage("sft", ["train_sft.py", "--config", config.bootstrap.sft_config,
                                      *[f"--set={setting}" for setting in sft_settings]], work)
    for label, model_dir in (("sft", work / "sft-model"), ("final", final)):
        if label == "final":
            stages["grpo"] = run_stage("grpo", ["train.py", "--config", str(GRPO_CONFIG),
                                                *[f"--set={setting}" for setting in grpo_settings]], work)
        for kind, temperature in (("greedy", 0.0), ("t1", 1.0)):
            stages[f"eval_{label}_{kind}"], samples[f"{label}_{kind}"] = evaluate_stage(
                f"eval_{label}_{kind}", model_dir, temperature, config, work, threads)
    scores = {key: success(answers) for key, answers in samples.items()}
    shortcut = shortcut_check(samples["final_greedy"])
    return {"seed": seed, **{key: round(value, 4) for key, value in scores.items()},
            "final_top_form": shortcut["top_form"], "final_top_form_share": round(shortcut["top_form_share"], 4),
            "final_top_form_success": round(shortcut["top_form_success"], 4),
            "gain_greedy": round(scores["final_greedy"] - scores["sft_greedy"], 4),
            "gain_t1": round(scores["final_t1"] - scores["sft_t1"], 4),
            "held_out_questions": config.task.test_size,
            "seconds": round(sum(stage["seconds"] for stage in stages.values()), 1),
            "peak_rss_mib": max(stage["peak_rss_mib"] for stage in stages.values()), "stages": stages}


def meets_bar(result: dict) -> bool:
    return (result["final_greedy"] >= BAR["final_greedy_min"] and result["gain_greedy"] >= BAR["gain_greedy_min"]
            and result["seconds"] <= BAR["seconds_max"] and result["peak_rss_mib"] <= BAR["peak_rss_mib_max"])


COLUMNS = [("SFT greedy", "sft_greedy", 100, "{:.1f}"), ("final greedy", "final_greedy", 100, "{:.1f}"),
           ("gain greedy", "gain_greedy", 100, "{:+.1f}"), ("SFT T=1", "sft_t1", 100, "{:.1f}"),
           ("final T=1", "final_t1", 100, "{:.1f}"), ("gain T=1", "gain_t1", 100, "{:+.1f}"),
           ("top form share", "final_top_form_share", 100, "{:.0f}"),
           ("top form alone", "final_top_form_success", 100, "{:.1f}"),
           ("minutes", "seconds", 1 / 60, "{:.1f}"), ("peak RSS MiB", "peak_rss_mib", 1, "{:.0f}")]


def markdown_table(results: list[dict]) -> str:
    lines = ["| seed | " + " | ".join(header for header, *_ in COLUMNS) + " | bar |", "|---" * (len(COLUMNS) + 2) + "|"]
    for result in results:
        cells = [form.format(result[key] * scale) for _, key, scale, form in COLUMNS]
        lines.append(f"| {result['seed']} | " + " | ".join(cells) + f" | {'met' if meets_bar(result) else 'missed'} |")
    if len(results) > 1:
        for name, reduce in (("mean", statistics.mean), ("min", min), ("max", max)):
            cells = [form.format(reduce(r[key] for r in results) * scale) for _, key, scale, form in COLUMNS]
            lines.append(f"| {name} | " + " | ".join(cells) + " | |")
    questions = results[0]["held_out_questions"]
    lines += ["", f"Success in % on {questions} held-out questions (one answer each; standard error <= "
              f"{100 * (0.25 / questions) ** 0.5:.1f} points). SFT = GRPO's start. minutes: the whole recipe (data, "
              "SFT, GRPO, the four evaluations); peak RSS: its largest stage. top form: the final greedy answers' "
              "most common form (" + ", ".join(f"seed {r['seed']}: `{r['final_top_form']}`" for r in results) +
              "; a, b, c: the numbers in the prompt's order), its share of the answers in %, and the success it "
              "alone scores written for every held-out question."]
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
    args = parser.parse_args()
    if args.seeds is not None and args.seeds < 1:
        parser.error("--seeds must be >= 1")
    seed_list = [args.seed] if args.seed is not None else list(range(args.seeds))
    work = Path(args.work).resolve()
    for seed in seed_list:
        if (work / f"seed{seed}").exists():
            parser.error(f"{work / f'seed{seed}'} exists from an earlier run: delete it or pass another --work")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in seed_list:
        print(f"== seed {seed} in {work / f'seed{seed}'}", flush=True)
        results.append(run_seed(args.model, seed, work / f"seed{seed}", args.threads))
        print(markdown_table(results[-1:]), flush=True)
    report = {"model": args.model, "threads": args.threads, "cpu_count": os.cpu_count(), "bar": BAR,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seeds": results,
              "bar_met_on_every_seed": all(meets_bar(result) for result in results)}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(markdown_table(results))


if __name__ == "__main__":
    main()
