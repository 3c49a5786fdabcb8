"""CountDown task: the exact reward (rule by rule), the parser, the solver, the generator and the dataset."""

import itertools
import logging
import operator
import random
import re
import string
import subprocess
import sys
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import countdown_task
from countdown_task import (
    MAX_ANSWER_CHARS,
    RESPONSE_PREFILL,
    CountdownDataset,
    answer_reward,
    format_reward,
    grade,
    main,
    parse_expression,
    render_prompt,
    reward,
    solve,
)
from config import DataError, InputError
from tokenizer import Tokenizer

END = "<|im_end|>"
REPO_ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- format reward

FORMAT_CASES = [
    # (response after the "<think>" prefill, expected format reward)
    ("I add them.</think>\n<answer>44 + 19 + 35</answer>", 0.1),
    ("I add them.</think><answer>44 + 19 + 35</answer>", 0.1),  # no whitespace between is fine
    ("x</think> \t\r\n\v\f<answer>x</answer>\n \t", 0.1),  # any ASCII whitespace; answer content is irrelevant
    ("</think><answer></answer>", 0.1),  # empty think and empty answer
    ("x</think>\n<answer>wrong</answer>", 0.1),
    ("x</think>\nSo:<answer>1</answer>", 0.0),  # text between </think> and <answer>
    ("x</think>\n<answer>1</answer> done", 0.0),  # text after </answer>
    ("x</think>\n<answer>1</answer>" + END, 0.0),  # an end token not removed is text after </answer>
    ("x</think>\u00a0<answer>1</answer>", 0.0),  # non-ASCII whitespace is not whitespace
    ("x</think>\n<answer>1</answer>\u3000", 0.0),
    ("<think>x</think>\n<answer>1</answer>", 0.0),  # <think> twice (the prefill already has one)
    ("x</think></think>\n<answer>1</answer>", 0.0),
    ("x</think>\n<answer>1</answer><answer>1</answer>", 0.0),
    ("x</think>\n<answer><answer>1</answer>", 0.0),
    ("x</think>\n<answer>1</answer></answer>", 0.0),
    ("x\n<answer>1</answer>", 0.0),  # no </think>
    ("x</think>\n1</answer>", 0.0),  # no <answer>
    ("x</think>\n<answer>1", 0.0),  # no </answer>
    ("", 0.0),
    ("x<answer>1</answer></think>", 0.0),  # answer before </think>
    ("x</think></answer>1<answer>", 0.0),  # answer tags reversed
    ("x<answer></think>1</answer>", 0.0),
]


@pytest.mark.parametrize("response, expected", FORMAT_CASES)
def test_format_reward(response, expected):
    assert format_reward(response) == expected


# ----------------------------------------------------------------------------- answer reward


def answer(text: str) -> str:
    return f"reasoning</think>\n<answer>{text}</answer>"


ANSWER_CASES = [
    # (answer text, numbers, target, expected answer reward)
    ("44 + 19 + 35", [44, 19, 35], 98, 1.0),
    ("35+44+19", [44, 19, 35], 98, 1.0),  # any order, no spaces
    (" \t44\n+19 \r\n+ 35\f\v", [44, 19, 35], 98, 1.0),  # ASCII whitespace anywhere
    ("((44) + (19 + 35))", [44, 19, 35], 98, 1.0),  # redundant parentheses
    ("44 + 19 - 35", [44, 19, 35], 98, 0.0),  # wrong value
    ("98", [44, 19, 35], 98, 0.0),  # right value, numbers not used
    ("44 + 19 + 35 + 0", [44, 19, 35], 98, 0.0),  # extra number
    ("44 + 54", [44, 19, 35], 98, 0.0),  # missing numbers
    ("44 + 44 + 10", [44, 19, 35], 98, 0.0),  # reused number
    ("3 + 3 + 5", [3, 3, 5], 11, 1.0),  # duplicates among the given numbers
    ("3 + 5 + 3", [3, 5, 3], 11, 1.0),
    ("3 + 5 + 5 - 2", [3, 3, 5], 11, 0.0),  # the duplicate replaced by another number
    ("3 * 3 + 2", [3, 3, 5], 11, 0.0),
    ("5 + 6", [3, 3, 5], 11, 0.0),
    ("(7 / 3) * 3", [7, 3, 3], 7, 1.0),  # exact division
    ("7 / 3 * 3", [7, 3, 3], 7, 1.0),
    ("8 / (3 - 8 / 3)", [3, 3, 8, 8], 24, 1.0),  # floating point gives 23.999999999999993
    ("7 / 3 + 3", [7, 3, 3], 5, 0.0),  # 16/3 is not 5
    ("2 + 3 * 4", [2, 3, 4], 14, 1.0),  # * binds tighter than +
    ("2 + 3 * 4", [2, 3, 4], 20, 0.0),
    ("8 - 3 - 2", [8, 3, 2], 3, 1.0),  # left-associative
    ("8 / 4 / 2", [8, 4, 2], 1, 1.0),
    ("-2 + 3 + 5", [2, 3, 5], 6, 1.0),  # unary minus
    ("3 - -5 + -2", [2, 3, 5], 6, 1.0),
    ("-(2 - 3 - 5)", [2, 3, 5], 6, 1.0),
    ("--2 * 3 + 0", [0, 2, 3], 6, 1.0),
    ("+2 + 3 + 5", [2, 3, 5], 10, 0.0),  # unary plus is not in the grammar
    ("3 / (5 - 5)", [3, 5, 5], 0, 0.0),  # division by zero
    ("(5 - 5) / 3", [3, 5, 5], 0, 1.0),  # zero divided is fine
    ("44 ** 19 ** 35", [44, 19, 35], 98, 0.0),
    ("2 ** 3", [2, 3], 8, 0.0),
    ("6 // 3", [6, 3], 2, 0.0),
    ("5 % 3", [5, 3], 2, 0.0),
    ("2 ^ 3", [2, 3], 1, 0.0),
    ("44 + 19 + 35 = 98", [44, 19, 35], 98, 0.0),
    ("44 + 19 + 35.0", [44, 19, 35], 98, 0.0),
    ("44 + 19 + 35.", [44, 19, 35], 98, 0.0),
    ("1e2 - 2", [1, 2, 2], 98, 0.0),
    ("044 + 19 + 35", [44, 19, 35], 98, 0.0),  # leading zero
    ("44 + 19 + 3_5", [44, 19, 35], 98, 0.0),
    ("x + 44 + 19 + 35", [44, 19, 35], 98, 0.0),
    ("abs(44 + 19 + 35)", [44, 19, 35], 98, 0.0),
    ("int(44) + 19 + 35", [44, 19, 35], 98, 0.0),
    ("__import__('os')", [44, 19, 35], 98, 0.0),
    ("\u0664\u0664 + 19 + 35", [44, 19, 35], 98, 0.0),  # Arabic-Indic digits
    ("\uff14\uff14 + 19 + 35", [44, 19, 35], 98, 0.0),  # fullwidth digits
    ("44 \u2212 19 + 73", [44, 19, 73], 98, 0.0),  # Unicode minus sign
    ("44\u00a0+ 19 + 35", [44, 19, 35], 98, 0.0),  # non-ASCII whitespace
    ("(44 + 19 + 35", [44, 19, 35], 98, 0.0),  # unbalanced parentheses
    ("44 + 19 + 35)", [44, 19, 35], 98, 0.0),
    (")44 + 19 + 35(", [44, 19, 35], 98, 0.0),
    ("44 + 19 + () + 35", [44, 19, 35], 98, 0.0),
    ("44 19 + 35", [44, 19, 35], 98, 0.0),  # two literals in a row
    ("44 + 19 + 35 +", [44, 19, 35], 98, 0.0),
    ("(44)(19) + 35", [44, 19, 35], 98, 0.0),  # implicit multiplication
    ("", [44, 19, 35], 98, 0.0),
    (" \n ", [44, 19, 35], 98, 0.0),
    ("44 + 19 + 35\x00", [44, 19, 35], 98, 0.0),
    ("(" * 120 + "44 + 19 + 35" + ")" * 120, [44, 19, 35], 98, 1.0),  # deep nesting within the length limit
    ("-" * 240 + "44 + 19 + 35", [44, 19, 35], 98, 1.0),  # an even number of unary minuses
]


@pytest.mark.parametrize("text, numbers, target, expected", ANSWER_CASES)
def test_answer_reward(text, numbers, target, expected):
    assert answer_reward(answer(text), numbers, target) == expected


TAG_CASES = [
    # (response, expected answer reward) for numbers [44, 19, 35] and target 98
    ("<answer>44 + 19 + 35</answer>", 1.0),  # the format is not required
    ("no think tags here <answer>44 + 19 + 35</answer> and text after", 1.0),
    ("x</think>\n<answer>44 + 19 + 35</answer><answer>1</answer>", 0.0),  # two answers
    ("x</think>\n<answer>44 + 19 + 35</answer></answer>", 0.0),
    ("x</think>\n<answer><answer>44 + 19 + 35</answer>", 0.0),
    ("x</think>\n</answer>44 + 19 + 35<answer>", 0.0),  # reversed tags
    ("x</think>\n<answer>44 + 19 + 35", 0.0),
    ("x</think>\n44 + 19 + 35</answer>", 0.0),
    ("44 + 19 + 35", 0.0),
    ("<ANSWER>44 + 19 + 35</ANSWER>", 0.0),
]


@pytest.mark.parametrize("response, expected", TAG_CASES)
def test_answer_reward_tags(response, expected):
    assert answer_reward(response, [44, 19, 35], 98) == expected


def test_answer_length_limit_is_exact():
    expression = "44 + 19 + 35"
    at_limit = expression + " " * (MAX_ANSWER_CHARS - len(expression))
    assert answer_reward(f"<answer>{at_limit}</answer>", [44, 19, 35], 98) == 1.0
    assert answer_reward(f"<answer>{at_limit} </answer>", [44, 19, 35], 98) == 0.0


# ----------------------------------------------------------------------------- total reward and end token

REWARD_CASES = [
    # (response, end_token, expected format reward, expected answer reward)
    ("x</think>\n<answer>44 + 19 + 35</answer>" + END, END, 0.1, 1.0),
    ("x</think>\n<answer>44 + 19 + 35</answer>", END, 0.1, 1.0),  # end token absent (length cut)
    ("x</think>\n<answer>44 + 19 + 35</answer>", None, 0.1, 1.0),
    ("x</think>\n<answer>44 + 19 + 35</answer>" + END, None, 0.0, 1.0),
    ("x</think>\n<answer>44 + 19 + 35</answer>\n" + END, END, 0.1, 1.0),
    ("x</think>\n<answer>44 + 19 + 35</answer>" + END + "\n", END, 0.0, 1.0),  # not at the very end
    ("x</think>\n<answer>44 + 19 + 35</answer>" + END + END, END, 0.0, 1.0),  # removed once
    (END + " x</think>\n<answer>44 + 19 + 35</answer>", END, 0.1, 1.0),  # only a final one is removed
    ("x</think>\n<answer>44 + 19 - 35</answer>" + END, END, 0.1, 0.0),
    ("x</think> so <answer>44 + 19 + 35</answer>" + END, END, 0.0, 1.0),
    ("x</think>\n<answer>44 + 19 + 35" + END, END, 0.0, 0.0),
]


@pytest.mark.parametrize("response, end_token, expected_format, expected_answer", REWARD_CASES)
def test_grade(response, end_token, expected_format, expected_answer):
    result = grade(response, [44, 19, 35], 98, end_token)
    assert result == {
        "reward": expected_format + expected_answer,
        "reward_info": {"format_reward": expected_format, "answer_reward": expected_answer, "try_reward": 0.0,
                        "distinct_try_reward": 0.0},
    }
    item = {"nums": [44, 19, 35], "target": 98, "prompt": "unused", "prompt_token_ids": [1]}
    assert reward(response, item, end_token) == result


ADVERSARIAL_ANSWERS = [
    "(" * 100_000,
    ")" * 100_000,
    "(" * 50_000 + "1" + ")" * 50_000,
    "-" * 100_000 + "1",
    "1" + "+1" * 50_000,
    "9" * 100_000,  # Python refuses int() of more than 4300 digits
    "9" * 4301,
    "44 ** 19 ** 35",
    "9 ** 9 ** 9",
    "<answer>" * 50_000,
    "\x00" * 100_000,
    "\ud800" * 1000,  # lone surrogates
]


@pytest.mark.parametrize("text", ADVERSARIAL_ANSWERS, ids=lambda text: f"{text[:12]!r}x{len(text)}")
def test_adversarial_answers_score_zero_without_raising(text):
    assert grade(answer(text) + END, [44, 19, 35], 98, END)["reward_info"]["answer_reward"] == 0.0
    assert parse_expression(text) is None


def test_adversarial_whole_responses_score_zero():
    for response in ("</think>" * 30_000, "<think>" * 30_000, "x" * 100_000, "</answer><answer>" * 10_000):
        assert grade(response, [1, 2, 3], 6, END)["reward"] == 0.0


# ----------------------------------------------------------------------------- parser against Fraction arithmetic

ARITHMETIC = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}


@st.composite
def expression_trees(draw, numbers):
    """(text, Fraction value or None on division by zero) of a random fully parenthesized tree."""
    whitespace = st.text(alphabet=string.whitespace, max_size=2)
    nodes = [(str(number), Fraction(number)) for number in numbers]
    while len(nodes) > 1:
        left = nodes.pop(draw(st.integers(0, len(nodes) - 1)))
        right = nodes.pop(draw(st.integers(0, len(nodes) - 1)))
        symbol = draw(st.sampled_from("+-*/"))
        if left[1] is None or right[1] is None or (symbol == "/" and right[1] == 0):
            value = None
        else:
            value = ARITHMETIC[symbol](left[1], right[1])
        text = f"({draw(whitespace)}{left[0]}{draw(whitespace)}{symbol}{draw(whitespace)}{right[0]}{draw(whitespace)})"
        if draw(st.booleans()):
            text, value = f"-{draw(whitespace)}{text}", None if value is None else -value
        nodes.append((text, value))
    return nodes[0]


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_random_trees_score_exactly_when_their_value_is_the_target(data):
    numbers = data.draw(st.lists(st.integers(0, 30), min_size=1, max_size=4))
    text, value = data.draw(expression_trees(numbers))
    integer_value = value is not None and value.denominator == 1
    target = data.draw(st.integers(-50, 50) | st.just(int(value) if integer_value else 0))
    given_numbers = data.draw(st.permutations(numbers))
    expected = 1.0 if value is not None and value == target else 0.0
    assert answer_reward(f"<answer>{text}</answer>", given_numbers, target) == expected
    wrong_numbers = given_numbers[:-1] + [given_numbers[-1] + 1]
    assert answer_reward(f"<answer>{text}</answer>", wrong_numbers, target) == 0.0


def evaluate_flat(numbers: list[int], symbols: list[str]) -> Fraction | None:
    """Reference precedence: fold * and / left to right into terms, then + and - left to right."""
    terms, signs = [Fraction(numbers[0])], []
    for symbol, number in zip(symbols, numbers[1:]):
        if symbol in "*/":
            if symbol == "/" and number == 0:
                return None
            terms[-1] = ARITHMETIC[symbol](terms[-1], Fraction(number))
        else:
            terms.append(Fraction(number))
            signs.append(symbol)
    total = terms[0]
    for sign, term in zip(signs, terms[1:]):
        total = ARITHMETIC[sign](total, term)
    return total


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_unparenthesized_expressions_follow_precedence_and_associativity(data):
    numbers = data.draw(st.lists(st.integers(0, 12), min_size=1, max_size=6))
    symbols = data.draw(st.lists(st.sampled_from("+-*/"), min_size=len(numbers) - 1, max_size=len(numbers) - 1))
    text = str(numbers[0]) + "".join(f" {symbol} {number}" for symbol, number in zip(symbols, numbers[1:]))
    expected = evaluate_flat(numbers, symbols)
    assert parse_expression(text) == (None if expected is None else (expected, numbers))


# ----------------------------------------------------------------------------- solver


def reachable_values(numbers: list[int]) -> set[Fraction]:
    """Independent brute force: every order of the numbers, every bracketing of that sequence."""

    def values_of_sequence(sequence: tuple[int, ...]) -> set[Fraction]:
        if len(sequence) == 1:
            return {Fraction(sequence[0])}
        values = set()
        for split in range(1, len(sequence)):
            for left in values_of_sequence(sequence[:split]):
                for right in values_of_sequence(sequence[split:]):
                    values |= {left + right, left - right, left * right}
                    if right != 0:
                        values.add(left / right)
        return values

    return set().union(*(values_of_sequence(order) for order in itertools.permutations(numbers)))


def check_solution(numbers: list[int], target: int, solution: str) -> None:
    value, literals = parse_expression(solution)
    assert value == target and Counter(literals) == Counter(numbers), (numbers, target, solution)


@pytest.mark.parametrize("numbers", [[5], [2, 3], [1, 1, 1], [3, 3, 8, 8], [2, 5, 7], [4, 6, 9], [1, 2, 3, 4], [0, 7, 7]])
def test_solver_agrees_with_independent_brute_force(numbers):
    reachable = reachable_values(numbers)
    for target in range(0, 41):
        solution = solve(numbers, target)
        assert (solution is not None) == (target in reachable), (numbers, target)
        if solution is not None:
            check_solution(numbers, target, solution)


@pytest.mark.parametrize("integer_steps", [False, True])
def test_solver_on_random_small_cases(integer_steps):
    """Every step (rational), or the public generator's integer steps only, against its own brute force."""
    rng = random.Random(4 if integer_steps else 0)
    for _ in range(60 if integer_steps else 30):
        numbers = [rng.randint(1, 30 if integer_steps else 12) for _ in range(rng.randint(1, 4 if integer_steps else 3))]
        reachable = integer_step_values(numbers) if integer_steps else reachable_values(numbers)
        for target in range(0, 60):
            solution = solve(numbers, target, integer_steps=integer_steps)
            assert (solution is not None) == (target in reachable), (numbers, target)
            if solution is not None:
                check_solution(numbers, target, solution)


def test_solver_known_cases():
    check_solution([3, 3, 8, 8], 24, solve([3, 3, 8, 8], 24))  # only 8 / (3 - 8 / 3) works
    check_solution([44, 19, 35], 98, solve([44, 19, 35], 98))
    assert solve([1, 1, 1], 100) is None
    assert solve([1, 2, 3, 4], 1000) is None


# ----------------------------------------------------------------------------- generator and dataset


def generate(out_dir, *options: str) -> pa.Table:
    main(["generate", "--out", str(out_dir), *options])
    return pq.read_table(out_dir / "data" / "train-00000-of-00001.parquet")


def integer_step_values(numbers: list[int]) -> set[int]:
    """Independent brute force of the public generator's steps: every order of the numbers, every bracketing,
    each step a + b, a * b, larger minus smaller or exact division of the larger by the smaller."""

    def values_of_sequence(sequence: tuple[int, ...]) -> set[int]:
        if len(sequence) == 1:
            return {sequence[0]}
        values = set()
        for split in range(1, len(sequence)):
            for left in values_of_sequence(sequence[:split]):
                for right in values_of_sequence(sequence[split:]):
                    larger, smaller = max(left, right), min(left, right)
                    values |= {larger + smaller, larger * smaller, larger - smaller}
                    if smaller and larger % smaller == 0:
                        values.add(larger // smaller)
        return values

    return set().union(*(values_of_sequence(order) for order in itertools.permutations(numbers)))


def plus_minus_solvable(numbers: list[int], target: int) -> bool:
    """Whether some sum of the numbers, each added or subtracted, is the target (+ and - alone)."""
    return any(sum(sign * number for sign, number in zip(signs, numbers)) == target
               for signs in itertools.product((1, -1), repeat=len(numbers)))


def test_generator_writes_solvable_tasks_in_the_hub_layout(tmp_path):
    table = generate(tmp_path, "--size", "200", "--seed", "1", "--with-solutions")
    assert table.schema == pa.schema([("target", pa.int64()), ("nums", pa.list_(pa.int64())), ("solution", pa.string())])
    assert table.num_rows == 200
    for row in table.to_pylist():
        assert 3 <= len(row["nums"]) <= 4 and all(1 <= number <= 99 for number in row["nums"])
        assert 10 <= row["target"] <= 100
        assert row["target"] in integer_step_values(row["nums"])
        check_solution(row["nums"], row["target"], row["solution"])
    assert Counter(len(row["nums"]) for row in table.to_pylist()).keys() == {3, 4}


@pytest.mark.slow
def test_generator_draws_as_the_public_dataset(tmp_path):
    """The public procedure (target uniform in 10..100 first, numbers uniform in 1..99 redrawn until solvable)
    makes 72% of 3-number and 35% of 4-number tasks solvable with + and - alone (figures from an independent
    simulation, issue 42); the old numbers-first generator made 89% and 80%. 1,500 rows a count: SE <= 1.3 points."""
    for count, plus_minus_share in ((3, 0.72), (4, 0.35)):
        rows = generate(tmp_path / str(count), "--size", "1500", "--seed", "0", "--min-numbers", str(count),
                        "--max-numbers", str(count)).to_pylist()
        share = sum(plus_minus_solvable(row["nums"], row["target"]) for row in rows) / len(rows)
        assert abs(share - plus_minus_share) < 0.04, (count, share)
        targets = Counter(row["target"] for row in rows)
        assert min(targets) == 10 and max(targets) == 100
        # The target is drawn before the numbers, so it stays uniform: each of the 91 values ~16 times.
        assert max(targets.values()) < 40 and len(targets) == 91
        numbers = [number for row in rows for number in row["nums"]]
        assert min(numbers) == 1 and max(numbers) == 99
        assert all(row["target"] in integer_step_values(row["nums"]) for row in rows[:300])


def test_generator_options_and_determinism(tmp_path):
    options = ["--size", "100", "--min-numbers", "2", "--max-numbers", "2", "--min-number", "5", "--max-number", "9", "--min-target", "10", "--max-target", "14"]
    first = generate(tmp_path / "a", *options, "--seed", "7")
    assert first.column_names == ["target", "nums"]  # no solution column unless asked
    assert first.equals(generate(tmp_path / "b", *options, "--seed", "7"))
    assert not first.equals(generate(tmp_path / "c", *options, "--seed", "8"))
    for row in first.to_pylist():
        assert len(row["nums"]) == 2 and all(5 <= number <= 9 for number in row["nums"])
        assert 10 <= row["target"] <= 14 and row["target"] in integer_step_values(row["nums"])


@pytest.mark.parametrize("options, message", [
    (["--size", "0"], "--size 0: need at least 1"),
    (["--min-numbers", "0"], "need 1 <= --min-numbers"),
    (["--min-numbers", "4", "--max-numbers", "3"], "need 1 <= --min-numbers <= --max-numbers <= 6"),
    (["--max-numbers", "7"], "<= 6"),
    (["--min-number", "0"], "need 1 <= --min-number"),
    (["--min-number", "50", "--max-number", "40"], "need 1 <= --min-number <= --max-number"),
    (["--min-target", "0"], "need 1 <= --min-target"),
    (["--min-target", "60", "--max-target", "50"], "need 1 <= --min-target <= --max-target"),
    (["--max-number", "2", "--min-target", "50"], "4 numbers of at most 2 reach at most 16, so no task is solvable"),
    (["--max-number", "1", "--min-target", "10"], "reach at most 4"),
])
def test_generator_refuses_bad_arguments_before_any_work(tmp_path, options, message):
    with pytest.raises(InputError, match=re.escape(message)):
        generate(tmp_path, "--size", "5", *options)
    assert not any(tmp_path.iterdir())


def test_generator_command_answers_bad_arguments_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, "countdown_task.py", "generate", "--out", str(tmp_path / "data"),
                             "--size", "5", "--max-numbers", "9"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: countdown_task.py generate: --min-numbers 3 --max-numbers 9")
    assert not (tmp_path / "data").exists()


def test_generator_names_a_target_its_numbers_cannot_reach(tmp_path, monkeypatch):
    monkeypatch.setattr(countdown_task, "MAX_NUMBER_DRAWS", 50)
    # 2 numbers of 1..3 reach at most 9: the range check passes (3 * 3 >= 9), and a target of 9 needs 3 and 3.
    with pytest.raises(DataError, match="50 draws of 2 numbers in \\[1, 3\\] solved no task with target 8; widen"):
        generate(tmp_path, "--size", "1", "--min-numbers", "2", "--max-numbers", "2", "--max-number", "3",
                 "--min-target", "8", "--max-target", "8")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


def test_prompt_text(tokenizer):
    expected = (
        "<|im_start|>system\nYou are a helpful assistant. You first think about the reasoning process in your mind "
        "and then provide the user with the answer.<|im_end|>\n"
        "<|im_start|>user\nUsing the numbers [44, 19, 35], create an equation that equals 98. You can use basic "
        "arithmetic operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> "
        "tags. And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
        "<|im_end|>\n<|im_start|>assistant\nLet me solve this step by step.\n<think>"
    )
    assert render_prompt(tokenizer, [44, 19, 35], 98) == expected


def test_dataset_reads_generated_data(tmp_path, tokenizer):
    table = generate(tmp_path, "--size", "30", "--seed", "2", "--with-solutions").to_pylist()
    train = CountdownDataset(tmp_path, tokenizer, split="train", test_size=8)
    test = CountdownDataset(tmp_path, tokenizer, split="test", test_size=8)
    assert len(train) == 22 and len(test) == 8
    for dataset, rows in ((train, table[:22]), (test, table[22:])):
        for index, row in enumerate(rows):
            item = dataset[index]
            assert {key: item[key] for key in ("nums", "target", "solution")} == row
            assert item["prompt"] == render_prompt(tokenizer, row["nums"], row["target"])
            assert item["prompt"].endswith(RESPONSE_PREFILL)
            assert item["prompt_token_ids"] == tokenizer.encode(item["prompt"])
    assert len(CountdownDataset(tmp_path, tokenizer, split="train", test_size=0)) == 30


def test_dataset_reads_parquet_files_in_sorted_order(tmp_path, tokenizer):
    (tmp_path / "data").mkdir()
    for name, target in (("train-00001-of-00002.parquet", 2), ("train-00000-of-00002.parquet", 1)):
        pq.write_table(pa.table({"nums": [[1, 2, 3]], "target": [target]}), tmp_path / "data" / name)
    dataset = CountdownDataset(tmp_path, tokenizer, split="train", test_size=1)
    assert len(dataset) == 1 and dataset[0]["target"] == 1 and "solution" not in dataset[0]
    assert CountdownDataset(tmp_path, tokenizer, split="test", test_size=1)[0]["target"] == 2


def test_training_questions_filtered_by_number_count(tmp_path, tokenizer):
    """rollout.train_number_counts: the questions of those counts, in their order; counts the data lacks are refused
    with the counts it has."""
    (tmp_path / "data").mkdir()
    rows = {"nums": [[1, 2], [1, 2, 3], [4, 5, 6, 7], [3, 4], [2, 3, 4], [5, 6]], "target": [3, 6, 22, 7, 9, 11]}
    pq.write_table(pa.table(rows), tmp_path / "data" / "train-00000-of-00001.parquet")
    train = CountdownDataset(tmp_path, tokenizer, split="train", test_size=1)
    three = train.with_number_counts([3])
    assert [(three[i]["nums"], three[i]["target"]) for i in range(len(three))] == [([1, 2, 3], 6), ([2, 3, 4], 9)]
    two_or_four = train.with_number_counts([4, 2])
    assert [two_or_four[i]["nums"] for i in range(len(two_or_four))] == [[1, 2], [4, 5, 6, 7], [3, 4]]
    assert len(train) == 5  # the dataset it came from is unchanged
    with pytest.raises(DataError, match=r"train_number_counts \[5\]: no training question has that many numbers "
                                        r"\(these have 2/3/4\)"):
        train.with_number_counts([5])


def test_training_rows_never_repeat_a_held_out_question(tmp_path, tokenizer, caplog):
    """Same numbers in any order and the same target is the same question: it stays in the test split only."""
    (tmp_path / "data").mkdir()
    rows = {"nums": [[1, 2, 3], [3, 1, 2], [1, 2, 3], [2, 3, 4], [1, 2, 2], [3, 2, 1]], "target": [6, 6, 7, 9, 6, 6]}
    pq.write_table(pa.table(rows), tmp_path / "data" / "train-00000-of-00001.parquet")
    with caplog.at_level(logging.INFO, logger="countdown"):
        train = CountdownDataset(tmp_path, tokenizer, split="train", test_size=1)
    assert [(train[i]["nums"], train[i]["target"]) for i in range(len(train))] == [([1, 2, 3], 7), ([2, 3, 4], 9), ([1, 2, 2], 6)]
    assert "left out 2 training rows" in caplog.text
    test = CountdownDataset(tmp_path, tokenizer, split="test", test_size=1)
    assert len(test) == 1 and test[0]["nums"] == [3, 2, 1]


@pytest.mark.parametrize("make_dir", [lambda path: None, lambda path: (path / "data").mkdir(parents=True)])
def test_missing_data_names_both_ways_to_get_it(tmp_path, tokenizer, make_dir):
    data_dir = tmp_path / "countdown"
    make_dir(data_dir)
    with pytest.raises(FileNotFoundError) as error:
        CountdownDataset(data_dir, tokenizer)
    assert "git clone https://huggingface.co/datasets/Jiayi-Pan/Countdown-Tasks-3to4" in str(error.value)
    assert "uv run countdown_task.py generate" in str(error.value)


def test_dataset_rejects_bad_split_and_test_size(tmp_path, tokenizer):
    generate(tmp_path, "--size", "5", "--seed", "0")
    with pytest.raises(ValueError, match="test_size"):
        CountdownDataset(tmp_path, tokenizer, test_size=5)
    with pytest.raises(ValueError, match="split"):
        CountdownDataset(tmp_path, tokenizer, split="validation", test_size=1)


def test_git_lfs_pointer_is_named(tmp_path, tokenizer):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train-00000-of-00001.parquet").write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(ValueError, match="git lfs pull"):
        CountdownDataset(tmp_path, tokenizer)


def test_sft_response_spells_out_steps_and_scores_full_reward(tmp_path):
    countdown_task.main(["generate", "--out", str(tmp_path), "--size", "200", "--seed", "3", "--with-solutions"])
    table = countdown_task.read_tasks(tmp_path)
    for nums, target, solution in zip(*(table.column(name).to_pylist() for name in ("nums", "target", "solution"))):
        response = countdown_task.sft_response({"nums": nums, "target": target, "solution": solution})
        assert countdown_task.grade(response, nums, target)["reward"] == pytest.approx(1.1)
        steps = response.split("</think>")[0].strip().split(", ")
        assert len(steps) == len(nums) - 1 and steps[-1].endswith(f"= {target}")
    assert countdown_task.sft_response({"solution": "(3 + 5) * 2"}) == (
        " 3 + 5 = 8, 8 * 2 = 16 </think>\n<answer> (3 + 5) * 2 </answer>"
    )


@pytest.mark.parametrize("question_last", [False, True])
def test_shortest_prompt_bounds_every_generated_prompt(tmp_path, tokenizer, question_last):
    argv = ["generate", "--out", str(tmp_path), "--size", "300", "--seed", "1", "--min-numbers", "2",
            "--max-numbers", "3", "--max-number", "20", "--max-target", "40"]
    countdown_task.main(argv)
    args = countdown_task.command_line_parser().parse_args(argv)
    dataset = CountdownDataset(tmp_path, tokenizer, "train", test_size=0, question_last=question_last)
    lengths = [len(dataset[index]["prompt_token_ids"]) for index in range(len(dataset))]
    shortest = len(countdown_task.shortest_prompt(tokenizer, args, question_last))
    # A lower bound (bootstrap.py refuses a rollout.max_prompt_len under it), and a tight one: two one-digit
    # numbers and a two-digit target are among 300 draws from [1, 20] and [10, 40].
    assert shortest <= min(lengths) <= shortest + 2


def test_search_response_by_hand():
    # [44, 19, 35] -> 98: the first step nearest 98 is 44 + 35 = 79 (19 away), and 79 + 19 is 98 at once.
    assert countdown_task.sft_search_response({"nums": [44, 19, 35], "target": 98}) == (
        " 44 + 35 = 79, 79 + 19 = 98 </think>\n<answer> 44 + 35 + 19 </answer>")
    # [93, 11, 6] -> 27: first steps by distance 11 + 6 = 17, 11 - 6 = 5, 11 * 6 = 66; the last step nearest 27
    # from [93, 17] is 76, from [93, 5] 88: two dead ends, then 93 - 66.
    item = {"nums": [93, 11, 6], "target": 27}
    assert countdown_task.sft_search_response(item) == (
        " 11 + 6 = 17, 93 - 17 = 76 (not 27); 11 - 6 = 5, 93 - 5 = 88 (not 27); 11 * 6 = 66, 93 - 66 = 27 </think>\n"
        "<answer> 93 - 11 * 6 </answer>")
    assert countdown_task.sft_search_response(item, max_dead_ends=1) == (
        " 11 + 6 = 17, 93 - 17 = 76 (not 27); 11 * 6 = 66, 93 - 66 = 27 </think>\n<answer> 93 - 11 * 6 </answer>")


def test_full_search_response_by_hand():
    # [5, 7, 3] -> 36: first steps by distance to 36 are 7 * 5 = 35, 7 * 3 = 21, 5 * 3 = 15, 7 + 5 = 12; the last
    # step nearest 36 from [35, 3] is 38, from [21, 5] 26, from [15, 7] 22, from [12, 3] 36: three dead ends.
    item = {"nums": [5, 7, 3], "target": 36}
    assert countdown_task.sft_full_search_response(item, max_tries=4) == (
        " 7 * 5 = 35, 35 + 3 = 38 (not 36); 7 * 3 = 21, 21 + 5 = 26 (not 36); 5 * 3 = 15, 15 + 7 = 22 (not 36); "
        "7 + 5 = 12, 12 * 3 = 36 </think>\n<answer> (7 + 5) * 3 </answer>")
    assert countdown_task.sft_full_search_response(item, max_tries=3) is None
    # The capped search response jumps from its second dead end to the solution instead.
    two_dead_ends = (" 7 * 5 = 35, 35 + 3 = 38 (not 36); 7 * 3 = 21, 21 + 5 = 26 (not 36); 7 + 5 = 12, 12 * 3 = 36 "
                     "</think>\n<answer> (7 + 5) * 3 </answer>")
    assert countdown_task.sft_search_response(item) == two_dead_ends
    # With a budget instead of a count: as many dead ends as fit, the whole search when it all fits.
    whole = countdown_task.sft_full_search_response(item, max_tries=4)
    assert countdown_task.sft_search_response(item, fits=lambda text: True) == whole
    assert countdown_task.sft_search_response(item, fits=lambda text: len(text) < len(whole)) == two_dead_ends
    assert countdown_task.sft_search_response(item, fits=lambda text: False) == (
        " 7 + 5 = 12, 12 * 3 = 36 </think>\n<answer> (7 + 5) * 3 </answer>")


def last_step_values(big: int, small: int) -> list[int]:
    return [big + small, big * small, big - small] + ([big // small] if small and big % small == 0 else [])


def test_full_search_responses_write_the_search_in_its_order(tmp_path):
    rows = generate(tmp_path, "--size", "120", "--seed", "7").to_pylist()
    tries_needed = Counter()
    for row in rows:
        target, uncapped = row["target"], countdown_task.search_tries(row["nums"], row["target"])
        assert uncapped[-1][0] == target and all(tree[0] != target for tree in uncapped[:-1])  # complete
        for max_tries in (1, 6):
            response = countdown_task.sft_full_search_response(row, max_tries)
            assert (response is None) == (len(uncapped) > max_tries)
        response = countdown_task.sft_full_search_response(row, len(uncapped))
        assert grade(response, row["nums"], target)["reward"] == pytest.approx(1.1)
        written = [attempt.removesuffix(f" (not {target})").split(", ")
                   for attempt in response.split(" </think>")[0].strip().split("; ")]
        assert [replay(row["nums"], steps) for steps in written] == [tree[0] for tree in uncapped]
        if len(row["nums"]) == 3:
            # One try per first step, nearest the target first, each ending in the last step nearest the target.
            first_values = [int(steps[0].split()[-1]) for steps in written]
            assert [abs(value - target) for value in first_values] == sorted(abs(v - target) for v in first_values)
            for steps in written:
                big, _, small, _, value = steps[1].split()
                assert abs(int(value) - target) == min(abs(v - target) for v in last_step_values(int(big), int(small)))
        assert grade(response, row["nums"], target)["reward_info"]["try_reward"] == 1.0  # every try is exact
        first_result = written[0][0].split(" = ")[1]  # one wrong result spoils its try, and only that one
        wrong = response.replace(f" = {first_result}", f" = {int(first_result) + 1}", 1)
        assert countdown_task.try_reward(wrong, row["nums"]) == pytest.approx(1 - 1 / len(written))
        tries_needed[len(row["nums"]), min(len(uncapped), 7)] += 1
    assert tries_needed[3, 1] and tries_needed[3, 7] and tries_needed[4, 7]  # at once, and beyond the cap


def replay(numbers: list[int], steps: list[str]) -> int:
    """The value of a try's steps, checking that each uses two numbers still available as an integer step."""
    available = Counter(numbers)
    for step in steps:
        left, symbol, right, _, value = step.split()
        left, right, value = int(left), int(right), int(value)
        assert available[left] > 0 and left >= right, step
        available[left] -= 1
        assert available[right] > 0, step
        available[right] -= 1
        assert value == {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}[symbol](
            left, right), step
        assert symbol != "/" or left % right == 0, step
        available[value] += 1
    assert sum(available.values()) == 1
    return value


def test_search_responses_are_searches_that_end_solved(tmp_path):
    rows = generate(tmp_path, "--size", "150", "--seed", "5", "--min-numbers", "2").to_pylist()
    dead_ends = Counter()
    for row in rows:
        response = countdown_task.sft_search_response(row)
        assert grade(response, row["nums"], row["target"])["reward"] == pytest.approx(1.1)
        assert countdown_task.try_reward(response, row["nums"]) == 1.0
        tries = response.split(" </think>")[0].strip().split("; ")
        assert len(tries) <= countdown_task.SEARCH_DEAD_ENDS + 1
        for index, attempt in enumerate(tries):
            failed = attempt.endswith(f" (not {row['target']})")
            assert failed == (index < len(tries) - 1)
            steps = attempt.removesuffix(f" (not {row['target']})").split(", ")
            assert len(steps) == len(row["nums"]) - 1
            assert (replay(row["nums"], steps) == row["target"]) != failed
        dead_ends[len(tries) - 1] += 1
    assert dead_ends[0] and dead_ends[countdown_task.SEARCH_DEAD_ENDS]  # some solved at once, some after dead ends


TRY_CASES = [
    # (response, numbers, exact tries / tries written)
    (" 44 + 35 = 79, 79 - 19 = 60 (not 98); 44 + 19 = 63, 63 + 35 = 98 </think>", [44, 19, 35], 2 / 2),
    (" 95 - 56 = 39, 39 + 22 = 61 </think>", [95, 56, 22], 1 / 1),
    (" 95 - 56 = 34, 34 + 22 = 56 </think>", [95, 56, 22], 0 / 1),  # a wrong step spoils its try
    (" 97 + 27 = 99 </think>\n<answer> 97 - 27 + 29 </answer>", [97, 27, 29], 0 / 1),  # a claimed target
    (" 43 + 1 = 44, 44 + 18 = 53 </think>", [43, 1, 18, 4], 0 / 1),  # one easy right step
    (" 43 + 1 = 44, 44 + 18 = 62 </think>", [43, 1, 18, 4], 0 / 1),  # right, but 4 is never used
    (" 97 + 27 = 124, 124 + 29 = 153 (not 99); 97 + 27 = 99 </think>", [97, 27, 29], 1 / 2),  # each try afresh
    (" 5 + 5 = 10, 10 * 3 = 30 </think>", [5, 7, 3], 0 / 1),  # one 5 only
    (" 5 + 5 = 10, 10 * 3 = 30 </think>", [5, 5, 3], 1 / 1),
    (" 7 + 3 = 10, 7 * 10 = 70 </think>", [7, 3, 2], 0 / 1),  # 7 was used by the first step
    (" 84 / 4 = 21, 21 - 2 = 19; 7 / 2 = 3, 84 - 3 = 81; 84 / 00 = 0 </think>", [84, 4, 2], 1 / 3),  # exact only
    (" 3 - 7 = 4 </think>", [3, 7], 0 / 1),
    (" 7 - 3 = 4 </think>", [3, 7], 1 / 1),
    (" 12 + 3 = 15 </think>\n<answer> 12 + 3 = 15 </answer>", [12, 3], 1 / 1),  # the answer's text is not a try
    (" let me think; 12 + 3 = 15 </think>", [12, 3], 1 / 1),  # a part without a step is no try
    (" 12 + 3 is 15 </think>", [12, 3], 0.0),  # no try written
    (" " + "9" * 5000 + " + 1 = 2 </think>", [1], 0.0),  # a literal too long to read is no step
    (" 112 + 3 = 115 </think>", [12, 3], 0 / 1),  # not 12 + 3 inside a longer literal
]


@pytest.mark.parametrize("response, numbers, expected", TRY_CASES)
def test_try_reward_by_hand(response, numbers, expected):
    assert countdown_task.try_reward(response, numbers) == pytest.approx(expected)


DISTINCT_TRY_CASES = [
    # (response, numbers, exact tries written for the first time / tries written)
    (" 97 - 45 = 52, 52 + 3 = 55 (not 82); 97 - 45 = 52, 52 + 3 = 55 (not 82); 97 - 45 = 52, 52 + 3 = 55 </think>",
     [45, 97, 3], 1 / 3),  # one try written three times; the last drops the "(not 82)"
    (" 44 + 35 = 79, 79 - 19 = 60 (not 98); 44 + 19 = 63, 63 + 35 = 98 </think>", [44, 19, 35], 2 / 2),
    (" 44 + 35 = 79, 79 - 19 = 60 (not 98); 35 + 44 = 79, 79 - 19 = 60 </think>", [44, 19, 35], 2 / 2),  # new order
    (" 95 - 56 = 34, 34 + 22 = 56; 95 - 56 = 34, 34 + 22 = 56; 95 - 56 = 39, 39 + 22 = 61 </think>",
     [95, 56, 22], 1 / 3),  # a wrong try repeated stays wrong
    (" 12 + 3 = 15 </think>", [12, 3], 1 / 1),
    (" 12 + 3 is 15 </think>", [12, 3], 0.0),
]


@pytest.mark.parametrize("response, numbers, expected", DISTINCT_TRY_CASES)
def test_distinct_try_reward_by_hand(response, numbers, expected):
    assert countdown_task.try_reward(response, numbers, distinct=True) == pytest.approx(expected)


def test_try_reward_is_kept_out_of_the_task_reward():
    response = " 44 + 35 = 79, 79 + 19 = 98; 44 + 35 = 79, 79 + 19 = 98 </think>\n<answer> 44 + 35 - 19 </answer>"
    assert grade(response, [44, 19, 35], 98) == {"reward": 0.1, "reward_info": {
        "format_reward": 0.1, "answer_reward": 0.0, "try_reward": 1.0, "distinct_try_reward": 0.5}}


def test_dataset_with_no_solvable_question_is_refused_by_name(tmp_path, tokenizer):
    (tmp_path / "data").mkdir()
    rows = {"nums": [[1, 1, 1], [2, 1, 1], [1, 1, 1]], "target": [97, 89, 50]}
    pq.write_table(pa.table(rows), tmp_path / "data" / "train-00000-of-00001.parquet")
    with pytest.raises(DataError, match=r"none of the first 2 train questions is solvable \(e.g. nums \[1, 1, 1\], "
                                         r"target 97\); check the data"):
        CountdownDataset(tmp_path, tokenizer, split="train", test_size=1)
    rows["target"][1] = 3  # 2 + 1 * 1: one solvable row is enough
    pq.write_table(pa.table(rows), tmp_path / "data" / "train-00000-of-00001.parquet")
    assert len(CountdownDataset(tmp_path, tokenizer, split="train", test_size=1)) == 2
