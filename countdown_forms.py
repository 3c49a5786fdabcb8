"""CountDown's shortcut baseline: what one fixed answer form scores, beside what the policy scores.

A form is an expression template over the numbers' places in the prompt: for "Using the numbers
[44, 19, 35], create an equation that equals 98" the form `a + b - c` answers 44 + 19 - 35. A policy that
writes one form for every question has learned a template, not a search, and its success is that form's
coverage. So every CountDown score is reported per number count beside:
- best_form: the share of the scored questions that the best single form solves;
- top10_forms: the share that at least one of the 10 best forms solves;
- success_outside_top10: the policy's success on the questions that none of those 10 forms solves;
- policy_form_share: the share of answers written in the policy's most used form (policy_form);
- mul_div_answer_share: the share of answers that use * or /, which most questions outside the top forms need;
- pass_outside_top10: with several answers per question, the share of the questions outside the 10 forms that
  at least one answer solves (pass@k there: what GRPO's groups can find to reinforce).
The forms are chosen on training rows (the best single form; then the 10 that together solve the most,
picked greedily), never on the scored questions. docs/tasks_and_rewards.md explains the numbers.
"""

import functools
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np

from countdown_task import (EXPRESSION_TOKEN, NEGATE, extract_answer_text, node_pairs, parse_expression, reduce_expression,
                            render)

NUM_TOP_FORMS = 10
FIT_ROWS_PER_COUNT = 2000  # training rows a number count's forms are chosen on: coverage SE <= 1.1 points
MAX_FORM_NUMBERS = 4  # 5 numbers have ~0.5M forms: too many to score on every evaluation
PLACES = "abcdefghij"


@functools.cache
def all_forms(count: int) -> dict[str, tuple]:
    """Every form over `count` places with + - * / (both orders of - and /), by its text (the same text
    countdown_task.render gives a tree); a form is a tree whose leaves are place indices."""
    forms: dict[str, tuple] = {}

    def search(nodes: list[tuple]) -> None:
        if len(nodes) == 1:
            forms.setdefault(form_text(nodes[0]), nodes[0])
            return
        for left, right, rest in node_pairs(nodes):
            for tree in (("+", left, right), ("*", left, right), ("-", left, right), ("-", right, left),
                         ("/", left, right), ("/", right, left)):
                search(rest + [tree])

    search(list(range(count)))
    return forms


def as_node(tree) -> tuple:
    """A form tree as countdown_task's Node (value, symbol, left, right), its leaves' values the place letters."""
    if isinstance(tree, int):
        return PLACES[tree], None, None, None
    symbol, left, right = tree
    return None, symbol, as_node(left), as_node(right)


def form_text(tree) -> str:
    return render(as_node(tree))[0]


def solves(tree, numbers: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Whether the form's exact value is the target, per row of numbers (rows x places)."""
    numerator, denominator = exact_value(tree, numbers)
    return (denominator != 0) & (numerator == targets * denominator)


def exact_value(tree, numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The form's value on every row as numerator and denominator (0 after a division by zero), unreduced:
    4 numbers below 1000 keep both under 10^13, far inside int64."""
    if isinstance(tree, int):
        return numbers[:, tree], np.ones(len(numbers), dtype=np.int64)
    symbol, left, right = tree
    (a, b), (c, d) = exact_value(left, numbers), exact_value(right, numbers)
    if symbol == "+":
        return a * d + c * b, b * d
    if symbol == "-":
        return a * d - c * b, b * d
    if symbol == "*":
        return a * c, b * d
    return a * d, b * c


def coverage(rows: list[tuple[list[int], int]]) -> dict[str, np.ndarray]:
    """Which of rows (numbers, target), all of one count, each form solves."""
    numbers = np.array([row[0] for row in rows], dtype=np.int64)
    targets = np.array([row[1] for row in rows], dtype=np.int64)
    return {text: solves(tree, numbers, targets) for text, tree in all_forms(numbers.shape[1]).items()}


def best_forms(rows: list[tuple[list[int], int]], num_forms: int = NUM_TOP_FORMS) -> list[str]:
    """The forms that together solve the most rows, chosen greedily: the first is the best single form."""
    solved = coverage(rows)
    chosen, covered = [], np.zeros(len(rows), dtype=bool)
    for _ in range(min(num_forms, len(solved))):
        text = max(solved, key=lambda form: int((solved[form] & ~covered).sum()))
        chosen.append(text)
        covered |= solved[text]
    return chosen


def answer_form(response: str, numbers: list[int]) -> str | None:
    """The form of the response's answer: each literal replaced by the place of the prompt number it uses
    (equal numbers: places in order), or None if the answer is no expression of exactly the prompt's numbers."""
    answer = extract_answer_text(response)
    if answer is None or parse_expression(answer) is None:
        return None
    free_places = defaultdict(list)
    for place, number in enumerate(numbers):
        free_places[number].append(place)
    tokens = EXPRESSION_TOKEN.findall(answer)
    places = [free_places[int(token)].pop(0) if free_places[int(token)] else None
              for token in tokens if token[0].isdigit()]
    if None in places or any(free_places.values()):
        return None
    leaves = iter(places)
    tree = reduce_expression(tokens, lambda token: next(leaves), apply_to_tree)
    return None if tree is None else form_text(tree)


def apply_to_tree(symbol: str, trees: list) -> bool:
    """reduce_expression's step building a form tree; unary minus is not part of any form."""
    if symbol == NEGATE:
        return False
    right, left = trees.pop(), trees.pop()
    trees.append((symbol, left, right))
    return True


@dataclass
class FormBaseline:
    """The forms chosen on training rows, per number count (the first of each list is the best single form)."""

    forms: dict[int, list[str]]

    @classmethod
    def fit(cls, numbers: list[list[int]], targets: list[int]) -> "FormBaseline":
        by_count = defaultdict(list)
        for row in zip(numbers, targets):
            if len(row[0]) <= MAX_FORM_NUMBERS and len(by_count[len(row[0])]) < FIT_ROWS_PER_COUNT:
                by_count[len(row[0])].append(row)
        return cls({count: best_forms(rows) for count, rows in sorted(by_count.items())})

    def outside(self, numbers: list[list[int]], targets: list[int], counts: list[int]) -> list[bool]:
        """Per row: whether its number count is one of `counts` and none of that count's forms solves it."""
        is_outside = [False] * len(targets)
        for count in set(counts) & set(self.forms):
            rows = [index for index, row_numbers in enumerate(numbers) if len(row_numbers) == count]
            if not rows:
                continue
            count_numbers = np.array([numbers[index] for index in rows], dtype=np.int64)
            count_targets = np.array([targets[index] for index in rows], dtype=np.int64)
            top = functools.reduce(np.logical_or, (solves(all_forms(count)[form], count_numbers, count_targets)
                                                   for form in self.forms[count]))
            for index, in_top in zip(rows, top):
                is_outside[index] = not in_top
        return is_outside

    def report(self, samples: list[dict]) -> dict[str, float | str]:
        """Per number count of the samples' questions: success, the forms' coverage of the same questions,
        success outside the top forms and the policy's most used form. Keys `{count}_numbers/...`."""
        by_count = defaultdict(list)
        for sample in samples:
            by_count[len(sample["nums"])].append(sample)
        report = {}
        for count, count_samples in sorted(by_count.items()):
            report.update({f"{count}_numbers/{key}": value
                           for key, value in self.count_report(count, count_samples).items()})
        return report

    def count_report(self, count: int, samples: list[dict]) -> dict[str, float | str]:
        successes = np.array([sample["reward_info"]["answer_reward"] > 0 for sample in samples])
        forms_used = Counter(answer_form(sample["response"], sample["nums"]) for sample in samples)
        written = [(form, used) for form, used in forms_used.most_common() if form is not None]
        answers = [extract_answer_text(sample["response"]) or "" for sample in samples]
        report = {"success": float(successes.mean()), "questions": len({sample["question_index"] for sample in samples}),
                  "policy_form": written[0][0] if written else "none",
                  "policy_form_share": written[0][1] / len(samples) if written else 0.0,
                  "mul_div_answer_share": float(np.mean([any(op in answer for op in "*/") for answer in answers]))}
        if count not in self.forms:  # no training rows of this count (or too many numbers): no forms
            return report
        solved = coverage([(sample["nums"], sample["target"]) for sample in samples])
        top = functools.reduce(np.logical_or, (solved[form] for form in self.forms[count]))
        per_question = {sample["question_index"]: index for index, sample in enumerate(samples)}  # one row each
        first_rows = list(per_question.values())
        outside = ~top
        best = self.forms[count][0]
        report.update({"best_form": best, "best_form_coverage": float(solved[best][first_rows].mean()),
                       "top10_forms_coverage": float(top[first_rows].mean()),
                       "questions_outside_top10": int(outside[first_rows].sum()),
                       "success_outside_top10": float(successes[outside].mean()) if outside.any() else 0.0})
        if len(samples) > len(first_rows):  # several answers per question
            outside_questions = {samples[row]["question_index"] for row in first_rows if outside[row]}
            solved_questions = {sample["question_index"] for sample, right in zip(samples, successes) if right}
            report["pass_outside_top10"] = (len(outside_questions & solved_questions) / len(outside_questions)
                                            if outside_questions else 0.0)
        return report


