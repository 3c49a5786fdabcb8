"""GSM8K grade-school math: loading, prompts, SFT data and the reward.

The reward is 0.1 for the <think>/<answer> format (the CountDown rule) plus 1.0
when the text inside <answer></answer> has the same exact rational value as the
gold answer. Answers come from the model, so they are read by the small parser
below and never by eval, exec or sympify (which calls eval).

    uv run gsm8k_task.py sft-data --data gsm8k --out sft_gsm8k.jsonl
"""

import argparse
import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import torch
from sympy import Rational
from tqdm import tqdm

from countdown_task import extract_answer_text, format_reward

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
THINK_PREFILL = "<think>"
FORMAT_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
GOLD_ANSWER_MARKER = "####"
CALCULATOR_ANNOTATION = re.compile(r"<<[^<>]*>>")  # GSM8K's "<<48/2=24>>" calculator calls
DOWNLOAD_HINT = (
    "download GSM8K with `git lfs install && git clone https://huggingface.co/datasets/openai/gsm8k` "
    "and pass the clone's directory"
)

# ----------------------------------------------------------------------------
# data


def load_gsm8k_rows(data_dir: str | Path, split: str) -> list[dict[str, str]]:
    """Rows {"question", "answer"} of one split, from <split>.jsonl or the Hub's main/<split>-*.parquet."""
    data_dir = Path(data_dir)
    expected = f"{split}.jsonl or main/{split}-00000-of-00001.parquet"
    if not data_dir.is_dir():
        raise FileNotFoundError(f"GSM8K directory {data_dir} does not exist (expected {expected} in it); {DOWNLOAD_HINT}")
    jsonl_path = data_dir / f"{split}.jsonl"
    parquet_paths = sorted((data_dir / "main").glob(f"{split}-*.parquet"))
    if jsonl_path.is_file():
        with jsonl_path.open(encoding="utf-8") as jsonl_file:
            rows = [json.loads(line) for line in jsonl_file if line.strip()]
    elif parquet_paths:
        rows = [row for path in parquet_paths for row in _read_parquet_rows(path)]
    else:
        raise FileNotFoundError(f"GSM8K directory {data_dir} has neither {expected}; {DOWNLOAD_HINT}")
    for index, row in enumerate(rows):
        if not isinstance(row.get("question"), str) or GOLD_ANSWER_MARKER not in str(row.get("answer")):
            raise ValueError(
                f"GSM8K {split} row {index} in {data_dir} is not {{'question': str, 'answer': '... #### <answer>'}}: "
                f"{str(row)[:200]}; point --data at the 'main' GSM8K configuration"
            )
    return rows


def _read_parquet_rows(path: Path) -> list[dict[str, str]]:
    with path.open("rb") as parquet_file:
        if parquet_file.read(4) != b"PAR1":
            raise ValueError(f"{path} is not a parquet file (a git-lfs pointer?); run `git lfs pull` in the GSM8K clone")
    return pq.read_table(path, columns=["question", "answer"]).to_pylist()


def extract_gold_answer(solution: str) -> str:
    """The final answer after '####' in a GSM8K worked solution, thousands commas removed."""
    if GOLD_ANSWER_MARKER not in solution:
        raise ValueError(f"GSM8K solution has no '#### <answer>' line: {solution[-100:]!r}")
    return solution.rpartition(GOLD_ANSWER_MARKER)[2].strip().replace(",", "")


def clean_solution(solution: str) -> str:
    """The worked solution without its '#### <answer>' line and calculator annotations."""
    return CALCULATOR_ANNOTATION.sub("", solution.rpartition(GOLD_ANSWER_MARKER)[0]).strip()


def load_prompt_template(name_or_path: str | Path) -> str:
    """A template from prompts/<name>.txt, or from a file path; '{question}' marks where the question goes."""
    path = PROMPTS_DIR / f"{name_or_path}.txt"
    if not path.is_file():
        path = Path(name_or_path)
    if not path.is_file():
        names = sorted(template_path.stem for template_path in PROMPTS_DIR.glob("*.txt"))
        raise FileNotFoundError(f"prompt template {str(name_or_path)!r} is neither one of {names} nor a file")
    template = path.read_text(encoding="utf-8").removesuffix("\n")  # the newline that ends every text file
    if "{question}" not in template:
        raise ValueError(f"prompt template {path} has no '{{question}}' placeholder; add one where the question goes")
    return template


def prompt_ends_inside_think(template: str) -> bool:
    """Whether prompts end with an open <think>, so responses start inside the think block."""
    return template.rstrip().endswith(THINK_PREFILL)


def render_prompt(template: str, question: str) -> str:
    # str.format would choke on braces in the template's other text
    return template.replace("{question}", question)


def make_example(row: dict[str, str], template: str) -> dict:
    """One problem as the training loop sees it, before tokenization."""
    return {
        "question": row["question"],
        "answer": extract_gold_answer(row["answer"]),
        "solution": clean_solution(row["answer"]),
        "prompt": render_prompt(template, row["question"]),
        "prompt_ends_with_think": prompt_ends_inside_think(template),
    }


class GSM8KDataset(torch.utils.data.Dataset):
    """GSM8K problems as plain-text prompts for a base (non-chat) model, tokenized on access."""

    def __init__(self, data_dir: str | Path, tokenizer, split: str = "train", prompt_template: str | Path = "reasoning"):
        template = load_prompt_template(prompt_template)
        self.tokenizer = tokenizer
        self.examples = [make_example(row, template) for row in load_gsm8k_rows(data_dir, split)]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        example = self.examples[index]
        return {**example, "prompt_token_ids": self.tokenizer.encode(example["prompt"])}


# ----------------------------------------------------------------------------
# answer grading: numbers and + - * / ^ ( ) \frac, evaluated as exact rationals

MAX_ANSWER_CHARS = 256  # far above any GSM8K answer; bounds the parser's time
MAX_NESTING_DEPTH = 32  # parentheses, \frac and ^ chains; keeps recursion far from Python's limit
MAX_POWER_BITS = 4096  # refuse 9^9^9-style answers before computing them

TEXT_COMMAND = re.compile(r"\\(?:text|textrm|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
LATEX_REPLACEMENTS = (
    ("\\(", ""), ("\\)", ""), ("\\[", ""), ("\\]", ""),
    ("\\left", ""), ("\\right", ""), ("\\boxed", ""), ("\\fbox", ""),
    ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
    ("\\times", "*"), ("\\cdot", "*"), ("\\div", "/"), ("\u00d7", "*"), ("\u00f7", "/"), ("\u2212", "-"),
    ("{,}", ","), ("\\,", ""), ("\\!", ""), ("\\;", ""), ("\\ ", " "), ("~", " "),
    ("\\$", ""), ("$", ""), ("\\%", "%"),
)  # fmt: skip
ANSWER_TOKEN = re.compile(
    r"\s*(\d{1,3}(?:,\d{3})+(?:\.\d*)?|\d+(?:\.\d*)?|\.\d+|\*\*|[-+*/^(){}%]|\\frac|[A-Za-z]+)",
    re.ASCII,
)
# A unit after the number is dropped ("18 dollars"), unless it changes the value or adds a second number.
VALUE_WORDS = frozenset(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred hundreds "
    "thousand thousands million millions billion billions trillion trillions dozen dozens half halves "
    "third thirds quarter quarters k m b mn bn".split()
)


class _Unparseable(Exception):
    pass


def parse_answer(text: str) -> Rational | None:
    """The exact value of an answer, or None when it is not a number or simple expression (never raises)."""
    if len(text) > MAX_ANSWER_CHARS:
        return None
    tokens = _tokenize(_normalize(text))
    if not tokens:
        return None
    try:
        value, position = _parse_sum(tokens, 0, 0)
    except _Unparseable:
        return None
    if all(token == "%" or (token.isalpha() and token.lower() not in VALUE_WORDS) for token in tokens[position:]):
        return value
    return None


def answers_match(predicted: str, gold: str) -> bool:
    predicted_value = parse_answer(predicted)
    return predicted_value is not None and predicted_value == parse_answer(gold)


def _normalize(text: str) -> str:
    text = TEXT_COMMAND.sub(r" \1 ", text)
    for latex, plain in LATEX_REPLACEMENTS:
        text = text.replace(latex, plain)
    return text.strip().removesuffix(".")  # a sentence's full stop, as in "18 dollars."


def _tokenize(text: str) -> list[str] | None:
    tokens, position = [], 0
    while match := ANSWER_TOKEN.match(text, position):
        tokens.append(match.group(1))
        position = match.end()
    return tokens if text[position:].strip() == "" else None


def _peek(tokens: list[str], position: int) -> str:
    return tokens[position] if position < len(tokens) else ""


def _parse_sum(tokens: list[str], position: int, depth: int) -> tuple[Rational, int]:
    value, position = _parse_product(tokens, position, depth)
    while (operator := _peek(tokens, position)) in ("+", "-"):
        right, position = _parse_product(tokens, position + 1, depth)
        value = value + right if operator == "+" else value - right
    return value, position


def _parse_product(tokens: list[str], position: int, depth: int) -> tuple[Rational, int]:
    value, position = _parse_signed(tokens, position, depth)
    while (operator := _peek(tokens, position)) in ("*", "/"):
        right, position = _parse_signed(tokens, position + 1, depth)
        value = value * right if operator == "*" else _divide(value, right)
    return value, position


def _parse_signed(tokens: list[str], position: int, depth: int) -> tuple[Rational, int]:
    sign = 1
    while (operator := _peek(tokens, position)) in ("+", "-"):
        sign = -sign if operator == "-" else sign
        position += 1
    value, position = _parse_power(tokens, position, depth)
    return sign * value, position  # -2^2 is -(2^2), as in written math


def _parse_power(tokens: list[str], position: int, depth: int) -> tuple[Rational, int]:
    base, position = _parse_atom(tokens, position, depth)
    if _peek(tokens, position) not in ("^", "**"):
        return base, position
    exponent, position = _parse_signed(tokens, position + 1, depth + 1)  # right-associative: 2^3^2 = 2^9
    if exponent.q != 1 or (base == 0 and exponent < 0):
        raise _Unparseable  # roots leave the rationals; 0^-1 is undefined
    if max(abs(base.p).bit_length(), base.q.bit_length()) * abs(exponent.p) > MAX_POWER_BITS:
        raise _Unparseable
    return base ** int(exponent.p), position


def _parse_atom(tokens: list[str], position: int, depth: int) -> tuple[Rational, int]:
    if depth > MAX_NESTING_DEPTH:
        raise _Unparseable
    token = _peek(tokens, position)
    if token[:1].isdigit() or token[:1] == ".":
        whole, _, fraction = token.replace(",", "").partition(".")
        return Rational(int(whole + fraction), 10 ** len(fraction)), position + 1
    if token == "\\frac":
        numerator, position = _parse_atom(tokens, position + 1, depth + 1)
        denominator, position = _parse_atom(tokens, position, depth + 1)
        return _divide(numerator, denominator), position
    if token in ("(", "{"):
        value, position = _parse_sum(tokens, position + 1, depth + 1)
        if _peek(tokens, position) != {"(": ")", "{": "}"}[token]:
            raise _Unparseable
        return value, position + 1
    raise _Unparseable


def _divide(numerator: Rational, denominator: Rational) -> Rational:
    if denominator == 0:
        raise _Unparseable  # sympy would return zoo rather than fail
    return numerator / denominator


# ----------------------------------------------------------------------------
# reward


def format_reward_without_prefill(text: str) -> float:
    """The CountDown format rule for a whole text that must open its own <think>."""
    before_think, think, after_think = text.partition(THINK_PREFILL)
    if not think or any(tag in before_think for tag in FORMAT_TAGS):
        return 0.0  # a tag before the first <think> is out of order or repeated
    return format_reward(after_think)


def reward_function(
    response: str, gold_answer: str, end_token: str | None = None, prompt_ends_with_think: bool = True
) -> dict:
    """Format reward (0.1) plus answer reward (1.0 when <answer> equals gold_answer); never raises."""
    if end_token:
        response = response.removesuffix(end_token)
    format_score = format_reward(response) if prompt_ends_with_think else format_reward_without_prefill(response)
    answer_text = extract_answer_text(response)
    answer_score = 1.0 if answer_text is not None and answers_match(answer_text, gold_answer) else 0.0
    return {
        "reward": format_score + answer_score,
        "reward_info": {"format_reward": format_score, "answer_reward": answer_score},
    }


def reward_for_item(response: str, item: dict, end_token: str | None = None) -> dict:
    """Reward for a response to a dataset item; the training loop's entry point."""
    return reward_function(response, item["answer"], end_token, item["prompt_ends_with_think"])


# ----------------------------------------------------------------------------
# SFT data


def sft_response(example: dict) -> str:
    """The worked solution as a response in the reward's format, ending with the gold answer."""
    response = f"{example['solution']} </think> <answer> {example['answer']} </answer>"
    return response if example["prompt_ends_with_think"] else f"{THINK_PREFILL} {response}"


def write_sft_data(data_dir: str | Path, out_path: str | Path, split: str, prompt_template: str | Path) -> int:
    """Write {"prompt", "response"} JSONL lines for one split; returns the number written."""
    template = load_prompt_template(prompt_template)
    rows = load_gsm8k_rows(data_dir, split)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("w", encoding="utf-8") as out_file:
        for row in tqdm(rows, desc=f"GSM8K {split} -> {out_path}"):
            example = make_example(row, template)
            line = {"prompt": example["prompt"], "response": sft_response(example)}
            out_file.write(json.dumps(line, ensure_ascii=False) + "\n")
    return len(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    sft_data = commands.add_parser("sft-data", help="write worked solutions as {prompt, response} JSONL for SFT")
    sft_data.add_argument("--data", required=True, help="GSM8K directory: train.jsonl/test.jsonl or the Hub clone")
    sft_data.add_argument("--out", required=True, help="output JSONL file")
    sft_data.add_argument("--split", default="train", choices=["train", "test"])
    sft_data.add_argument("--prompt-template", default="reasoning", help="name in prompts/ or a template file")
    args = parser.parse_args(argv)
    count = write_sft_data(args.data, args.out, args.split, args.prompt_template)
    print(f"wrote {count} examples to {args.out}")


if __name__ == "__main__":
    main()
