"""The CountDown task: prompt, dataset, exact reward, brute-force solver and data generator.

Given 3-4 numbers and a target, the model must write an arithmetic expression that uses
each number exactly once and equals the target. The reward never evaluates model output
as Python: it parses the answer with a small exact (Fraction) expression parser whose
work is bounded by a length limit, so no answer can hang or crash the training step.

Generate a dataset in the layout of the Hub dataset Jiayi-Pan/Countdown-Tasks-3to4:
    uv run countdown_task.py generate --out Countdown-Tasks-3to4 --size 100000 --seed 0
"""

import argparse
import copy
import functools
import itertools
import logging
import operator
import random
import re
import string
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from answer_format import WHITESPACE, extract_answer_text, format_reward
from config import DataError, InputError, TaskConfig, exit_on_input_error
from inputs import COUNTDOWN_HUB_ID, countdown_files, read_parquet
from run_logging import log_to_console, progress_bar

logger = logging.getLogger("countdown")

SYSTEM_MESSAGE = (
    "You are a helpful assistant. You first think about the reasoning process "
    "in your mind and then provide the user with the answer."
)
QUESTION = "Using the numbers {numbers}, create an equation that equals {target}."
INSTRUCTIONS = (
    "You can use basic arithmetic operations (+, -, *, /) and each number can only be used once. "
    "Show your work in <think> </think> tags. "
    "And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
)
# GRPO:Zero's user turn is the question, then the instructions. task.question_last swaps them (same words): every
# prompt then starts with the same ~110 tokens, which the generator and the update run once per batch
# (generation.prefill, logprobs.AnswerBatch), and only the question differs.
USER_TEMPLATE = f"{QUESTION} {INSTRUCTIONS}"
QUESTION_LAST_TEMPLATE = f"{INSTRUCTIONS} {QUESTION}"
RESPONSE_PREFILL = "Let me solve this step by step.\n<think>"

ANSWER_REWARD = 1.0
# Real answers are ~30 characters; the limit bounds the parser's work (and the size of
# every literal, far below Python's 4300-digit int conversion limit) for any input.
MAX_ANSWER_CHARS = 256
EXPRESSION_CHARS = frozenset(string.digits + "+-*/()" + WHITESPACE)
EXPRESSION_TOKEN = re.compile(r"[0-9]+|[-+*/()]")


# ----------------------------------------------------------------------------- prompt


def render_prompt(tokenizer, numbers: list[int], target: int, question_last: bool = False) -> str:
    """Chat prompt (system + user turn) followed by the response prefill."""
    messages = [
        {"role": "system", "content": SYSTEM_MESSAGE},
        {"role": "user", "content": (QUESTION_LAST_TEMPLATE if question_last else USER_TEMPLATE).format(numbers=list(numbers), target=target)},
    ]
    return tokenizer.render_chat(messages, prefill=RESPONSE_PREFILL)


# ----------------------------------------------------------------------------- dataset


def read_tasks(data_dir: str | Path) -> pa.Table:
    """All rows of data_dir/data/*.parquet, files in sorted name order."""
    files = countdown_files(Path(data_dir))
    return pa.concat_tables([checked_table(file) for file in files], promote_options="default")


def checked_table(file: Path) -> pa.Table:
    """One parquet file's rows, after checking that `nums` is a list of ints and `target` an int in every row:
    a string target would never match any answer, so every reward would silently be 0."""
    table = read_parquet(file)
    needed = f"CountDown data needs `nums` (list of ints) and `target` (int), as in the Hub dataset {COUNTDOWN_HUB_ID}"
    missing_columns = {"nums", "target"} - set(table.column_names)
    if missing_columns:
        raise DataError(f"{file} has columns {table.column_names} but lacks {sorted(missing_columns)}; {needed}")
    nums, target = table.column("nums"), table.column("target")
    if not (pa.types.is_list(nums.type) or pa.types.is_large_list(nums.type)) or not pa.types.is_integer(nums.type.value_type):
        raise DataError(f"{file}: column `nums` is {nums.type}; {needed}")
    if not pa.types.is_integer(target.type):
        raise DataError(f"{file}: column `target` is {target.type}; {needed}")
    empty_or_null = pc.equal(pc.fill_null(pc.list_value_length(nums), 0), 0)
    null_number_rows = pc.filter(pc.list_parent_indices(nums), pc.list_flatten(nums).is_null())
    bad_rows = sorted([pc.index(empty_or_null, True).as_py(), pc.index(target.is_null(), True).as_py(),
                       *null_number_rows[:1].to_pylist()])
    row = next((row for row in bad_rows if row >= 0), None)
    if row is not None:
        values = {name: table.column(name)[row].as_py() for name in ("nums", "target")}
        raise DataError(f"{file} row {row}: {values}; {needed}")
    return table


def task_key(numbers: list[int], target: int) -> tuple[tuple[int, ...], int]:
    """What makes two CountDown rows the same question: the multiset of numbers and the target."""
    return tuple(sorted(numbers)), target


# The SFT warm-up that teaches a model the answer format before GRPO (see train.py's warn_no_reward).
SFT_CONFIG = "configs/countdown_sft.yaml"


def load_dataset(config: TaskConfig, tokenizer, split: str) -> "CountdownDataset":
    """The task interface's dataset (tasks.py)."""
    return CountdownDataset(config.data_dir, tokenizer, split, test_size=config.test_size,
                            question_last=config.question_last)


SOLVABLE_ROWS_CHECKED = 64


class CountdownDataset(torch.utils.data.Dataset):
    """CountDown tasks; test = the last test_size rows, train = the rows before them minus any that repeat
    a test question. Item i is row rows[i] of the columns: every row once (with_outside_forms_repeated: some more)."""

    def __init__(self, data_dir: str | Path, tokenizer, split: str = "train", *, test_size: int = 128,
                 question_last: bool = False):
        table = read_tasks(data_dir)
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if not 0 <= test_size < table.num_rows:
            raise DataError(
                f"task.test_size={test_size} must be in [0, {table.num_rows}) for the "
                f"{table.num_rows} rows in {data_dir}; lower test_size or use more data."
            )
        first_test_row = table.num_rows - test_size
        rows = table.slice(0, first_test_row) if split == "train" else table.slice(first_test_row)
        self.columns = {
            name: rows.column(name).to_pylist() for name in ("nums", "target", "solution") if name in rows.column_names
        }
        if split == "train":
            self.drop_held_out_tasks(table.slice(first_test_row))
        self.check_solvable(data_dir, split)
        self.rows = list(range(len(self.columns["target"])))
        self.tokenizer = tokenizer
        self.question_last = question_last

    def check_solvable(self, data_dir: str | Path, split: str) -> None:
        """Refuse a split whose first rows are all unsolvable (say, targets swapped with a number): every reward
        would be 0 and GRPO would learn nothing. The first solvable row ends the check, so it costs ~nothing."""
        rows = list(zip(self.columns["nums"][:SOLVABLE_ROWS_CHECKED], self.columns["target"][:SOLVABLE_ROWS_CHECKED]))
        if rows and not any(numbers and solve(numbers, target) is not None for numbers, target in rows):
            raise DataError(f"{data_dir}: none of the first {len(rows)} {split} questions is solvable (e.g. nums "
                            f"{rows[0][0]}, target {rows[0][1]}); check the data, or generate some with "
                            f"`uv run countdown_task.py generate --out DIR --size 100000`")

    def drop_held_out_tasks(self, test_rows: pa.Table) -> None:
        """Remove training rows that ask a held-out question again (same numbers in any order, same target).
        Small number ranges repeat tasks often (the CPU demo's 2-number tasks: every held-out one is in the
        training rows), and a repeated task measures memory, not skill."""
        held_out = set(map(task_key, test_rows.column("nums").to_pylist(), test_rows.column("target").to_pylist()))
        keep = [key not in held_out for key in map(task_key, self.columns["nums"], self.columns["target"])]
        self.columns = {name: [value for value, kept in zip(values, keep) if kept] for name, values in self.columns.items()}
        if num_left_out := keep.count(False):
            logger.info("left out %d training rows that repeat a held-out question", num_left_out)

    def with_number_counts(self, counts: list[int]) -> "CountdownDataset":
        """This dataset with only its questions of these number counts (rollout.train_number_counts)."""
        numbers = self.columns["nums"]
        kept = copy.copy(self)
        kept.rows = [row for row in self.rows if len(numbers[row]) in counts]
        if not kept.rows:
            present = sorted({len(numbers[row]) for row in self.rows})
            raise DataError(f"rollout.train_number_counts {counts}: no training question has that many numbers (these "
                            f"have {'/'.join(map(str, present))}); pick counts the data has, or null for every question")
        logger.info("GRPO asks the %d of %d training questions with %s numbers", len(kept.rows), len(self.rows),
                    "/".join(map(str, counts)))
        return kept

    def with_outside_forms_repeated(self, repeat: int, counts: list[int]) -> "CountdownDataset":
        """This dataset with each of its questions of these number counts that none of the 10 best forms (fitted on
        all its rows, as shortcut_baseline's) solves drawn `repeat` times per pass (rollout.outside_forms_repeat)."""
        is_outside = shortcut_baseline(self).outside(self.columns["nums"], self.columns["target"], counts)
        outside_rows = [row for row in self.rows if is_outside[row]]
        repeated = copy.copy(self)
        repeated.rows = self.rows + outside_rows * (repeat - 1)
        logger.info("%d training questions of %s numbers are outside the 10 best forms; drawn %d times each, they are "
                    "%.0f%% of the %d draws per pass", len(outside_rows), "/".join(map(str, counts)), repeat,
                    100 * len(outside_rows) * repeat / len(repeated), len(repeated))
        return repeated

    def __len__(self) -> int:
        return len(self.rows)

    def example(self, index: int) -> dict:
        """The item without its prompt's token ids (tokenizing one prompt at a time is the slow part)."""
        item = {name: values[self.rows[index]] for name, values in self.columns.items()}
        item["prompt"] = render_prompt(self.tokenizer, item["nums"], item["target"], self.question_last)
        return item

    def __getitem__(self, index: int) -> dict:
        # Rendering and tokenizing lazily keeps construction fast on the 490k-row Hub dataset.
        item = self.example(index)
        item["prompt_token_ids"] = self.tokenizer.encode(item["prompt"])
        return item


def shortcut_baseline(train_set: CountdownDataset):
    """The task interface's baseline (tasks.py): what fixed answer forms score (countdown_forms.py), chosen
    on the training rows."""
    from countdown_forms import FormBaseline  # it builds on this module's parser

    return FormBaseline.fit(train_set.columns["nums"], train_set.columns["target"])


# ----------------------------------------------------------------------------- reward


def parse_expression(text: str) -> tuple[Fraction, list[int]] | None:
    """Exact value and integer literals of an arithmetic expression, or None if `text` is not one.

    Grammar: ASCII integer literals (no leading zeros), binary + - * /, unary minus,
    parentheses, ASCII whitespace anywhere. Division by zero gives None. Texts longer than
    MAX_ANSWER_CHARS give None before any work. Evaluation is iterative (operator
    precedence with two stacks), so nesting depth cannot raise RecursionError.
    """
    if len(text) > MAX_ANSWER_CHARS or not EXPRESSION_CHARS.issuperset(text):
        return None
    tokens = EXPRESSION_TOKEN.findall(text)
    if any(token[0] == "0" and len(token) > 1 for token in tokens):
        return None
    value = _evaluate(tokens)
    return None if value is None else (value, [int(token) for token in tokens if token[0].isdigit()])


BINARY_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
ARITHMETIC = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
NEGATE = "neg"  # unary minus on the operator stack; binds tighter than any binary operator
OPERATOR_PRECEDENCE = {**BINARY_PRECEDENCE, NEGATE: 3}


def _evaluate(tokens: list[str], steps: list[str] | None = None) -> Fraction | None:
    """Value of the token list, or None; binary operations are appended to `steps` as "a op b = c"."""
    return reduce_expression(tokens, lambda token: Fraction(int(token)), functools.partial(_apply, steps=steps))


def reduce_expression(tokens: list[str], operand, apply):
    """The tokens reduced by operator precedence with two stacks, or None if they are no expression.
    operand(literal) is a literal's operand; apply(symbol, operands) replaces the top operand(s) with the
    result of symbol (NEGATE or a binary operator) and returns False to reject the expression."""
    values: list = []
    operators: list[str] = []  # NEGATE, binary operators and "("
    expect_operand = True
    for token in tokens:
        if expect_operand:
            if token[0].isdigit():
                values.append(operand(token))
                expect_operand = False
            elif token == "-":
                operators.append(NEGATE)
            elif token == "(":
                operators.append("(")
            else:
                return None
        elif token in BINARY_PRECEDENCE:
            # Pop operators of equal precedence too: binary operators are left-associative.
            while operators and operators[-1] != "(" and OPERATOR_PRECEDENCE[operators[-1]] >= BINARY_PRECEDENCE[token]:
                if not apply(operators.pop(), values):
                    return None
            operators.append(token)
            expect_operand = True
        elif token == ")":
            while operators and operators[-1] != "(":
                if not apply(operators.pop(), values):
                    return None
            if not operators:
                return None
            operators.pop()
        else:  # a literal or "(" right after an operand
            return None
    if expect_operand:  # empty text, or a trailing operator
        return None
    while operators:
        symbol = operators.pop()
        if symbol == "(" or not apply(symbol, values):
            return None
    return values[0]


def _apply(symbol: str, values: list[Fraction], steps: list[str] | None = None) -> bool:
    """Replace the top operand(s) of `values` with the result; False on division by zero."""
    if symbol == NEGATE:
        values.append(-values.pop())
        return True
    right, left = values.pop(), values.pop()
    if symbol == "/" and right == 0:
        return False
    values.append(ARITHMETIC[symbol](left, right))
    if steps is not None:
        steps.append(f"{left} {symbol} {right} = {values[-1]}")
    return True


def sft_response(item: dict) -> str:
    """A reference response for SFT: the solution's operations as the reasoning, then the solution."""
    steps: list[str] = []
    _evaluate(EXPRESSION_TOKEN.findall(item["solution"]), steps)
    return f" {', '.join(steps)} </think>\n<answer> {item['solution']} </answer>"


def answer_reward(response: str, numbers: list[int], target: int) -> float:
    """ANSWER_REWARD when the only <answer>...</answer> holds an expression that uses exactly
    `numbers` (as a multiset) and whose exact value is `target`."""
    answer_text = extract_answer_text(response)
    parsed = None if answer_text is None else parse_expression(answer_text)
    if parsed is None:
        return 0.0
    value, literals = parsed
    return ANSWER_REWARD if Counter(literals) == Counter(numbers) and value == target else 0.0


# Literals of at most 12 digits: int() of a longer one is work a generated text could make unbounded.
WRITTEN_STEP = re.compile(r"(?<!\d)(\d{1,12}) ([-+*/]) (\d{1,12}) = (\d{1,12})(?!\d)")


def try_reward(response: str, numbers: list[int], distinct: bool = False) -> float:
    """The share of the tries written in the think block (separated by ";", as the search warm-up writes them;
    a try is a part with at least one step "a op b = c") that are exact computations: each step takes two
    numbers the try still has (the question's, or results of its earlier steps) and states their exact integer
    result, and the try uses every number of the question. 0 when no try is written. It checks arithmetic, not
    the answer: claiming the target (`97 + 27 = 99`) or one easy right step earns nothing (loss.try_reward_weight).
    distinct: a try with the same steps as an earlier one counts as not exact, since it searches nothing new
    (loss.try_reward_distinct)."""
    return try_shares(response, numbers)[distinct]


def try_shares(response: str, numbers: list[int]) -> tuple[float, float]:
    """try_reward's two shares from one reading of the think block: (exact tries, exact tries not written before)."""
    tries = [WRITTEN_STEP.findall(written) for written in response.split("</think>")[0].split(";")]
    tries = [steps for steps in tries if steps]
    if not tries:
        return 0.0, 0.0
    exact = [is_exact_try(steps, numbers) for steps in tries]
    first_time = [right and steps not in tries[:place] for place, (right, steps) in enumerate(zip(exact, tries))]
    return sum(exact) / len(tries), sum(first_time) / len(tries)


def is_exact_try(steps: list[tuple[str, str, str, str]], numbers: list[int]) -> bool:
    """Whether written steps (WRITTEN_STEP's groups) are an exact computation over every number of `numbers`."""
    available = Counter(numbers)
    for left, symbol, right, result in steps:
        left, right, result = int(left), int(right), int(result)
        operands = Counter([left, right])
        if not operands <= available or (symbol == "/" and right == 0):
            return False
        if ARITHMETIC[symbol](Fraction(left), right) != result:  # the parser's operations, exact: no float quotient
            return False
        available = available - operands + Counter([result])
    return sum(available.values()) == 1


def grade(response: str, numbers: list[int], target: int, end_token: str | None = None) -> dict:
    """Total reward of a response (the text generated after RESPONSE_PREFILL): format and answer. The info also
    holds try_reward and distinct_try_reward, which only a run with loss.try_reward_weight > 0 adds to what the
    update sees."""
    if end_token and response.endswith(end_token):
        response = response[: -len(end_token)]
    format_score = format_reward(response)
    answer_score = answer_reward(response, numbers, target)
    exact_share, distinct_share = try_shares(response, numbers)
    return {
        "reward": format_score + answer_score,
        "reward_info": {"format_reward": format_score, "answer_reward": answer_score,
                        "try_reward": exact_share, "distinct_try_reward": distinct_share},
    }


def reward(response: str, item: dict, end_token: str | None = None) -> dict:
    """The task interface's reward (tasks.py): of a response to a dataset item."""
    return grade(response, item["nums"], item["target"], end_token)


# ----------------------------------------------------------------------------- solver and generator

# An expression tree node: (exact value, operator symbol, left node, right node); a number
# is a leaf (value, None, None, None). Text is rendered only for the tree that is returned.
Node = tuple
LITERAL_PRECEDENCE = 3


def leaf(number: int) -> Node:
    return Fraction(number), None, None, None


def operations(left: Node, right: Node) -> list[tuple[Node, str, Node]]:
    """Every binary operation on two nodes, in either order, except division by zero."""
    pairs = [(left, "+", right), (left, "*", right), (left, "-", right), (right, "-", left)]
    pairs += [(left, "/", right)] if right[0] != 0 else []
    pairs += [(right, "/", left)] if left[0] != 0 else []
    return pairs


def combine(left: Node, symbol: str, right: Node) -> Node:
    return ARITHMETIC[symbol](left[0], right[0]), symbol, left, right


def render(node: Node) -> tuple[str, int]:
    """Text of an expression tree with only the parentheses its value needs, and its precedence."""
    value, symbol, left, right = node
    if symbol is None:
        return str(value), LITERAL_PRECEDENCE
    precedence = BINARY_PRECEDENCE[symbol]
    (left_text, left_precedence), (right_text, right_precedence) = render(left), render(right)
    if left_precedence < precedence:
        left_text = f"({left_text})"
    # a - (b + c) and a / (b * c) need parentheses; a + (b - c) and a * (b / c) do not.
    if right_precedence < precedence or (right_precedence == precedence and symbol in "-/"):
        right_text = f"({right_text})"
    return f"{left_text} {symbol} {right_text}", precedence


def node_pairs(nodes: list):
    """Every unordered pair of the nodes with the nodes left beside it, (first, second, rest): one search step's
    choices (the solvers' and the forms' enumeration). A generator: a search that succeeds stops early."""
    for first, second in itertools.combinations(range(len(nodes)), 2):
        yield nodes[first], nodes[second], [node for index, node in enumerate(nodes) if index not in (first, second)]


def solve(numbers: list[int], target: int, integer_steps: bool = False) -> str | None:
    """One expression using each number exactly once that equals target exactly, or None.

    Depth-first over every binary tree: repeatedly replace two nodes with their combination. With every
    rational step (+ - * / in either order) it is complete for non-negative numbers and positive targets
    (unary minus reaches no further such target). integer_steps: only the public generator's steps, which
    keep every intermediate a non-negative integer (integer_steps_search).
    """
    if not numbers:
        raise ValueError("solve needs at least one number")
    if integer_steps:
        solution = integer_steps_search([(number, None, None, None) for number in numbers], target)
    else:
        solution = _search([leaf(number) for number in numbers], Fraction(target))
    return None if solution is None else render(solution)[0]


def _search(nodes: list[Node], target: Fraction) -> Node | None:
    if len(nodes) == 1:
        return nodes[0] if nodes[0][0] == target else None
    for first, second, rest in node_pairs(nodes):
        for left, symbol, right in operations(first, second):
            solution = _search(rest + [combine(left, symbol, right)], target)
            if solution is not None:
                return solution
    return None


def integer_steps(left: Node, right: Node) -> list[Node]:
    """The public generator's steps on two integer nodes: a + b, a * b, larger minus smaller and exact
    division of the larger by the smaller."""
    larger, smaller = (left, right) if left[0] >= right[0] else (right, left)
    big, small = larger[0], smaller[0]
    nodes = [(big + small, "+", larger, smaller), (big * small, "*", larger, smaller),
             (big - small, "-", larger, smaller)]
    return nodes + ([(big // small, "/", larger, smaller)] if small and big % small == 0 else [])


def integer_steps_search(nodes: list[Node], target: int) -> Node | None:
    """A tree of integer_steps over all `nodes` whose value is target, or None. Plain ints: the generator
    runs it on every draw, and must search the ones it rejects completely."""
    if len(nodes) == 1:
        return nodes[0] if nodes[0][0] == target else None
    if len(nodes) == 2:  # the last step, tested on values before any node is built: most of the search's leaves
        big, small = max(nodes[0][0], nodes[1][0]), min(nodes[0][0], nodes[1][0])
        if target not in (big + small, big * small, big - small) and not (small and big == target * small):
            return None
    for first, second, rest in node_pairs(nodes):
        for combined in integer_steps(first, second):
            solution = integer_steps_search(rest + [combined], target)
            if solution is not None:
                return solution
    return None


SEARCH_DEAD_ENDS = 2  # failed tries a search response writes at most: 4-number tries are ~30 tokens each


def sft_search_response(item: dict, max_dead_ends: int = SEARCH_DEAD_ENDS,
                        fits: Callable[[str], bool] | None = None) -> str:
    """A reference response for SFT that searches (Stream-of-Search's lesson: a model trained on search traces
    learns to search, one trained on solutions only to guess a path): the first max_dead_ends failed tries of
    search_tries, then the solution it finds, each try with its steps, the failed ones ending "(not TARGET)".
    With `fits` (a test of the response text, e.g. a token budget) as many failed tries as fit instead, so a
    search that needs few tries is written whole, whatever the number count.
    ` 44 + 35 = 79, 79 - 19 = 60 (not 98); 44 + 19 = 63, 63 + 35 = 98 </think>\n<answer> 44 + 19 + 35 </answer>`"""
    tries = search_tries(item["nums"], item["target"])
    if tries[-1][0] != item["target"]:
        raise ValueError(f"{item['nums']} -> {item['target']} has no solution with integer steps")
    dead_ends, solution = tries[:-1], tries[-1:]
    if fits is None:
        return search_response(dead_ends[:max_dead_ends] + solution, item["target"])
    count = 0  # the responses grow with each failed try: stop at the first that does not fit
    while count < len(dead_ends) and fits(search_response(dead_ends[: count + 1] + solution, item["target"])):
        count += 1
    return search_response(dead_ends[:count] + solution, item["target"])


def sft_full_search_response(item: dict, max_tries: int) -> str | None:
    """A search response that writes every try of search_tries in the order the search made them, so each
    try's outcome follows from its own steps and the trace never jumps to an answer it has not reached; None
    when the search needs more than max_tries tries (SFT leaves such a question out)."""
    tries = search_tries(item["nums"], item["target"], max_tries)
    return search_response(tries, item["target"]) if tries[-1][0] == item["target"] else None


def search_response(tries: list[Node], target: int) -> str:
    written = [", ".join(tree_steps(tree)) + ("" if tree[0] == target else f" (not {target})") for tree in tries]
    return f" {'; '.join(written)} </think>\n<answer> {render(tries[-1])[0]} </answer>"


def search_tries(numbers: list[int], target: int, max_tries: int | None = None) -> list[Node]:
    """The complete tries (trees over all the numbers) of a depth-first search over integer steps that takes
    the step whose value is nearest the target first and, at the last step, only that step (the nearest is
    the target whenever a step reaches it, so the search stays complete), in the order it makes them: up to
    the first that hits the target, or the first max_tries."""
    tries: list[Node] = []

    def search(nodes: list[Node]) -> bool:
        if len(nodes) == 1:
            tries.append(nodes[0])
            return nodes[0][0] == target
        candidates = [(combined, rest) for first, second, rest in node_pairs(nodes)
                      for combined in integer_steps(first, second)]
        candidates.sort(key=lambda candidate: abs(candidate[0][0] - target))
        return any(search(rest + [combined]) for combined, rest in candidates[: 1 if len(nodes) == 2 else None]
                   if max_tries is None or len(tries) < max_tries)

    search([(number, None, None, None) for number in numbers])
    return tries


def tree_steps(node: Node) -> list[str]:
    """A tree's operations in the order they can be done, each "a op b = value"."""
    value, symbol, left, right = node
    if symbol is None:
        return []
    return [*tree_steps(left), *tree_steps(right), f"{left[0]} {symbol} {right[0]} = {value}"]


# Beyond 6 numbers the exhaustive solver's tree count explodes (6 numbers: ~10^8 trees at worst).
MAX_NUMBERS = 6
MAX_NUMBER_DRAWS = 10_000


def generate_task(rng: random.Random, args: argparse.Namespace) -> dict:
    """As the public dataset (Jiayi-Pan/Countdown-Tasks-3to4, the Stream-of-Search generator) draws a task:
    the target first, uniform in its range; then the numbers, uniform in theirs, redrawn until some
    solution's every step is an integer step (integer_steps)."""
    target = rng.randint(args.min_target, args.max_target)
    count = rng.randint(args.min_numbers, args.max_numbers)
    for _ in range(MAX_NUMBER_DRAWS):
        numbers = [rng.randint(args.min_number, args.max_number) for _ in range(count)]
        solution = solve(numbers, target, integer_steps=True)
        if solution is not None:
            return {"nums": numbers, "target": target, "solution": solution}
    raise DataError(
        f"{MAX_NUMBER_DRAWS} draws of {count} numbers in [{args.min_number}, {args.max_number}] solved no task with "
        f"target {target}; widen --min-number/--max-number or narrow --min-target/--max-target."
    )


def check_generator_arguments(args: argparse.Namespace) -> None:
    """Refuse ranges the generator cannot draw from, or in which no task is solvable, before any work."""
    def refuse(message: str):
        raise InputError(f"countdown_task.py generate: {message}")
    if args.size < 1:
        refuse(f"--size {args.size}: need at least 1 task")
    if not 1 <= args.min_numbers <= args.max_numbers <= MAX_NUMBERS:
        refuse(f"--min-numbers {args.min_numbers} --max-numbers {args.max_numbers}: need 1 <= --min-numbers <= "
               f"--max-numbers <= {MAX_NUMBERS}")
    if not 1 <= args.min_number <= args.max_number:
        refuse(f"--min-number {args.min_number} --max-number {args.max_number}: need 1 <= --min-number <= --max-number")
    if not 1 <= args.min_target <= args.max_target:
        refuse(f"--min-target {args.min_target} --max-target {args.max_target}: need 1 <= --min-target <= --max-target")
    largest = largest_value(args.max_numbers, args.max_number)
    if largest < args.min_target:
        refuse(f"--min-target {args.min_target}: {args.max_numbers} numbers of at most {args.max_number} reach at "
               f"most {largest}, so no task is solvable; lower --min-target or raise --max-number/--max-numbers")


def largest_value(count: int, number: int) -> int:
    """The largest value integer steps reach from `count` numbers of at most `number`."""
    return count if number == 1 else number ** count


def generate(args: argparse.Namespace) -> Path:
    check_generator_arguments(args)
    rng = random.Random(args.seed)
    tasks = [generate_task(rng, args)
             for _ in progress_bar(range(args.size), desc="generating CountDown tasks", unit="task")]
    columns = {
        "target": pa.array([task["target"] for task in tasks], pa.int64()),
        "nums": pa.array([task["nums"] for task in tasks], pa.list_(pa.int64())),
    }
    if args.with_solutions:
        columns["solution"] = pa.array([task["solution"] for task in tasks], pa.string())
    out_file = Path(args.out) / "data" / "train-00000-of-00001.parquet"
    out_file.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), out_file)
    return out_file


def command_line_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="write a solvable CountDown dataset to OUT/data/train-00000-of-00001.parquet")
    gen.add_argument("--out", required=True, help="dataset directory (the parquet goes in OUT/data/)")
    gen.add_argument("--size", type=int, required=True, help="number of tasks")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--min-numbers", type=int, default=3, help="fewest numbers per task")
    gen.add_argument("--max-numbers", type=int, default=4, help="most numbers per task")
    gen.add_argument("--min-number", type=int, default=1, help="smallest number drawn")
    gen.add_argument("--max-number", type=int, default=99, help="largest number drawn")
    gen.add_argument("--min-target", type=int, default=10, help="smallest target drawn")
    gen.add_argument("--max-target", type=int, default=100, help="largest target drawn")
    gen.add_argument("--with-solutions", action="store_true", help="add a `solution` column with one reference expression (for SFT)")
    return parser


def shortest_prompt(tokenizer, args: argparse.Namespace, question_last: bool) -> list[int]:
    """The token ids of the shortest prompt `generate` can write with these arguments: the fewest numbers,
    each the smallest, and the smallest target (a lower bound that needs no data)."""
    return tokenizer.encode(render_prompt(tokenizer, [args.min_number] * args.min_numbers, args.min_target,
                                          question_last))


def main(argv: list[str] | None = None) -> None:
    args = command_line_parser().parse_args(argv)
    try:
        print(f"wrote {generate(args)}")
    except InputError as error:
        if argv is not None:  # called from Python (bootstrap, benches, tests): the caller decides
            raise
        exit_on_input_error(error)


if __name__ == "__main__":
    log_to_console()
    main()
