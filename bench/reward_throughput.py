"""Throughput of the CountDown reward on ordinary and adversarial responses.

Every case must stay far below 10 ms per call: the parser's work is bounded by
countdown_task.MAX_ANSWER_CHARS, and the tag checks are linear in the response length.

    uv run python -m bench.reward_throughput [--seconds-per-case 0.3]
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also run as a file: uv run bench/reward_throughput.py

from countdown_task import MAX_ANSWER_CHARS, grade

END = "<|im_end|>"
NUMBERS, TARGET = [44, 19, 35], 98


def wrap(answer: str) -> str:
    return f"I will add them.</think>\n<answer>{answer}</answer>{END}"


CASES = {
    "correct answer": wrap("44 + 19 + 35"),
    "wrong answer": wrap("44 - 19 + 35"),
    "power tower 44**19**35": wrap("44**19**35"),
    "answer at length limit": wrap("(" * (MAX_ANSWER_CHARS // 2 - 6) + "44+19+35" + ")" * (MAX_ANSWER_CHARS // 2 - 6)),
    "unary minus chain at limit": wrap("-" * (MAX_ANSWER_CHARS - 8) + "44+19+35"),
    "100k open parentheses": wrap("(" * 100_000),
    "100k nested parentheses": wrap("(" * 50_000 + "1" + ")" * 50_000),
    "100k-digit literal": wrap("9" * 100_000),
    "4301-digit literal": wrap("9" * 4301),
    "50k additions": wrap("1" + "+1" * 50_000),
    "100k unary minus": wrap("-" * 100_000 + "1"),
    "100k text, no tags": "x" * 100_000,
    "50k <answer> tags": "<answer>" * 50_000,
    "30k </think> tags": "</think>" * 30_000,
}


def time_case(response: str, seconds: float) -> dict:
    durations = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(durations) < 5:
        start = time.perf_counter()
        result = grade(response, NUMBERS, TARGET, END)
        durations.append(time.perf_counter() - start)
    return {
        "chars": len(response),
        "reward": result["reward"],
        "calls": len(durations),
        "calls_per_second": len(durations) / sum(durations),
        "mean_us": 1e6 * sum(durations) / len(durations),
        "max_us": 1e6 * max(durations),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds-per-case", type=float, default=0.3)
    args = parser.parse_args()
    results = {name: time_case(response, args.seconds_per_case) for name, response in CASES.items()}
    print(f"{'case':<30} {'chars':>8} {'reward':>6} {'calls/s':>10} {'mean us':>9} {'max us':>9}")
    for name, row in results.items():
        print(f"{name:<30} {row['chars']:>8} {row['reward']:>6.1f} {row['calls_per_second']:>10.0f} {row['mean_us']:>9.1f} {row['max_us']:>9.1f}")
    print(json.dumps({"max_answer_chars": MAX_ANSWER_CHARS, "results": results}, indent=2))


if __name__ == "__main__":
    main()
