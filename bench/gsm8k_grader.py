"""Throughput of the GSM8K reward on the real gold answers and on hostile responses.

Part 1 grades a response for every GSM8K gold answer, with the answer written in
several forms (and one wrong form). Part 2 times responses built to be slow; each
stays bounded because answers over gsm8k_task.MAX_ANSWER_CHARS are refused before
parsing and the tag checks are linear in the response length.

    uv run bench/gsm8k_grader.py --data gsm8k [--seconds-per-case 0.3]
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gsm8k_task import MAX_ANSWER_CHARS, extract_gold_answer, load_gsm8k_rows, reward_function  # noqa: E402

END = "<|endoftext|>"
GOLD = "18"
ANSWER_FORMS = {
    "plain 1234": lambda number: str(number),
    "commas 1,234": lambda number: f"{number:,}",
    "decimal 1234.0": lambda number: f"{number}.0",
    "dollar $1234": lambda number: f"${number}",
    "boxed \\boxed{1,234}": lambda number: f"$\\boxed{{{number:,}}}$",
    "unit 1234 dollars": lambda number: f"{number} dollars",
    "wrong 1235": lambda number: str(number + 1),
}


def response_with(answer: str) -> str:
    return f"Some reasoning. </think> <answer> {answer} </answer>{END}"


HOSTILE_CASES = {
    "correct answer": response_with("18"),
    "answer at length limit": response_with("(" * 31 + "18" + ")" * 31 + " " * (MAX_ANSWER_CHARS - 66)),
    "power tower 9^9^9^9": response_with("9^9^9^9"),
    "10^(10^100)": response_with("10^(10^100)"),
    "nesting one past the limit": response_with("(" * 33 + "18" + ")" * 33),
    "\\frac x 40 (past nesting)": response_with("\\frac" * 40 + "18"),
    "unary minus chain at limit": response_with("-" * (MAX_ANSWER_CHARS - 4) + "18"),
    "100k-digit literal": response_with("9" * 100_000),
    "100k open parentheses": response_with("(" * 100_000),
    "100k text, no tags": "x" * 100_000,
    "50k <answer> tags": "<answer>" * 50_000,
    "30k </think> tags": "</think>" * 30_000,
}


def summarize(durations: list[float], rewards: list[float]) -> dict:
    return {
        "calls": len(durations),
        "mean_reward": sum(rewards) / len(rewards),
        "calls_per_second": len(durations) / sum(durations),
        "mean_us": 1e6 * sum(durations) / len(durations),
        "max_us": 1e6 * max(durations),
    }


def time_gold_answers(golds: list[str], answer_form) -> dict:
    durations, rewards = [], []
    for gold in golds:
        response = response_with(answer_form(int(gold)))
        start = time.perf_counter()
        rewards.append(reward_function(response, gold, END)["reward"])
        durations.append(time.perf_counter() - start)
    return summarize(durations, rewards)


def time_hostile(response: str, seconds: float) -> dict:
    durations, rewards = [], []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(durations) < 5:
        start = time.perf_counter()
        rewards.append(reward_function(response, GOLD, END)["reward"])
        durations.append(time.perf_counter() - start)
    return {"chars": len(response), **summarize(durations, rewards)}


def print_table(title: str, results: dict) -> None:
    print(f"\n{title:<30} {'calls':>7} {'reward':>7} {'calls/s':>10} {'mean us':>9} {'max us':>9}")
    for name, row in results.items():
        print(
            f"{name:<30} {row['calls']:>7} {row['mean_reward']:>7.3f} {row['calls_per_second']:>10.0f} "
            f"{row['mean_us']:>9.1f} {row['max_us']:>9.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="gsm8k", help="GSM8K directory (train.jsonl/test.jsonl or the Hub clone)")
    parser.add_argument("--seconds-per-case", type=float, default=0.3, help="time spent on each hostile case")
    args = parser.parse_args()
    rows = load_gsm8k_rows(args.data, "train") + load_gsm8k_rows(args.data, "test")
    golds = [extract_gold_answer(row["answer"]) for row in rows]
    gold_results = {name: time_gold_answers(golds, form) for name, form in ANSWER_FORMS.items()}
    hostile_results = {name: time_hostile(response, args.seconds_per_case) for name, response in HOSTILE_CASES.items()}
    print_table(f"{len(golds)} gold answers, as", gold_results)
    print_table("hostile response", hostile_results)
    report = {"max_answer_chars": MAX_ANSWER_CHARS, "gold_answers": gold_results, "hostile": hostile_results}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
