"""The CountDown task: prompt, dataset, exact reward, brute-force solver and data generator.

Given 3-4 numbers and a target, the model must write an arithmetic expression that uses
each number exactly once and equals the target. The reward never evaluates model output
as Python: it parses the answer with a small exact (Fraction) expression parser whose
work is bounded by a length limit, so no answer can hang or crash the training step.

Generate a dataset in the layout of the Hub dataset Jiayi-Pan/Countdown-Tasks-3to4:
    uv run countdown_task.py generate --out Countdown-Tasks-3to4 --size 100000 --seed 0
"""

import argparse
import itertools
import logging
import operator
import random
import re
import string
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from answer_format import WHITESPACE, extract_answer_text, format_reward
from config import DataError, TaskConfig
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


class CountdownDataset(torch.utils.data.Dataset):
    """CountDown tasks; test = the last test_size rows, train = the rows before them minus any that repeat
    a test question."""

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
        self.tokenizer = tokenizer
        self.question_last = question_last

    def drop_held_out_tasks(self, test_rows: pa.Table) -> None:
        """Remove training rows that ask a held-out question again (same numbers in any order, same target).
        Small number ranges repeat tasks often (the CPU demo's 2-number tasks: every held-out one is in the
        training rows), and a repeated task measures memory, not skill."""
        held_out = set(map(task_key, test_rows.column("nums").to_pylist(), test_rows.column("target").to_pylist()))
        keep = [key not in held_out for key in map(task_key, self.columns["nums"], self.columns["target"])]
        self.columns = {name: [value for value, kept in zip(values, keep) if kept] for name, values in self.columns.items()}
        if num_left_out := keep.count(False):
            logger.info("left out %d training rows that repeat a held-out question", num_left_out)

    def __len__(self) -> int:
        return len(self.columns["target"])

    def example(self, index: int) -> dict:
        """The item without its prompt's token ids (tokenizing one prompt at a time is the slow part)."""
        item = {name: values[index] for name, values in self.columns.items()}
        item["prompt"] = render_prompt(self.tokenizer, item["nums"], item["target"], self.question_last)
        return item

    def __getitem__(self, index: int) -> dict:
        # Rendering and tokenizing lazily keeps construction fast on the 490k-row Hub dataset.
        item = self.example(index)
        item["prompt_token_ids"] = self.tokenizer.encode(item["prompt"])
        return item


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
    values: list[Fraction] = []
    operators: list[str] = []  # NEGATE, binary operators and "("
    expect_operand = True
    for token in tokens:
        if expect_operand:
            if token[0].isdigit():
                values.append(Fraction(int(token)))
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
                if not _apply(operators.pop(), values, steps):
                    return None
            operators.append(token)
            expect_operand = True
        elif token == ")":
            while operators and operators[-1] != "(":
                if not _apply(operators.pop(), values, steps):
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
        if symbol == "(" or not _apply(symbol, values, steps):
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


def grade(response: str, numbers: list[int], target: int, end_token: str | None = None) -> dict:
    """Total reward of a response (the text generated after RESPONSE_PREFILL)."""
    if end_token and response.endswith(end_token):
        response = response[: -len(end_token)]
    format_score = format_reward(response)
    answer_score = answer_reward(response, numbers, target)
    return {
        "reward": format_score + answer_score,
        "reward_info": {"format_reward": format_score, "answer_reward": answer_score},
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


def solve(numbers: list[int], target: int) -> str | None:
    """One expression using each number exactly once with + - * / that equals target exactly, or None.

    Depth-first over every binary tree: repeatedly replace two nodes with their combination.
    Complete for non-negative numbers and positive targets (unary minus reaches no further such target).
    """
    if not numbers:
        raise ValueError("solve needs at least one number")
    solution = _search([leaf(number) for number in numbers], Fraction(target))
    return None if solution is None else render(solution)[0]


def _search(nodes: list[Node], target: Fraction) -> Node | None:
    if len(nodes) == 1:
        return nodes[0] if nodes[0][0] == target else None
    for first, second in itertools.combinations(range(len(nodes)), 2):
        rest = [node for index, node in enumerate(nodes) if index not in (first, second)]
        for left, symbol, right in operations(nodes[first], nodes[second]):
            solution = _search(rest + [combine(left, symbol, right)], target)
            if solution is not None:
                return solution
    return None


def random_expression(numbers: list[int], rng: random.Random) -> Node:
    """A random expression tree using each number once: combine two random nodes until one is left."""
    nodes = [leaf(number) for number in numbers]
    while len(nodes) > 1:
        left = nodes.pop(rng.randrange(len(nodes)))
        right = nodes.pop(rng.randrange(len(nodes)))
        nodes.append(combine(*rng.choice(operations(left, right))))
    return nodes[0]


MAX_NUMBER_DRAWS = 10_000


def generate_task(rng: random.Random, args: argparse.Namespace) -> dict:
    """Draw numbers, then random expressions over them until one is an integer in the target range."""
    for _ in range(MAX_NUMBER_DRAWS):
        count = rng.randint(args.min_numbers, args.max_numbers)
        numbers = [rng.randint(args.min_number, args.max_number) for _ in range(count)]
        for _ in range(args.expressions_per_draw):
            expression = random_expression(numbers, rng)
            if expression[0].denominator == 1 and args.min_target <= expression[0] <= args.max_target:
                return {"nums": numbers, "target": int(expression[0]), "solution": render(expression)[0]}
    raise ValueError(
        f"{MAX_NUMBER_DRAWS} draws of numbers in [{args.min_number}, {args.max_number}] reached no target in "
        f"[{args.min_target}, {args.max_target}]; widen the number range or the target range."
    )


def generate(args: argparse.Namespace) -> Path:
    if not 1 <= args.min_numbers <= args.max_numbers:
        raise ValueError(f"need 1 <= --min-numbers <= --max-numbers, got {args.min_numbers} and {args.max_numbers}")
    if not 0 <= args.min_number <= args.max_number or not 1 <= args.min_target <= args.max_target:
        raise ValueError("need 0 <= --min-number <= --max-number and 1 <= --min-target <= --max-target")
    rng = random.Random(args.seed)
    tasks = []
    for _ in progress_bar(range(args.size), desc="generating CountDown tasks", unit="task"):
        task = generate_task(rng, args)
        # The random tree already proves solvability; the independent solver double-checks it.
        if solve(task["nums"], task["target"]) is None:
            raise AssertionError(f"solver found no solution for generated task {task}")
        tasks.append(task)
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
    gen.add_argument("--max-number", type=int, default=100, help="largest number drawn")
    gen.add_argument("--min-target", type=int, default=1)
    gen.add_argument("--max-target", type=int, default=100)
    gen.add_argument("--expressions-per-draw", type=int, default=20, help="random expressions tried before redrawing the numbers")
    gen.add_argument("--with-solutions", action="store_true", help="add a `solution` column with one reference expression (for SFT)")
    return parser


def shortest_prompt(tokenizer, args: argparse.Namespace, question_last: bool) -> list[int]:
    """The token ids of the shortest prompt `generate` can write with these arguments: the fewest numbers,
    each the smallest, and the smallest target (a lower bound that needs no data)."""
    return tokenizer.encode(render_prompt(tokenizer, [args.min_number] * args.min_numbers, args.min_target,
                                          question_last))


def main(argv: list[str] | None = None) -> None:
    args = command_line_parser().parse_args(argv)
    print(f"wrote {generate(args)}")


if __name__ == "__main__":
    log_to_console()
    main()
