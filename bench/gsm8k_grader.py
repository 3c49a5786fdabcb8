"""The GSM8K reward: throughput on real gold answers and hostile responses, and agreement with math-verify.

Part 1 grades a response for every gold answer read, with the answer written in several forms (and
one wrong form). Part 2 times responses built to be slow; each stays bounded because answers over
gsm8k_task.MAX_ANSWER_CHARS are refused before parsing (a \\boxed{} is found first, by one linear
scan) and the tag checks are linear in the response length. Part 3 grades answer/gold pairs with this
grader and with math-verify (the dev dependency, timeouts off so that its grades do not depend on the
machine's load). tests/fixtures/gsm8k/answer_corpus.py writes them, deterministically, from the gold
answers of the committed sample and of the full GSM8K test split in --data: the short forms models
write (issue 13) and the families of issue 31 (a long worked answer, currency and unit symbols, a
justification, the number's name, an equation with a variable, an exact expression), each written
right and wrong for --answers-per-form gold answers spread over each source. Every pair states its
value by construction, so each grade is judged, and each disagreement is ours-wrong, math-verify-wrong,
or ambiguous (the answer states two values a reader could take). There are no real model outputs of
GSM8K runs in the repository to add to these pairs.

    uv run python -m bench.gsm8k_grader [--data DIR] [--answers-per-form 200] [--seconds-per-case 0.3] [--json-out report.json]

--data defaults to ../shared/data/gsm8k beside the repository. Where it has no test split, the pairs
from it are skipped with a line that says so; without math-verify, part 3 is skipped the same way.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also run as a file: uv run bench/gsm8k_grader.py

from config import InputError
from gsm8k_task import MAX_ANSWER_CHARS, answers_match, extract_gold_answer, grade, load_gsm8k_rows
from tests.fixtures.gsm8k import answer_corpus
from tests.fixtures.gsm8k.answer_corpus import build_corpus, build_family_corpus, math_verify_grade, read_rows

SHARED_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
DISAGREEMENT_KINDS = ("ours_wrong", "math_verify_wrong", "ambiguous")

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
    "10^10^10": response_with("10^10^10"),
    "100k text, then \\boxed{18}": response_with("x " * 50_000 + "\\boxed{18}"),
    "10^(10^100)": response_with("10^(10^100)"),
    "nesting one past the limit": response_with("(" * 33 + "18" + ")" * 33),
    "\\frac x 40 (past nesting)": response_with("\\frac" * 40 + "18"),
    "unary minus chain at limit": response_with("-" * (MAX_ANSWER_CHARS - 4) + "18"),
    "stars (markdown bold) at limit": response_with("*" * MAX_ANSWER_CHARS),
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
        rewards.append(grade(response, gold, END)["reward"])
        durations.append(time.perf_counter() - start)
    return summarize(durations, rewards)


def time_hostile(response: str, seconds: float) -> dict:
    durations, rewards = [], []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(durations) < 5:
        start = time.perf_counter()
        rewards.append(grade(response, GOLD, END)["reward"])
        durations.append(time.perf_counter() - start)
    return {"chars": len(response), **summarize(durations, rewards)}


def full_test_rows(data_dir: Path) -> list[dict]:
    """The full GSM8K test split in data_dir, or none, with a line saying why its pairs are skipped."""
    try:
        return load_gsm8k_rows(data_dir, "test")
    except InputError as error:
        print(f"skipped: the pairs from the full GSM8K test split. {error}")
        return []


def agreement_pairs(sources: dict[str, list[dict]], answers_per_form: int) -> list:
    """Part 3's pairs: each form written for `answers_per_form` gold answers spread over each source's rows."""
    pairs = []
    for rows in filter(None, sources.values()):  # a skipped source has no rows
        golds = [extract_gold_answer(row["answer"]) for row in rows]
        pairs += build_corpus(golds, answers_per_form) + build_family_corpus(rows, answers_per_form)
    return pairs


def judge_against_math_verify(pairs: list) -> dict:
    """Per form: its family, pairs, how many are judged (not ambiguous), how many each grader gets wrong,
    the disagreements by kind, and one disagreeing example."""
    table = {}
    for pair in pairs:
        ours, theirs, truth = answers_match(pair.answer, pair.gold), math_verify_grade(pair.answer, pair.gold), pair.correct
        row = table.setdefault(pair.form, {"family": pair.family, "pairs": 0, "judged": 0, "ours_wrong": 0,
                                           "math_verify_wrong": 0, "disagree": dict.fromkeys(DISAGREEMENT_KINDS, 0),
                                           "example": None})
        row["pairs"] += 1
        if truth is not None:
            row["judged"] += 1
            row["ours_wrong"] += ours != truth
            row["math_verify_wrong"] += theirs != truth
        if ours != theirs:
            kind = "ambiguous" if truth is None else "ours_wrong" if ours != truth else "math_verify_wrong"
            row["disagree"][kind] += 1
            answer = pair.answer if len(pair.answer) <= 60 else "..." + pair.answer[-57:]
            row["example"] = row["example"] or f"{answer!r} (gold {pair.gold}): ours {ours:d}, math-verify {theirs:d}"
    return table


def totals(rows) -> dict:
    rows = list(rows)
    return {key: sum(row[key] for row in rows) for key in ("pairs", "judged", "ours_wrong", "math_verify_wrong")} | {
        "disagree": {kind: sum(row["disagree"][kind] for row in rows) for kind in DISAGREEMENT_KINDS}}


def print_table(title: str, results: dict) -> None:
    print(f"\n{title:<30} {'calls':>7} {'reward':>7} {'calls/s':>10} {'mean us':>9} {'max us':>9}")
    for name, row in results.items():
        print(
            f"{name:<30} {row['calls']:>7} {row['mean_reward']:>7.3f} {row['calls_per_second']:>10.0f} "
            f"{row['mean_us']:>9.1f} {row['max_us']:>9.1f}"
        )


def print_agreement(table: dict) -> None:
    header = "| pairs | judged | ours wrong | math-verify wrong | disagree: ours wrong | math-verify wrong | ambiguous |"
    rule = "|---|" + "---:|" * 7

    def counts(row: dict) -> str:
        return " | ".join(str(value) for value in (row["pairs"], row["judged"], row["ours_wrong"], row["math_verify_wrong"],
                                                   *row["disagree"].values()))

    families = {}
    for row in table.values():
        families.setdefault(row["family"], []).append(row)
    print(f"\n| family {header}\n{rule}")
    for family, rows in families.items():
        print(f"| {family} | {counts(totals(rows))} |")
    total = totals(table.values())
    print(f"| **all** | {counts(total)} |")
    print(f"\n| form {header} example |\n{rule}---|")
    for form, row in table.items():
        print(f"| {form} | {counts(row)} | {(row['example'] or '').replace('|', chr(92) + '|')} |")
    judged, disagree = total["judged"], sum(total["disagree"].values())
    print(f"\nagreement with math-verify: {total['pairs'] - disagree}/{total['pairs']} pairs")
    print(f"ours wrong: {total['ours_wrong']}/{judged} judged pairs = {total['ours_wrong'] / judged:.2%}; "
          f"math-verify wrong: {total['math_verify_wrong']}/{judged} = {total['math_verify_wrong'] / judged:.2%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=SHARED_DIR,
                        help="GSM8K directory with the full test split (test.jsonl or the Hub clone's main/test-*.parquet); "
                             "default: ../shared/data/gsm8k beside the repository")
    parser.add_argument("--answers-per-form", type=int, default=200,
                        help="gold answers each form of part 3 is written for, spread over each source")
    parser.add_argument("--seconds-per-case", type=float, default=0.3, help="time spent on each hostile case")
    parser.add_argument("--json-out", help="also write the report as JSON to this file")
    args = parser.parse_args()
    sources = {"committed sample": read_rows(), f"{args.data} test split": full_test_rows(args.data)}
    rows = [row for source_rows in sources.values() for row in source_rows]
    golds = [extract_gold_answer(row["answer"]) for row in rows]
    gold_results = {name: time_gold_answers(golds, form) for name, form in ANSWER_FORMS.items()}
    hostile_results = {name: time_hostile(response, args.seconds_per_case) for name, response in HOSTILE_CASES.items()}
    print(f"data: {', '.join(f'{name} ({len(source_rows)} rows)' for name, source_rows in sources.items())}")
    print_table(f"{len(golds)} gold answers, as", gold_results)
    print_table("hostile response", hostile_results)
    report = {"sources": {name: len(source_rows) for name, source_rows in sources.items()},
              "max_answer_chars": MAX_ANSWER_CHARS, "gold_answers": gold_results, "hostile": hostile_results}
    if answer_corpus.math_verify is None:
        print("\nskipped: agreement with math-verify, which is not installed; it is in the dev dependency group "
              "(uv sync, then uv run python -m bench.gsm8k_grader)")
    else:
        agreement = judge_against_math_verify(agreement_pairs(sources, args.answers_per_form))
        print_agreement(agreement)
        report |= {"agreement": agreement, "totals": totals(agreement.values())}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
