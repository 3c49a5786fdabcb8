"""GSM8K task: loaders, prompts, the answer grader (against Fraction arithmetic) and the reward."""

import json
import operator
import re
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import gsm8k_task
from config import ConfigError
from fixtures.gsm8k.answer_corpus import (
    FORMS, PROBES, build_corpus, build_family_corpus, math_verify_grade, read_gold_answers, read_rows,
)
from gsm8k_task import (
    MAX_ANSWER_CHARS,
    GSM8KDataset,
    answers_match,
    clean_solution,
    extract_answer_text,
    extract_gold_answer,
    grade,
    load_gsm8k_rows,
    load_prompt_template,
    make_example,
    parse_answer,
    reward,
)
from tokenizer import Tokenizer

# Typed by hand from the first row of each real split.
FIRST_TRAIN_QUESTION = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?"
)
FIRST_TRAIN_SOLUTION = (
    "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in April and May."
)
FIRST_TEST_SOLUTION = (
    "Janet sells 16 - 3 - 4 = 9 duck eggs a day.\nShe makes 9 * 2 = $18 every day at the farmer\u2019s market."
)
REASONING_PROMPT_HEAD = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with the answer. "
    "The reasoning process is enclosed within <think> </think> and answer is enclosed within <answer> </answer> "
    "tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>.\nUser: "
)
REASONING_PROMPT_TAIL = "\nAssistant: <think>"


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as jsonl_file:
        return [json.loads(line) for line in jsonl_file]


# ----------------------------------------------------------------------------- loading


SAMPLE_ROW_COUNTS = {"train": 44, "test": 43}  # tests/fixtures/gsm8k/README.md
FULL_ROW_COUNTS = {"train": 7473, "test": 1319}  # from the data's README


@pytest.fixture(params=["sample", "full"])
def gsm8k_dir(request) -> tuple[Path, dict[str, int]]:
    """The committed sample, then the full data where it is found (skipped with the reason otherwise)."""
    if request.param == "sample":
        return request.getfixturevalue("gsm8k_sample_dir"), SAMPLE_ROW_COUNTS
    return request.getfixturevalue("gsm8k_full_dir"), FULL_ROW_COUNTS


def test_jsonl_rows_match_the_raw_file(gsm8k_dir):
    data_dir, row_counts = gsm8k_dir
    for split, expected_count in row_counts.items():
        rows = load_gsm8k_rows(data_dir, split)
        assert len(rows) == expected_count
        assert rows == read_jsonl(data_dir / f"{split}.jsonl")
    assert load_gsm8k_rows(data_dir, "train")[0]["question"] == FIRST_TRAIN_QUESTION


def test_sample_rows_are_rows_of_the_full_data(gsm8k_sample_dir, gsm8k_full_dir):
    for split in ("train", "test"):
        full_rows = read_jsonl(gsm8k_full_dir / f"{split}.jsonl")
        sample_rows = read_jsonl(gsm8k_sample_dir / f"{split}.jsonl")
        assert sample_rows[:40] == full_rows[:40]
        assert all(row in full_rows for row in sample_rows[40:])


def test_hub_parquet_layout_reads_the_same_rows(tmp_path, gsm8k_sample_dir):
    rows = read_jsonl(gsm8k_sample_dir / "test.jsonl")[:40]
    (tmp_path / "main").mkdir()
    table = pa.table({"question": [row["question"] for row in rows], "answer": [row["answer"] for row in rows]})
    num_shards = 10  # enough that a loader ignoring shard order would almost surely scramble the rows
    for shard in range(num_shards):
        shard_path = tmp_path / "main" / f"test-{shard:05d}-of-{num_shards:05d}.parquet"
        pq.write_table(table.slice(shard * 4, 4), shard_path)
    pq.write_table(table.slice(0, 1), tmp_path / "main" / "train-00000-of-00001.parquet")
    assert load_gsm8k_rows(tmp_path, "test") == rows
    assert load_gsm8k_rows(tmp_path, "train") == rows[:1]


def test_missing_or_wrong_data_is_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="git clone https://huggingface.co/datasets/openai/gsm8k"):
        load_gsm8k_rows(tmp_path / "nowhere", "train")
    with pytest.raises(FileNotFoundError, match=r"train\.jsonl or main/train-00000-of-00001\.parquet"):
        load_gsm8k_rows(tmp_path, "train")
    (tmp_path / "main").mkdir()
    (tmp_path / "main" / "train-00000-of-00001.parquet").write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(ValueError, match="git lfs pull"):
        load_gsm8k_rows(tmp_path, "train")


GOOD_LINE = json.dumps({"question": "q", "answer": "1 + 1 = 2\n#### 2"})
BAD_JSONL = [
    # (file contents, where the error must point, what it must say)
    ("", None, "test split in .* has no rows"),
    ("\n  \n", None, "test split in .* has no rows"),
    (f"{GOOD_LINE}\n\n{{'question': 1\n", 3, "not valid JSON"),
    (f"{GOOD_LINE}\n[1, 2]\n", 2, "expected a JSON object"),
    (f"{GOOD_LINE}\n\"text\"\n", 2, "expected a JSON object"),
    (f"{GOOD_LINE}\nnull\n", 2, "expected a JSON object"),
    (json.dumps({"question": "q", "answer": "no final answer"}), 1, "#### <answer>"),
    (json.dumps({"question": None, "answer": "#### 2"}), 1, "#### <answer>"),
    (json.dumps({"question": "q", "answer": 2}), 1, "#### <answer>"),
    (f"{GOOD_LINE}\n{GOOD_LINE}\n" + json.dumps({"question": "q", "answer": "#### eighteen"}), 3,
     "gold answer 'eighteen' after '####' is not a number"),
    (json.dumps({"question": "q", "answer": "#### 18 or more"}), 1, "gold answer '18 or more' after '####' is not"),
    (json.dumps({"question": "q", "answer": "#### "}), 1, "gold answer '' after '####' is not a number"),
]


@pytest.mark.parametrize(("contents", "line", "message"), BAD_JSONL, ids=lambda case: repr(case)[:40])
def test_bad_jsonl_is_an_error_naming_file_and_line(tmp_path, contents, line, message):
    path = tmp_path / "test.jsonl"
    path.write_text(contents, encoding="utf-8")
    where = re.escape(f"{path}:{line}: ") if line else ""
    with pytest.raises(ValueError, match=where + ".*" + message):
        load_gsm8k_rows(tmp_path, "test")


def test_data_errors_come_before_any_model_or_tokenizer(tmp_path):
    (tmp_path / "train.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="train split in .* has no rows"):
        GSM8KDataset(tmp_path, tokenizer=None, split="train")  # a run can check its data before loading the model


def test_bad_parquet_row_is_an_error_naming_file_and_row(tmp_path):
    (tmp_path / "main").mkdir()
    answers = ["#### 1", "#### 2", "#### two"]
    pq.write_table(pa.table({"question": ["q"] * 3, "answer": answers}), tmp_path / "main" / "test-00000-of-00001.parquet")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "main" / "test-00000-of-00001.parquet") + " row 2: ")):
        load_gsm8k_rows(tmp_path, "test")


def test_byte_order_mark_and_non_utf8_jsonl(tmp_path):
    (tmp_path / "test.jsonl").write_bytes(b"\xef\xbb\xbf" + GOOD_LINE.encode() + b"\n" + GOOD_LINE.encode() + b"\n")
    assert load_gsm8k_rows(tmp_path, "test") == [json.loads(GOOD_LINE)] * 2
    (tmp_path / "test.jsonl").write_bytes(GOOD_LINE.encode("utf-16"))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "test.jsonl")) + " is not UTF-8 text"):
        load_gsm8k_rows(tmp_path, "test")


def test_gold_answer_and_solution_cleaning():
    solution = "He pays 1,000 + 200 = $<<1000+200=1200>>1,200.\nThat is <<1200/2=600>>600 a half.\n#### 1,200"
    assert extract_gold_answer(solution) == "1200"
    assert clean_solution(solution) == "He pays 1,000 + 200 = $1,200.\nThat is 600 a half."
    assert extract_gold_answer("x is 3 > 2\n#### -7 ") == "-7"
    with pytest.raises(ValueError, match="no '#### <answer>' line"):
        extract_gold_answer("The answer is 5.")


def test_dataset_items(tiny_model_dir, gsm8k_sample_dir):
    tokenizer = Tokenizer(tiny_model_dir)
    dataset = GSM8KDataset(gsm8k_sample_dir, tokenizer, split="test")
    assert len(dataset) == SAMPLE_ROW_COUNTS["test"]
    item = dataset[0]
    question = read_jsonl(gsm8k_sample_dir / "test.jsonl")[0]["question"]
    assert item["question"] == question and item["answer"] == "18"
    assert item["solution"] == FIRST_TEST_SOLUTION
    assert item["prompt"] == REASONING_PROMPT_HEAD + question + REASONING_PROMPT_TAIL
    assert item["prompt_ends_with_think"] is True
    assert tokenizer.decode(item["prompt_token_ids"]) == item["prompt"]
    minimal_item = GSM8KDataset(gsm8k_sample_dir, tokenizer, split="test", prompt_template="minimal")[0]
    assert minimal_item["prompt"] == question and minimal_item["prompt_ends_with_think"] is False


# ----------------------------------------------------------------------------- prompts


def test_prompt_templates(tmp_path):
    assert load_prompt_template("reasoning") == REASONING_PROMPT_HEAD + "{question}" + REASONING_PROMPT_TAIL
    assert load_prompt_template("minimal") == "{question}"
    custom = tmp_path / "custom.txt"
    custom.write_text("Solve {like this}: {question}\n<think>\n\n")
    example = make_example({"question": "What is {2}?", "answer": "2\n#### 2"}, load_prompt_template(custom))
    assert example["prompt"] == "Solve {like this}: What is {2}?\n<think>\n"
    assert example["prompt_ends_with_think"] is True
    with pytest.raises(ConfigError, match=r"task.prompt_template: 'no-such-template' is neither one of \['minimal', 'reasoning'"):
        load_prompt_template("no-such-template")
    custom.write_text("no placeholder")
    with pytest.raises(ValueError, match="no '{question}' placeholder"):
        load_prompt_template(custom)


# ----------------------------------------------------------------------------- grader

EQUIVALENT = [
    ("18", "18"), (" 18 ", "18"), ("18.0", "18"), ("18.", "18"), ("018", "18"), ("$18", "18"), ("\\$18", "18"),
    ("$18.00", "18"), ("1,000", "1000"), ("1000", "1,000"), ("1{,}000", "1000"), ("1,234,567", "1234567"),
    ("1/2", "0.5"), (".5", "1/2"), ("\\frac{1}{2}", "0.5"), ("\\dfrac{3}{6}", "1/2"), ("\\boxed{18}", "18"),
    ("$\\boxed{18}$", "18"), ("\\(18\\)", "18"), ("\\boxed{\\$1,000}", "1000"), ("-3", "-3"), ("\u22123", "-3"),
    ("- 3", "-3"), ("50%", "50"), ("50\\%", "50"), ("50 percent", "50"), ("18 dollars", "18"),
    ("18 \\text{ dollars}.", "18"), ("$18 per hour", "18"), ("2+3*4", "14"), ("(2+3)*4", "20"), ("10-4-3", "3"),
    ("8/4/2", "1"), ("2*3^2", "18"), ("-2^2", "-4"), ("2^3^2", "512"), ("2**10", "1024"), ("2^{-1}", "0.5"),
    ("3 \\times 6", "18"), ("3 \\cdot 6", "18"), ("36 \\div 2", "18"), ("\\left(3+3\\right)*3", "18"),
    ("\\frac{\\frac{1}{2}}{2}", "0.25"), ("--18", "18"),
    # issue 13: what math models write
    ("The answer is \\boxed{18}", "18"), ("The answer is $\\boxed{18}$ dollars.", "18"),
    ("\\boxed{17} is wrong; \\boxed{18}", "18"), ("\\boxed{\\boxed{18}}", "18"), ("\\fbox{18}", "18"),
    ("x = 18", "18"), ("x=18", "18"), ("answer: 18", "18"), ("Answer: $18", "18"), ("9 * 2 = 18 dollars", "18"),
    ("The answer is 18", "18"), ("She makes $18 every day.", "18"), ("Janet\u2019s total is $18.", "18"),
    ("She has 18 more apples than Bob.", "18"), ("18 fewer", "18"), ("**18**", "18"), ("**Answer:** 18", "18"), ("#### 18", "18"),
    ("\\frac12", "0.5"), ("\\frac 1 2", "0.5"), ("\\dfrac12", "0.5"), ("\\tfrac{1}{2}", "0.5"), ("\\frac1{2}", "0.5"),
    ("\\frac{1}2", "0.5"), ("\\frac{10}4", "2.5"),
    ("1 1/2", "1.5"), ("-1 1/2", "-1.5"), ("1 1/2 cups", "1.5"), ("2\\frac{3}{4}", "2.75"), ("5 - 1 1/2", "3.5"),
    ("1 000", "1000"), ("1\u2009000", "1000"), ("1\u202f000", "1000"), ("1\u00a0000", "1000"), ("1\\,000", "1000"),
    ("1\\ 000", "1000"), ("12 345 678", "12345678"), ("1 000.5", "1000.5"),
    ("1e3", "1000"), ("1.5e3", "1500"), ("1.5E+3", "1500"), ("25e-2", "0.25"), ("1.8 \\times 10^{1}", "18"),
    ("\\left(18\\right)", "18"), ("(18)", "18"), ("18 (dollars)", "18"), ("18\\%", "18"),
    ("\\text{18 dollars}", "18"), ("18\\,\\text{kg}", "18"), ("18 \\mbox{ cm}", "18"), ("18 \\quad \\mathrm{km/h}", "18"),
    ("$18 dollars/hour", "18"),
    ("18 square feet", "18"), ("18 times", "18"), ("18 pounds", "18"), ("approximately 18", "18"),
    ("\\sqrt{324}", "18"),  # issue 31: an exact root is a simple expression like any other
]
NOT_EQUIVALENT = [
    ("19", "18"), ("180", "18"), ("1.8", "18"), ("18.0000001", "18"), ("0.333", "1/3"), ("50%", "0.5"),
    ("1,00", "100"), ("1,0000", "10000"), ("18 million", "18"), ("18 thousand", "18000"), ("eighteen", "18"),
    ("18 or 19", "18"), ("18, 19", "18"), ("18 and a half", "18"), ("3 x 6", "18"), ("2(9)", "18"),
    ("18k", "18"), ("", "18"), ("   ", "18"), ("\\boxed{}", "18"), ("(18", "18"), ("18)", "18"),
    ("\u0661\u0668", "18"), ("18", "not a number"), ("18/0", "18"), ("0^-1", "0"),
    # issue 13 and issue 11 item 8: words that change the value, bounds, a second number
    ("18 squared", "18"), ("18 cubed", "18"), ("18 hundredths", "18"), ("18 grand", "18"), ("18 or more", "18"),
    ("18 or so", "18"), ("at least 18", "18"), ("18 at most", "18"), ("more than 18", "18"), ("less than 18", "18"),
    ("over 18", "18"), ("not 18", "18"), ("negative 18", "18"), ("minus 18", "18"), ("18 dozen", "18"),
    ("twice 18", "18"), ("18 x", "18"), ("18 pi", "18"), ("\\boxed{18} or \\boxed{19}", "18"),
    ("18 or \\boxed{19}", "18"),
    ("19 or 18", "18"), ("18 (19)", "18"), ("18 dollars and 5 cents", "18"), ("x = 18, y = 3", "18"),
    ("18!", "18"), ("x \\approx 18", "18"), ("x \\geq 18", "18"), ("x >= 18", "18"), ("18 != 19", "19"),
    ("\\boxed{18", "18"), ("\\frac123", "18"), ("12 34", "1234"), ("1,000 000", "1000000"), ("1 0000", "10000"),
    ("1 3/2", "2.5"), ("18 m/s", "18"), ("18 /", "18"), ("1 1/2^2", "1.25"), ("1e99999", "18"),
]
@pytest.mark.parametrize(("predicted", "gold"), EQUIVALENT)
def test_equivalent_answers_are_accepted(predicted, gold):
    assert answers_match(predicted, gold)


@pytest.mark.parametrize(("predicted", "gold"), NOT_EQUIVALENT)
def test_different_or_unreadable_answers_are_rejected(predicted, gold):
    assert not answers_match(predicted, gold)


HOSTILE = [
    ("9" * 1_000_000, None),
    ("1" * 257, None),  # one past the statement limit
    ("18." + " " * MAX_ANSWER_CHARS, None),  # one past the answer limit, with no \\boxed{}
    ("(" * 33 + "1" + ")" * 33, None),  # one past the nesting limit
    ("(" * 31 + "1" + ")" * 31, Fraction(1)),
    ("(" * 100_000, None),
    ("\\frac" * 50 + "1", None),
    ("9^9^9", None),
    ("10^5000", None),
    ("2^-5000", None),
    ("(10^100)^(10^100)", None),
    ("1^100000", None),  # refused by the size bound even though the value is small
    ("2^1000", Fraction(2) ** 1000),
    ("-" * 250 + "1", Fraction(1)),
    ("1/(1-1)", None),
    ("4^(1/2)", Fraction(2)),  # issue 31: rational roots are exact
    ("4^0.5", Fraction(2)),
    ("2^(1/2)", None),  # irrational
    ("(-4)^(1/2)", None),  # not real
    ("(-8)^(1/3)", Fraction(-2)),
    ("2^(1/65)", None),  # past MAX_ROOT_DEGREE, refused before any root is taken
    ("\\sqrt[0]{4}", None),
    ("10^10^10", None),
    ("(10^1000)^(1/2)", Fraction(10) ** 500),
    ("0^-1", None),  # sympy would give zoo
    ("0^{-2}", None),
    ("\\frac{1}{0}", None),
    ("\x00", None),
    ("1" + "*1" * 127, Fraction(1)),
    ("1" * 200 + "*" + "1" * 55, Fraction(int("1" * 200) * int("1" * 55))),
]


@pytest.mark.parametrize(("text", "value"), HOSTILE, ids=lambda case: repr(case)[:30])
def test_hostile_answers(text, value):
    assert parse_answer(text) == value


SLOW_UNITS = [  # each repeated up to the length limit, built to make a regex, the clause reader or the parser work hard
    "*", "**1", "\\boxed{", "{", "\\frac", "\\frac1", "\\frac{", "1 ", "1 000 ", "1,000", "9e999", "a ", "=", "x=",
    "1/", "1 1/2 ", "$", "\\text{", "more ", ".", "-", "1. ", "1 = ", "= 1 ", "1 = y ", "so 1 ", "is ", "1 is 2 ",
    "is the ", "makes ", "(a 1) ", "(", "(=", "forty (40) ", "1 (forty) ", "forty-", "and ", "1 because ", "1 which ",
    "1 which makes 2 ", "Since 1 ", "\\sqrt", "\\sqrt[", "9^(1/2)*", "64^(1/6)*", "1 cm^3 ", "#", "answer 1 ",
    "**a** ", "< ", "\\", "Mr. ", "\\a {}", "\\a  ",
]
SLOW_SHAPES = [(unit * MAX_ANSWER_CHARS)[:MAX_ANSWER_CHARS] for unit in SLOW_UNITS] + [
    "\\boxed{" * 31 + "1" + "}" * 31, "1e" + "9" * (MAX_ANSWER_CHARS - 2), "-" * (MAX_ANSWER_CHARS - 1) + "1",
    "(" * (MAX_ANSWER_CHARS // 2) + ")" * (MAX_ANSWER_CHARS // 2), ("1+" * MAX_ANSWER_CHARS)[: MAX_ANSWER_CHARS - 1],
    "(" * 31 + "a" + ")" * 31 + "1" * (MAX_ANSWER_CHARS - 63),
]


BENIGN = (
    "Each crate holds 8 melons and Mia fills 5 crates, so she picks 5 * 8 = 40 melons. She eats 2 of them, "
    "which leaves 38. "
) * 40


@pytest.mark.parametrize("text", SLOW_SHAPES, ids=lambda text: repr(text)[:24])
def test_every_call_is_fast_on_hostile_shapes(text):
    """Time linear in the length: a hostile shape costs under 50 ms, or at most 25 times a benign worked
    answer of the same length timed alongside it (best of 5 each). Both are CPU time of this thread: on the
    shared machine a nice'd process is descheduled for ~100 ms at a time, which wall-clock time would count."""
    assert len(text) <= MAX_ANSWER_CHARS
    hostile, benign = (f"x</think> <answer>{answer}</answer>" for answer in (text, BENIGN[: len(text)]))
    timings = [(_seconds(grade, hostile, "18"), _seconds(grade, benign, "18")) for _ in range(5)]
    hostile_seconds, benign_seconds = (min(column) for column in zip(*timings))
    assert hostile_seconds < max(0.05, 25 * benign_seconds)


def _seconds(function, *args) -> float:
    start = time.thread_time()
    function(*args)
    return time.thread_time() - start


# Issue 31: the families of everyday writing the grader once marked wrong, several phrasings each. The
# value each answer states is fixed here by hand; each answer is also checked against the gold plus one.
WORKED = (  # longer than a statement may be, as real worked answers are
    "Each crate holds 8 melons and Mia fills 5 crates, so she picks 5 * 8 = 40 melons. She eats 2 of them on "
    "the way home and gives 3 to her neighbour, which leaves 40 - 2 - 3 = 35. Her aunt brings 5 more, so now "
    "she has 35 + 5 = 40 melons. "
)
FAMILIES = {
    "long worked answer": [
        (WORKED + "The answer is \\boxed{40}.", "40"), (WORKED + "\\boxed{40}", "40"),
        (WORKED + "So the answer is 40.", "40"), (WORKED + "\n#### 40", "40"), (WORKED, "40"),
        (WORKED * 10 + "The answer is $\\boxed{40}$.", "40"), ("x" * 100_000 + " \\boxed{40}", "40"),
    ],
    "currency and unit symbols": [
        ("\u20ac40", "40"), ("40 \u20ac", "40"), ("\u00a340.00", "40"), ("\u00a540", "40"), ("\u20b940", "40"),
        ("40\u00a2", "40"), ("\\pounds 40", "40"), ("\\euro 40", "40"), ("40\u00b0", "40"), ("40 \u00b0C", "40"),
        ("40^\\circ F", "40"), ("40^{\\circ}", "40"), ("-5\u00b0F", "-5"), ("40 cm^3", "40"), ("40 cm\u00b3", "40"),
        ("40 m^2", "40"), ("40 ft**2", "40"), ("40 \\text{ cm}^3", "40"), ("40\\,\\mathrm{m}^{2}", "40"),
        ("The tank holds 40 m^3 of water.", "40"), ("\\boxed{40 \\text{ km}^2}", "40"),
        ("\\texteuro{}40", "40"), ("\\textsterling{} 1,200", "1200"), ("40\\,\\textdegree{}C", "40"),
        ("The ticket costs \u00a31,200.", "1200"), ("She pays \u20ac40 a month.", "40"), ("40 km\u00b2", "40"),
    ],
    "number with its justification": [
        ("5 crates of 8 melons, so 40 melons", "40"), ("5 crates of 8 melons, therefore 40", "40"),
        ("She picks 5 crates of 8 melons; thus 40.", "40"), ("40 (8 in each crate)", "40"),
        ("40 melons (5 crates of 8)", "40"), ("40 (5 \\times 8 = 40)", "40"), ("25% of 160 is 40", "40"),
        ("5 times 8 is 40", "40"), ("40 melons, because 5 crates hold 8 each", "40"),
        ("40, since each of the 5 crates holds 8", "40"), ("40 because 42 - 2 = 40", "40"),
        ("Since each of the 5 crates holds 8 melons, she has 40 melons.", "40"),
        ("With 8 melons in each of 5 crates, she has 40.", "40"), ("8 in each of 5 crates, which makes 40", "40"),
        ("40 melons, which is 8 per crate", "40"), ("She fills 5 crates with 8 melons each for a total of 40.", "40"),
        ("5 * 8 = 40 melons", "40"), ("Each crate holds 8 melons. Therefore she has 40.", "40"),
        ("40 is 25% of 160", "40"), ("40 = 5 crates * 8 melons", "40"), ("42 is 2 more than 40", "42"),
        ("5 \u00d7 8 \u2192 40", "40"), ("5 * 8 => 40", "40"), ("$5 \\times 8 \\Rightarrow 40$", "40"),
        ("The answer is 40, because 5 * 8 = 40.", "40"), ("x = 40 because y = 3", "40"),
        ("40 melons (which is 8 per crate)", "40"), ("40 (5 crates of 8, so 40)", "40"), ("40 (= 5 \\times 8)", "40"),
        ("40 (that is, 5 crates of 8)", "40"), ("40 (not counting the 2 she ate)", "40"),
        ("She fills 5 crates (= 40 melons), so the answer is 40.", "40"),
    ],
    "number and its name": [
        ("40 (forty)", "40"), ("forty (40)", "40"), ("40 (Forty)", "40"), ("$40 (forty dollars)", "40"),
        ("40 melons (forty melons)", "40"), ("42 (forty-two)", "42"), ("105 (one hundred and five)", "105"),
        ("1,200 (one thousand two hundred)", "1200"), ("The answer is 40 (forty).", "40"),
        ("40 \\text{ (forty)}", "40"), ("forty-two (42) melons", "42"),
    ],
    "equation with a variable": [
        ("40 = y", "40"), ("y = 40", "40"), ("40 = x", "40"), ("n = 40 melons", "40"), ("m = 5 \\times 8 = 40", "40"),
        ("\\boxed{y = 40}", "40"), ("\\boxed{40 = y}", "40"), ("total = 40", "40"),
        ("Let m be the number of melons: m = 40.", "40"), ("40 = the number of melons", "40"),
    ],
    "exact expression": [
        ("9^(1/2)", "3"), ("\\sqrt{9}", "3"), ("sqrt(9)", "3"), ("\u221a9", "3"), ("2^3", "8"), ("2**3", "8"),
        ("2\u00b3", "8"), ("\\sqrt[3]{27}", "3"), ("8^{2/3}", "4"), ("16^{0.5}", "4"), ("(1/4)^{-1/2}", "2"),
        ("10^2 - 60", "40"), ("\\boxed{2^{3}}", "8"), ("\\frac{\\sqrt{16}}{2}", "2"), ("(-8)^{1/3}", "-2"),
    ],
}
FAMILY_CASES = [(family, answer, gold) for family, cases in FAMILIES.items() for answer, gold in cases]


@pytest.mark.parametrize(("family", "answer", "gold"), FAMILY_CASES, ids=lambda case: repr(case)[:40])
def test_families_of_everyday_writing_are_graded_right(family, answer, gold):
    assert parse_answer(answer) == Fraction(gold)
    assert answers_match(answer, gold)
    assert not answers_match(answer, str(int(gold) + 1))


# The gold number appears, but the answer states another value (or none): these must stay wrong.
NEIGHBOURS = [  # (answer, gold, the value it states by the documented rule; None: unreadable)
    ("not 42, the answer is 40", "42", 40), ("42 is wrong; the answer is 40", "42", 40),
    ("I first got 42, but the answer is 40.", "42", 40), ("The answer is 40, not 42", "42", None),
    ("42 - 2 = 40", "42", 40), ("40 = 42 - 2", "42", 40),  # an equation states its last side
    ("y = 42, x = 40", "42", 40), ("40 = y = 41", "40", 41), ("x = 40 because y = 42", "42", 40),
    ("42 melons minus 2 eaten leaves 40", "42", 40), ("40, which is 42 - 2", "42", 40),
    ("40 (8 in each crate)", "8", 40), ("40 (not 42)", "42", 40), ("40 (or 42)", "42", None), ("40 (or 42)", "40", None),
    ("40 (at least)", "40", None), ("5 crates of 8 melons, so 40 melons", "8", 40), ("25% of 160 is 40", "160", 40),
    ("40 melons, because 5 crates hold 8 each", "5", 40), ("40 melons, which is 8 per crate", "8", 40),
    ("8 in each crate, which makes 40", "8", 40), ("She has 40 melons in 5 crates", "5", None),
    ("40 melons, 8 per crate", "8", None), ("The answer is 40 melons in 5 crates.", "5", None),
    ("42 - 2 = 40 or 38", "40", None), ("40 is 25% of 160, not 42", "40", None),
    ("42 - 2 is 39 melons in 5 crates", "40", None), ("40 => 42", "40", 42),
    ("40 or 42", "42", None), ("42 or 40", "40", None), ("42 is wrong", "42", None),
    ("The answer is 40. 42 was my first guess.", "42", None), ("The answer is 40. So each crate has 8.", "8", None),
    ("\\boxed{40} is what I first thought; \\boxed{41}", "40", 41), (WORKED + "The answer is \\boxed{41}.", "40", 41),
    (WORKED + "#### 41", "40", 41), ("40 (forty-two)", "42", None), ("40 (forty-two)", "40", None),
    ("fifty (40)", "50", None), ("forty", "40", None), ("40 (or so 42 because 5 * 8 = 40)", "42", None),
    ("The answer is 40 (fifty, or 42).", "42", None), ("42 (wrong)", "42", None), ("42 (not the answer)", "42", None),
    ("42 (this is wrong, the answer is 40)", "42", None), ("The answer is 42 (just kidding, it is 40).", "42", None),
    ("42 (per crate, so 84 in all)", "42", None), ("42 (42 - 2 = 40 left)", "42", None), ("40 == y", "40", None), ("x >= 40", "40", None),
    ("9^(1/2)", "9", 3), ("2^(1/2)", "2", None), ("\\sqrt{-4}", "2", None), ("40^2", "40", 1600), ("40\u00b2", "40", 1600),
    ("40 x^2", "40", None), ("\u20ac42", "40", 42),
]


@pytest.mark.parametrize(("answer", "gold", "stated"), NEIGHBOURS, ids=lambda case: repr(case)[:40])
def test_the_gold_number_in_the_text_is_not_the_answer_unless_stated(answer, gold, stated):
    assert parse_answer(answer) == (None if stated is None else Fraction(stated))
    assert not answers_match(answer, gold)


# Where the rule reads a number a hasty reader might not: pinned so that a change to the rule is seen.
DOCUMENTED_READINGS = [
    ("5 * 8 = 40. There are 5 crates.", 5),  # without "answer"/"####", the last sentence states the answer
    ("She has 40 melons. So 5 crates.", 5),
    ("She has 40 melons, so each crate holds 8", 8),  # the last conclusion in a sentence is its statement
    ("The answer is 40. That is 5 * 8.", 40),  # a later sentence restating the labelled value is fine
    ("18 or 19, so 18", 18),  # working before the last cue is not read, hedges included
    ("I first wrote 40 (or 42). So the answer is 42.", 42),  # a hedging remark spoils only its own clause
]


@pytest.mark.parametrize(("answer", "stated"), DOCUMENTED_READINGS)
def test_documented_readings(answer, stated):
    assert parse_answer(answer) == stated


def test_family_corpus_is_graded_by_the_value_each_answer_states():
    """Every gold answer of the sample in every family form, right and wrong (the bench's pairs, with their
    truth fixed by construction). Only a bare worked solution may be unreadable, where its last sentence
    holds a second number ("... = 5 hours to read 120 pages.")."""
    pairs = build_family_corpus(read_rows())
    assert len({pair.family for pair in pairs}) == 6 and len(pairs) > 6000
    wrong = [pair for pair in pairs if pair.correct is not None and answers_match(pair.answer, pair.gold) != pair.correct]
    assert {pair.form for pair in wrong} <= {"the working alone"}
    assert all(pair.correct for pair in wrong)  # a false 0, never a false 1
    assert len(wrong) <= 0.15 * sum(pair.form == "the working alone" for pair in pairs)


# math-verify (the grader of the second design document's lineage) is the oracle: on the corpus of
# real gold answers written as models write them, the grader agrees with it except where it must not.
DELIBERATE_DIFFERENCES = {  # corpus form -> (our grade, why we differ from math-verify)
    "value word: or more": (False, "'or more' makes the answer a bound; math-verify drops the words"),
    "value word: squared": (False, "'18 squared' is 324; math-verify drops the word"),
    "value word: hundredths": (False, "'18 hundredths' is 0.18; math-verify drops the word"),
    "value word: grand": (False, "'18 grand' is 18,000; math-verify drops the word"),
    "value word: million": (False, "'18 million' is 18,000,000; math-verify drops the word"),
    "bound: more than": (False, "'more than 18' is a bound, not a value; math-verify drops the words"),
    "two numbers, gold last": (False, "'19 or 18' hedges between two answers; math-verify takes the last number"),
    "two boxes, last wins": (True, "the last \\boxed{} is the final answer; math-verify reads a set of both boxes"),
    "escaped dollar sign": (True, "'\\$18' is 18 dollars; math-verify finds no number outside math delimiters"),
    "thin-space thousands": (True, "'448 000' with a thin space is 448000; math-verify reads 0"),
    "LaTeX thin-space thousands": (True, "'448\\,000' is 448000; math-verify reads 1*0-style products"),
    "scientific notation": (True, "'448e3' is 448000; math-verify reads 448 and drops 'e3'"),
    "Unicode minus": (True, "'\u22127' is -7; math-verify does not read U+2212"),
    "undelimited \\times": (True, "'36 \\times 2' is 72; math-verify reads only the 2 outside math delimiters"),
}


def test_grader_agrees_with_math_verify_on_real_gold_answers():
    pairs = build_corpus(read_gold_answers())
    assert len(pairs) >= 500 and {pair.form for pair in pairs} == set(FORMS) | set(PROBES)
    disagreements = {}
    for pair in pairs:
        ours = answers_match(pair.answer, pair.gold)
        assert ours == (pair.stated_value == Fraction(pair.gold)), pair  # the value fixed by hand
        if ours != math_verify_grade(pair.answer, pair.gold):
            disagreements.setdefault(pair.form, []).append((pair.answer, ours))
    assert {form: [ours for _, ours in found] for form, found in disagreements.items()} == {
        form: [ours] for form, (ours, _) in DELIBERATE_DIFFERENCES.items()
    }
    assert 1 - len(DELIBERATE_DIFFERENCES) / len(pairs) >= 0.99


# Expression trees with Fraction values as the independent reference; None marks division by zero.
leaves = st.one_of(
    st.integers(0, 10**6).map(lambda number: (Fraction(number), str(number))),
    st.decimals(0, 1000, places=3).map(lambda number: (Fraction(str(number)), str(number))),
)


ARITHMETIC = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def combine(symbol: str, left, right, latex_fraction: bool):
    (left_value, left_text), (right_value, right_text) = left, right
    if left_value is None or right_value is None or (symbol == "/" and right_value == 0):
        value = None
    else:
        value = ARITHMETIC[symbol](left_value, right_value)
    if symbol == "/" and latex_fraction:
        return value, f"\\frac{{{left_text}}}{{{right_text}}}"
    return value, f"({left_text} {symbol} {right_text})"


expressions = st.recursive(
    leaves,
    lambda children: st.builds(combine, st.sampled_from("+-*/"), children, children, st.booleans()),
    max_leaves=8,
)


@given(expressions)
@settings(max_examples=300, deadline=None)
def test_parser_matches_fraction_arithmetic(expression):
    value, text = expression
    assert parse_answer(text) == value
    assert parse_answer(f"\\boxed{{{text}}}") == value


# Words and symbols the clause reader reacts to, for random sentences built from them.
SOUP = ["so", "is", "makes", "a total of", "answer", "####", "=", "because", "which", "with", "Since", "not", "or",
        "forty", "(forty)", "(", ")", "(8 in each)", "40", "8", "1/2", "-", "^", "\\sqrt", "[3]", "{", "}", ",", ".",
        "\n", "x", "y", "cm^3", "\u20ac", "\\boxed{", "<", "!", "melons"]


@given(st.one_of(
    st.text(alphabet="0123456789.,+-*/^(){}[]%$\\ fracboxedtxlmE=:;?#\u2009\n\u20ac\u00b0\u00b2\u221a<!", max_size=60),
    st.lists(st.sampled_from(SOUP), max_size=25).map(" ".join),
))
@settings(max_examples=800, deadline=None)
@example("0 0/,")  # a separator alone once passed for the second integer of a fraction
def test_grader_never_raises(text):
    assert answers_match(text, "18") in (True, False)
    result = grade(f"x</think> <answer>{text}</answer>", "18")
    assert result["reward"] in (0.1, 1.1)


def test_every_real_gold_answer_grades_against_its_variants(gsm8k_dir):
    for split in ("train", "test"):
        for row in load_gsm8k_rows(gsm8k_dir[0], split):
            gold = extract_gold_answer(row["answer"])
            number = int(gold)  # every GSM8K final answer is an integer
            raw_final_line = row["answer"].rpartition("####")[2]  # as the data writes it, commas included
            for variant in (gold, raw_final_line, f"{number:,}", f"{number}.0", f"${number}", f"\\boxed{{{number}}}"):
                assert answers_match(variant, gold), (variant, gold)
            for wrong in (number + 1, number * 10 if number else 1):
                assert not answers_match(str(wrong), gold), (wrong, gold)


# ----------------------------------------------------------------------------- reward

REWARDS = [
    # (response after the "<think>" prefill, format reward, answer reward)
    ("16 - 3 - 4 = 9; 9 * 2 = 18 </think> <answer> 18 </answer>", 0.1, 1.0),
    ("reasoning </think>\n<answer>$18</answer>\n", 0.1, 1.0),
    ("reasoning </think> <answer> 17 </answer>", 0.1, 0.0),
    ("reasoning </think> so <answer> 18 </answer>", 0.0, 1.0),  # text between </think> and <answer>
    ("reasoning </think> <answer> 18 </answer> done", 0.0, 1.0),  # text after </answer>
    ("reasoning <answer> 18 </answer>", 0.0, 1.0),  # no </think>
    ("<think> reasoning </think> <answer> 18 </answer>", 0.0, 1.0),  # a second <think>
    ("reasoning </think> <answer> 18 </answer> <answer> 18 </answer>", 0.0, 0.0),
    ("reasoning </think> </answer> 18 <answer>", 0.0, 0.0),
    ("reasoning, the answer is 18", 0.0, 0.0),
    ("", 0.0, 0.0),
]


@pytest.mark.parametrize(("response", "format_score", "answer_score"), REWARDS)
def test_reward_after_think_prefill(response, format_score, answer_score):
    expected = {"reward": format_score + answer_score, "reward_info": {"format_reward": format_score, "answer_reward": answer_score}}
    assert grade(response, "18") == expected
    assert grade(response + "<|endoftext|>", "18", end_token="<|endoftext|>") == expected
    # Without the prefill, the same response must open its own <think>, optionally after free text.
    for opening in ("<think>", "Let me think. <think>\n"):
        assert grade(opening + response, "18", prompt_ends_with_think=False) == expected
    if "<think>" not in response:
        assert grade(response, "18", prompt_ends_with_think=False)["reward_info"]["format_reward"] == 0.0


@pytest.mark.parametrize(
    ("response", "answer_text"),
    [("<answer> 18 </answer>", " 18 "), ("a<answer></answer>b", ""), ("</answer> 18 <answer>", None),
     ("<answer> 18", None), ("<answer><answer> 18 </answer>", None), ("no tags", None)],
)
def test_extract_answer_text(response, answer_text):
    assert extract_answer_text(response) == answer_text


def test_reward_without_prefill_rejects_tags_before_think():
    response = "</think> <think> a </think> <answer> 18 </answer>"
    assert grade(response, "18", prompt_ends_with_think=False)["reward_info"]["format_reward"] == 0.0


def test_reward_on_huge_response_is_zero():
    response = "a </think> <answer>" + "1" * 1_000_000 + "</answer>"
    assert grade(response, "18") == {"reward": 0.1, "reward_info": {"format_reward": 0.1, "answer_reward": 0.0}}


# ----------------------------------------------------------------------------- SFT data


@pytest.mark.parametrize("template_name", ["reasoning", "minimal"])
def test_sft_data_gets_full_reward_on_every_train_row(tmp_path, gsm8k_dir, template_name):
    (data_dir, row_counts) = gsm8k_dir
    out_path = tmp_path / "sft" / "train.jsonl"
    gsm8k_task.main(["sft-data", "--data", str(data_dir), "--out", str(out_path), "--prompt-template", template_name])
    lines = read_jsonl(out_path)
    rows = read_jsonl(data_dir / "train.jsonl")
    assert len(lines) == len(rows) == row_counts["train"]
    template = {"reasoning": REASONING_PROMPT_HEAD + "{question}" + REASONING_PROMPT_TAIL, "minimal": "{question}"}
    for line, row in zip(lines, rows):
        head, _, tail = template[template_name].partition("{question}")
        assert line["prompt"] == head + row["question"] + tail
        item = {"answer": row["answer"].rpartition("####")[2].strip(), "prompt_ends_with_think": template_name == "reasoning"}
        assert reward(line["response"], item) == {
            "reward": 1.1,
            "reward_info": {"format_reward": 0.1, "answer_reward": 1.0},
        }, line["response"]
    first = lines[0]["response"]
    expected_first = FIRST_TRAIN_SOLUTION + " </think> <answer> 72 </answer>"
    assert first == (expected_first if template_name == "reasoning" else "<think> " + expected_first)


# ----------------------------------------------------------------------------- bench


@pytest.mark.slow
def test_grader_bench_reports_throughput_and_the_agreement_table(tmp_path):
    """Without the full test split (--data has none) the bench says so and judges the committed sample."""
    json_path, no_data = tmp_path / "report.json", tmp_path / "nowhere"
    completed = subprocess.run(
        [sys.executable, "-m", "bench.gsm8k_grader", "--data", str(no_data), "--answers-per-form", "5",
         "--seconds-per-case", "0.001", "--json-out", str(json_path)],
        capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1],
    )
    report = json.loads(json_path.read_text())
    assert f"skipped: the pairs from the full GSM8K test split. GSM8K directory {no_data} does not exist" in completed.stdout
    assert report["sources"] == {"committed sample": 87, f"{no_data} test split": 0}
    assert report["gold_answers"]["plain 1234"]["mean_reward"] == pytest.approx(1.1)
    assert report["gold_answers"]["wrong 1235"]["mean_reward"] == pytest.approx(0.1)
    assert report["hostile"]["correct answer"]["mean_reward"] == pytest.approx(1.1)
    assert report["hostile"]["power tower 9^9^9^9"]["mean_reward"] == pytest.approx(0.1)
    assert report["hostile"]["100k text, then \\boxed{18}"]["mean_reward"] == pytest.approx(1.1)
    table = report["agreement"]
    short_forms = {form for form, row in table.items() if row["family"] == "short final answer"}
    assert short_forms == set(FORMS) | set(PROBES)
    assert {form for form in short_forms if sum(table[form]["disagree"].values())} == set(DELIBERATE_DIFFERENCES)
    assert table["plain"]["pairs"] == 5 and table["boxed after the working"]["pairs"] == 10  # right and wrong
    totals = report["totals"]
    assert totals["judged"] == sum(row["judged"] for row in table.values()) > 400
    assert totals["ours_wrong"] < 0.02 * totals["judged"] and totals["disagree"]["ambiguous"] > 0
    assert "| two boxes, last wins | 1 | 1 | 0 | 1 | 0 | 1 | 0 |" in completed.stdout
    assert "ours wrong: " in completed.stdout and "| **all** |" in completed.stdout


def test_grader_bench_without_math_verify_says_how_to_get_it(tmp_path):
    blocked = ("import sys, runpy; sys.modules['math_verify'] = None; sys.argv = ['gsm8k_grader', '--data', "
               f"{str(tmp_path)!r}, '--seconds-per-case', '0']; runpy.run_module('bench.gsm8k_grader', run_name='__main__')")
    completed = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True,
                               cwd=Path(__file__).resolve().parents[1])
    assert completed.returncode == 0, completed.stderr
    assert "skipped: agreement with math-verify, which is not installed; it is in the dev dependency group" in completed.stdout
    assert "hostile response" in completed.stdout and "| **all** |" not in completed.stdout
