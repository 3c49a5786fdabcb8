"""The GSM8K reward: throughput on real gold answers and hostile responses, and agreement with math-verify.

Part 1 grades a response for every GSM8K gold answer, with the answer written in several forms
(and one wrong form). Part 2 times responses built to be slow; each stays bounded because answers
over gsm8k_task.MAX_ANSWER_CHARS are refused before parsing and the tag checks are linear in the
response length. Part 3 grades the answer corpus of tests/fixtures/gsm8k/answer_corpus.py (every
gold answer of --data written the ways models write it, plus rare probe forms) with this grader
and with math-verify (the dev dependency), and prints the agreement of each form.

    uv run python -m bench.gsm8k_grader [--data tests/fixtures/gsm8k] [--seconds-per-case 0.3] [--json-out report.json]
"""

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import math_verify

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also run as a file: uv run bench/gsm8k_grader.py

from gsm8k_task import (
    MAX_ANSWER_CHARS, answers_match, extract_gold_answer, load_gsm8k_rows, reward_function,
)
from tests.fixtures.gsm8k.answer_corpus import build_corpus

REPO_ROOT = Path(__file__).resolve().parents[1]

END = "<|endoftext|>"
GOLD = "18"
ANSWER_FORMS = {
    "plain 1234": lambda number: str(number),
    "commas 1,234": lambda number: f"{number:,}",
    "decimal 1234.0": lambda number: f"{number}.0",
    "dollar $1234": lambda number: f"${number}",
    "boxed \\boxed{1,234}": lambda number: f"$\\boxed{{{number:,}}}$",
    "unit 1234 dollars": lambda number: f"{number} dollars",
    "sentence with boxed": lambda number: f"So she makes $\\boxed{{{number}}}$ dollars a day.",
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
    "256 stars (markdown bold)": response_with("*" * MAX_ANSWER_CHARS),
    "36 open \\boxed{": response_with("\\boxed{" * 36),
    "128 numbers 1 1 1 ...": response_with("1 " * 127),
    "1e + 254 nines": response_with("1e" + "9" * 254),
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


def agreement_with_math_verify(golds: list[str]) -> tuple[dict, dict]:
    """Per corpus form: pairs, how many each grader accepts, disagreements, one disagreeing example;
    and the seconds each grader spent on the whole corpus (pair by pair, one after the other)."""
    table = defaultdict(lambda: {"pairs": 0, "ours_accept": 0, "math_verify_accept": 0, "disagree": 0, "example": None})
    seconds = {"ours": 0.0, "math_verify": 0.0}
    math_verify.parse("1")  # its first call builds the LaTeX parser: not part of grading
    for pair in build_corpus(golds):
        start = time.perf_counter()
        ours = answers_match(pair.answer, pair.gold)
        middle = time.perf_counter()
        theirs = math_verify.verify(math_verify.parse(pair.gold), math_verify.parse(pair.answer))
        seconds["ours"] += middle - start
        seconds["math_verify"] += time.perf_counter() - middle
        row = table[pair.form]
        row["pairs"] += 1
        row["ours_accept"] += ours
        row["math_verify_accept"] += theirs
        if ours != theirs:
            row["disagree"] += 1
            row["example"] = row["example"] or f"{pair.answer!r} vs gold {pair.gold}"
    return dict(table), seconds


def print_table(title: str, results: dict) -> None:
    print(f"\n{title:<30} {'calls':>7} {'reward':>7} {'calls/s':>10} {'mean us':>9} {'max us':>9}")
    for name, row in results.items():
        print(
            f"{name:<30} {row['calls']:>7} {row['mean_reward']:>7.3f} {row['calls_per_second']:>10.0f} "
            f"{row['mean_us']:>9.1f} {row['max_us']:>9.1f}"
        )


def print_agreement(table: dict, seconds: dict) -> None:
    pairs = sum(row["pairs"] for row in table.values())
    disagree = sum(row["disagree"] for row in table.values())
    print("\n| form | pairs | ours accept | math-verify accepts | disagree | example |\n|---|---:|---:|---:|---:|---|")
    for form, row in table.items():
        example = (row["example"] or "").replace("|", "\\|")
        counts = " | ".join(str(row[key]) for key in ("pairs", "ours_accept", "math_verify_accept", "disagree"))
        print(f"| {form} | {counts} | {example} |")
    print(f"\nagreement with math-verify: {pairs - disagree}/{pairs} = {(pairs - disagree) / pairs:.2%}")
    print(f"grading time per pair: ours {1e6 * seconds['ours'] / pairs:.0f} us, "
          f"math-verify {1e6 * seconds['math_verify'] / pairs:.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(REPO_ROOT / "tests" / "fixtures" / "gsm8k"),
                        help="GSM8K directory (train.jsonl/test.jsonl or the Hub clone); default: the committed sample")
    parser.add_argument("--seconds-per-case", type=float, default=0.3, help="time spent on each hostile case")
    parser.add_argument("--json-out", help="also write the report as JSON to this file")
    args = parser.parse_args()
    rows = load_gsm8k_rows(args.data, "train") + load_gsm8k_rows(args.data, "test")
    golds = [extract_gold_answer(row["answer"]) for row in rows]
    gold_results = {name: time_gold_answers(golds, form) for name, form in ANSWER_FORMS.items()}
    hostile_results = {name: time_hostile(response, args.seconds_per_case) for name, response in HOSTILE_CASES.items()}
    agreement, agreement_seconds = agreement_with_math_verify(golds)
    print_table(f"{len(golds)} gold answers, as", gold_results)
    print_table("hostile response", hostile_results)
    print_agreement(agreement, agreement_seconds)
    report = {"max_answer_chars": MAX_ANSWER_CHARS, "gold_answers": gold_results, "hostile": hostile_results,
              "agreement": agreement, "agreement_seconds": agreement_seconds}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
