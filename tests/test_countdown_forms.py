"""The shortcut baseline: forms' exact coverage against the task's own parser, completeness against brute force,
the greedy choice of the 10 best forms, the policy's form of an answer, and the per-count report by hand."""

import random
import re
from collections import Counter

import numpy as np
import pytest

from countdown_forms import FormBaseline, all_forms, answer_form, best_forms, coverage
from countdown_task import CountdownDataset, parse_expression
from test_countdown_task import generate, reachable_values, tokenizer  # noqa: F401 (tokenizer: a fixture)


def answer(expression: str) -> str:
    return f" some thoughts </think>\n<answer> {expression} </answer>"


def filled(form: str, numbers: list[int]) -> str:
    return re.sub("[a-d]", lambda place: str(numbers["abcd".index(place.group())]), form)


@pytest.mark.parametrize("count", [2, 3, 4])
def test_coverage_agrees_with_the_tasks_exact_parser(count):
    """Each form written out with a row's numbers and parsed by the reward's own parser (Fractions) solves the
    row exactly when the vectorized integer evaluation says so, divisions by zero included (a / (b - c), b = c)."""
    rng = random.Random(count)
    rows = [([rng.randint(1, 6) for _ in range(count)], rng.randint(1, 30)) for _ in range(40)]
    solved = coverage(rows)
    for form, solved_rows in list(solved.items())[:: 7 if count == 4 else 1]:
        for (numbers, target), is_solved in zip(rows, solved_rows):
            assert is_solved == solved_by_parser(form, numbers, target), (form, numbers, target)


@pytest.mark.parametrize("numbers", [[3, 5, 7], [2, 2, 9], [4, 6, 9, 2], [3, 3, 8, 8]])
def test_forms_reach_every_value_brute_force_reaches(numbers):
    values = set()
    for form in all_forms(len(numbers)):
        parsed = parse_expression(filled(form, numbers))
        if parsed is not None:
            values.add(parsed[0])
    assert values == reachable_values(numbers)


def test_form_counts_and_texts():
    assert set(all_forms(2)) == {"a + b", "a * b", "a - b", "b - a", "a / b", "b / a"}
    three = all_forms(3)
    assert {"a + b - c", "c * (a + b)", "a - b * c", "c / (a - b)"} <= set(three)
    assert all(sorted(re.findall("[a-c]", form)) == ["a", "b", "c"] for form in three)


def test_best_forms_are_chosen_greedily_by_what_they_add():
    # a + b - c solves rows 0-2 and no form more; rows 3 (a * b - c) and 4 (a - b - c) share no form, so greedy
    # adds one form for each.
    rows = [([5, 4, 2], 7), ([9, 1, 3], 7), ([2, 2, 0], 4), ([6, 7, 2], 40), ([20, 3, 4], 13)]
    chosen = best_forms(rows, num_forms=3)
    solved = coverage(rows)
    assert solved[chosen[0]].sum() == max(int(row.sum()) for row in solved.values()) == 3
    assert np.logical_or.reduce([solved[form] for form in chosen]).all()
    assert best_forms(rows, num_forms=1) == chosen[:1]


def test_answer_form_writes_the_numbers_by_their_place_in_the_prompt():
    assert answer_form(answer("34 + 66 - 10"), [34, 66, 10]) == "a + b - c"
    assert answer_form(answer("34 + (66 - 10)"), [34, 66, 10]) == "a + b - c"  # the same text as its form's
    assert answer_form(answer("(10 - 66) * 34"), [34, 66, 10]) == "(c - b) * a"
    assert answer_form(answer("20 + 6 - 6"), [20, 6, 6]) == "a + b - c"  # a repeated number: places in order
    assert answer_form(answer("6 + 20 - 6"), [20, 6, 6]) == "b + a - c"
    assert answer_form(answer("34 + 7"), [34, 66, 10]) is None  # not the prompt's numbers
    assert answer_form(answer("34 + 66"), [34, 66, 10]) is None  # a number left out
    assert answer_form(answer("-34 + 66 + 10"), [34, 66, 10]) is None  # unary minus: no form
    assert answer_form(answer("a plus b"), [34, 66, 10]) is None
    assert answer_form(" 34 + 66 - 10 </think>", [34, 66, 10]) is None


def solved_by_parser(form: str, numbers: list[int], target: int) -> bool:
    parsed = parse_expression(filled(form, numbers))
    return parsed is not None and parsed[0] == target


def sample(index: int, numbers: list[int], target: int, expression: str, right: bool) -> dict:
    return {"question_index": index, "nums": numbers, "target": target, "response": answer(expression),
            "reward_info": {"format_reward": 0.1, "answer_reward": float(right)}}


def test_report_per_number_count_by_hand():
    # Training rows: a + b - c solves all three 3-number rows; a * b the 2-number rows.
    baseline = FormBaseline.fit([[1, 2, 3], [5, 5, 2], [4, 3, 2], [2, 3], [4, 5]], [0, 8, 5, 6, 20])
    assert baseline.forms[3][0] == "a + b - c" and baseline.forms[2][0] == "a * b"
    samples = [
        sample(0, [10, 2, 3], 9, "10 + 2 - 3", True),   # a + b - c solves it
        sample(1, [10, 2, 3], 4, "10 - 2 * 3", True),   # a + b - c does not; another top form may
        sample(2, [7, 7, 7], 1, "7 / 7", False),        # wrong numbers: no form
        sample(3, [1, 2, 3], 50, "1 + 2 - 3", False),   # no form of 1, 2, 3 reaches 50: outside every top form
        sample(4, [2, 3], 6, "2 * 3", True),
    ]
    report = baseline.report(samples)
    assert report["3_numbers/success"] == 0.5 and report["3_numbers/questions"] == 4
    assert report["3_numbers/policy_form"] == "a + b - c" and report["3_numbers/policy_form_share"] == 0.5
    assert report["3_numbers/best_form"] == "a + b - c" and report["3_numbers/best_form_coverage"] == 0.25
    questions = [(s["nums"], s["target"]) for s in samples[:4]]
    outside = [not any(solved_by_parser(form, *question) for form in baseline.forms[3]) for question in questions]
    assert report["3_numbers/top10_forms_coverage"] == 1 - sum(outside) / 4
    assert report["3_numbers/questions_outside_top10"] == sum(outside) >= 1  # question 3 at least
    right_outside = [s["reward_info"]["answer_reward"] for s, out in zip(samples, outside) if out]
    assert report["3_numbers/success_outside_top10"] == pytest.approx(sum(right_outside) / len(right_outside))
    assert report["2_numbers/success"] == 1.0 and report["2_numbers/best_form_coverage"] == 1.0
    assert report["2_numbers/policy_form"] == "a * b" and report["2_numbers/policy_form_share"] == 1.0


def test_report_without_training_rows_of_a_count_gives_no_forms():
    baseline = FormBaseline.fit([[1, 2, 3]], [6])
    report = baseline.report([sample(0, [3, 4], 7, "3 + 4", True)])
    assert report == {"2_numbers/success": 1.0, "2_numbers/questions": 1, "2_numbers/policy_form": "a + b",
                      "2_numbers/policy_form_share": 1.0, "2_numbers/mul_div_answer_share": 0.0}


def test_report_counts_answers_with_mul_or_div_and_outside_questions_any_answer_solves():
    # a + b - c solves every training row, and no 3-number rows are left for other forms to add anything.
    baseline = FormBaseline.fit([[1, 2, 3], [5, 5, 2], [4, 3, 2]], [0, 8, 5])
    outside_question, inside_question = ([6, 2, 3], 9), ([10, 2, 3], 9)  # 6 * 3 / 2; 10 + 2 - 3
    assert not any(solved_by_parser(form, *outside_question) for form in baseline.forms[3])
    assert solved_by_parser("a + b - c", *inside_question)
    samples = [  # two answers per question
        sample(0, *outside_question, "6 * 3 / 2", True),
        sample(0, *outside_question, "6 + 3", False),
        sample(1, *inside_question, "10 + 2 - 3", True),
        sample(1, *inside_question, "10 * 3 / 2", False),
    ]
    report = baseline.report(samples)
    assert report["3_numbers/mul_div_answer_share"] == 0.5  # answers 0 and 3
    assert report["3_numbers/questions_outside_top10"] == 1
    assert report["3_numbers/success_outside_top10"] == 0.5  # one of its two answers
    assert report["3_numbers/pass_outside_top10"] == 1.0  # its one question has a right answer
    samples[0]["reward_info"]["answer_reward"] = 0.0
    assert baseline.report(samples)["3_numbers/pass_outside_top10"] == 0.0
    assert "3_numbers/pass_outside_top10" not in baseline.report(samples[::2])  # one answer per question


def test_training_questions_outside_the_top_forms_are_drawn_repeat_times(tmp_path, tokenizer):  # noqa: F811
    """rollout.outside_forms_repeat=3: each 3-number training question that none of its count's 10 forms solves,
    each form written out and parsed by the reward's parser, is drawn 3 times per pass; every other question (2 and
    4 numbers, and 3 numbers a form solves) once."""
    generate(tmp_path, "--size", "600", "--seed", "5", "--min-numbers", "2", "--max-numbers", "4")
    plain = CountdownDataset(tmp_path, tokenizer, test_size=60)
    forms = FormBaseline.fit(plain.columns["nums"], plain.columns["target"]).forms[3]
    expected = Counter()
    for numbers, target in zip(plain.columns["nums"], plain.columns["target"]):
        outside = len(numbers) == 3 and not any(solved_by_parser(form, numbers, target) for form in forms)
        expected[tuple(numbers), target] += 3 if outside else 1
    assert 0 < sum(expected.values()) - len(plain) < len(plain)  # some questions, not all, are repeated
    train = plain.with_outside_forms_repeated(3, [3])
    assert Counter((tuple(train.example(i)["nums"]), train.example(i)["target"]) for i in range(len(train))) == expected
    assert train[len(train) - 1]["prompt_token_ids"] == tokenizer.encode(train.example(len(train) - 1)["prompt"])
    assert len(plain) == len(plain.columns["target"])  # the dataset it came from is unchanged
    # with rollout.train_number_counts, only the questions asked repeat
    three = plain.with_number_counts([3]).with_outside_forms_repeated(3, [3])
    assert Counter((tuple(three.example(i)["nums"]), three.example(i)["target"]) for i in range(len(three))) == Counter(
        {question: draws for question, draws in expected.items() if len(question[0]) == 3})
    no_three = plain.with_number_counts([2, 4]).with_outside_forms_repeated(3, [3])
    assert no_three.rows == [row for row in plain.rows if len(plain.columns["nums"][row]) != 3]
