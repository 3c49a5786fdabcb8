"""GSM8K grade-school math: loading, prompts, SFT data and the reward.

The reward is 0.1 for the <think>/<answer> format (the CountDown rule) plus 1.0
when the text inside <answer></answer> has the same exact rational value as the
gold answer. Answers come from the model, so they are read by the small parser
below and never by eval, exec or sympify (which calls eval).

    uv run gsm8k_task.py sft-data --data openai/gsm8k --out sft_gsm8k.jsonl   # or --data a local directory
"""

import argparse
import json
import re
from pathlib import Path

import torch
from sympy import Rational

import hub
from config import ConfigError, DataError, InputError, exit_on_input_error
from countdown_task import extract_answer_text, format_reward
from inputs import GSM8K_DOWNLOAD_HINT, GSM8K_HUB_FILES, gsm8k_files, read_parquet
from run_logging import log_to_console, progress_bar

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
THINK_PREFILL = "<think>"
FORMAT_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
GOLD_ANSWER_MARKER = "####"
CALCULATOR_ANNOTATION = re.compile(r"<<[^<>]*>>")  # GSM8K's "<<48/2=24>>" calculator calls

# ----------------------------------------------------------------------------
# data


def load_gsm8k_rows(data_dir: str | Path, split: str) -> list[dict[str, str]]:
    """Rows {"question", "answer"} of one split, from <split>.jsonl or the Hub's main/<split>-*.parquet.

    Every row is checked before training starts: a bad row is an error naming its file and line (or row).
    """
    located_rows = []
    for path in gsm8k_files(Path(data_dir), split):
        if path.suffix == ".jsonl":
            located_rows += _read_jsonl_rows(path)
        else:
            located_rows += [(f"{path} row {index}", row) for index, row in enumerate(read_parquet(path).to_pylist())]
    if not located_rows:
        raise DataError(f"GSM8K {split} split in {data_dir} has no rows; {GSM8K_DOWNLOAD_HINT}")
    for where, row in located_rows:
        _check_row(row, where)
    return [row for _, row in located_rows]


def _read_jsonl_rows(path: Path) -> list[tuple[str, object]]:
    """("<path>:<line>", value) for each non-blank line; a byte-order mark at the start is allowed."""
    located_rows = []
    try:
        with path.open(encoding="utf-8-sig") as jsonl_file:
            for line_number, line in enumerate(jsonl_file, start=1):
                if not line.strip():
                    continue
                try:
                    located_rows.append((f"{path}:{line_number}", json.loads(line)))
                except json.JSONDecodeError as error:
                    raise DataError(
                        f"{path}:{line_number}: not valid JSON ({error.msg} at column {error.colno}); "
                        "each line must be one object {'question': ..., 'answer': ...}"
                    ) from None
    except UnicodeDecodeError as error:
        raise DataError(f"{path} is not UTF-8 text ({error}); GSM8K's JSONL files are UTF-8") from None
    return located_rows


def _check_row(row: object, where: str) -> None:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object {{'question': ..., 'answer': ...}}, got {str(row)[:100]}")
    if not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str) or (
        GOLD_ANSWER_MARKER not in row["answer"]
    ):
        raise DataError(
            f"{where}: not {{'question': str, 'answer': '... #### <answer>'}}: {str(row)[:200]}; "
            "point --data at the 'main' GSM8K configuration"
        )
    gold = extract_gold_answer(row["answer"])
    if parse_answer(gold) is None:
        raise DataError(f"{where}: the gold answer {gold[:100]!r} after '####' is not a number; no answer can match it")


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
        raise ConfigError(f"task.prompt_template: {str(name_or_path)!r} is neither one of {names} nor a file")
    template = path.read_text(encoding="utf-8").removesuffix("\n")  # the newline that ends every text file
    if "{question}" not in template:
        raise ConfigError(f"task.prompt_template: {path} has no '{{question}}' placeholder; add one where the question "
                          "goes")
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

    def example(self, index: int) -> dict:
        """The item without its prompt's token ids (tokenizing one prompt at a time is the slow part)."""
        return dict(self.examples[index])

    def __getitem__(self, index: int) -> dict:
        return {**self.examples[index], "prompt_token_ids": self.tokenizer.encode(self.examples[index]["prompt"])}


# ----------------------------------------------------------------------------
# answer grading: the one number (or simple expression) in a short answer, read as an exact rational
#
# A model writes "The answer is $\boxed{1\,234}$ dollars." or "x = 18" or "1 1/2 cups". The text is
# normalized (last \boxed{...} only, LaTeX to plain operators, text after the last "="), cut into
# tokens, and must be prose words, then one expression, then prose words. Words that change the
# value ("18 squared", "18 or more", "more than 18") or a second number make it unreadable.

MAX_ANSWER_CHARS = 256  # far above any GSM8K answer; bounds the parser's time
MAX_NESTING_DEPTH = 32  # parentheses, \frac and ^ chains; keeps recursion far from Python's limit
MAX_POWER_BITS = 4096  # refuse 9^9^9-style answers before computing them
MAX_DECIMAL_EXPONENT = 1000  # 1e1000 has ~3,300 bits, within MAX_POWER_BITS

BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
TEXT_COMMAND = re.compile(r"\\(?:text|textrm|textbf|textit|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
MARKDOWN_BOLD = re.compile(r"(?<![\w)])\*\*(?=[^\s*])(.+?)(?<=[^\s*])\*\*(?![\w(])")
LATEX_REPLACEMENTS = (
    ("\\(", ""), ("\\)", ""), ("\\[", ""), ("\\]", ""), ("\\left", ""), ("\\right", ""),
    ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
    ("\\times", "*"), ("\\cdot", "*"), ("\\div", "/"), ("\u00d7", "*"), ("\u00f7", "/"), ("\u2212", "-"),
    ("{,}", ","), ("\\,", " "), ("\\!", ""), ("\\;", " "), ("\\ ", " "), ("~", " "), ("\\qquad", " "),
    ("\\quad", " "), ("\u00a0", " "), ("\u2009", " "), ("\u202f", " "),  # no-break and thin spaces
    ("\\$", ""), ("$", ""), ("\\%", "%"),
)  # fmt: skip
# TeX reads one digit per argument of a brace-less \frac: \frac12 is 1/2 and \frac123 is (1/2)3.
BARE_FRACTION_ARGUMENTS = (
    (re.compile(r"\\frac\s*(\d)\s*(\d)"), r"\\frac{\1}{\2}"),
    (re.compile(r"\\frac\s*(\d)\s*\{"), r"\\frac{\1}{"),
    (re.compile(r"\\frac\s*(\{[^{}]*\})\s*(\d)"), r"\\frac\1{\2}"),
)
STANDALONE_EQUALS = re.compile(r"(?<![<>!=])=(?!=)")  # not part of <=, >=, !=, ==
EXPONENT = r"(?:[eE][-+]?\d+)?"
NUMBER = (  # thousands groups of exactly three, separated by commas or by spaces
    rf"(?:\d{{1,3}}(?:,\d{{3}})+|\d{{1,3}}(?: \d{{3}})+(?!\d)|\d+)(?:\.\d*)?{EXPONENT}|\.\d+{EXPONENT}"
)
PROSE_PUNCTUATION = frozenset(".,:;?#'\"\u2019")  # '#': "#### 18", GSM8K's own answer line
ANSWER_TOKEN = re.compile(
    rf"\s*({NUMBER}|\*\*|[-+*/^(){{}}%]|\\frac|[A-Za-z]+|[{re.escape(''.join(PROSE_PUNCTUATION))}])", re.ASCII
)
INTEGER_LITERAL = re.compile(r"\d[\d, ]*")  # starts with a digit: "," or " " alone is no number
# Words that change the value of the number next to them, or say it is a bound or one of several.
VALUE_WORDS = frozenset(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred hundreds "
    "thousand thousands million millions billion billions trillion trillions dozen dozens half halves "
    "third thirds quarter quarters fourth fourths fifth fifths tenth tenths hundredth hundredths thousandth "
    "thousandths millionth millionths twice double triple thrice grand k m b mn bn lakh lakhs crore crores "
    "squared cubed sqrt root roots power powers factorial pi x or nor not least most minus negative plus".split()
)
BOUND_WORDS = frozenset(  # only before the number: "more than 18" is a bound, "18 more apples" a count
    "more less fewer greater smaller larger bigger higher lower over under above below than exceeding "
    "exceeds beyond within".split()
)


class _Unparseable(Exception):
    pass


def parse_answer(text: str) -> Rational | None:
    """The exact value of an answer, or None when it does not state exactly one value (never raises)."""
    if len(text) > MAX_ANSWER_CHARS:
        return None
    if BOXED.search(text) and (text := _last_boxed(text)) is None:
        return None
    tokens = _tokenize(_normalize(text))
    if not tokens:
        return None
    start = next((i for i, token in enumerate(tokens) if not _is_prose(token)), len(tokens))
    try:
        value, end = _parse_sum(tokens, start, 0)
    except _Unparseable:
        return None
    if _plain_prose(tokens[:start], VALUE_WORDS | BOUND_WORDS) and _plain_prose(tokens[end:], VALUE_WORDS):
        return value
    return None


def answers_match(predicted: str, gold: str) -> bool:
    predicted_value = parse_answer(predicted)
    return predicted_value is not None and predicted_value == parse_answer(gold)


def _last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...}, or None when its brace is never closed."""
    *_, last = BOXED.finditer(text)
    depth = 1
    for index in range(last.end(), len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[last.end() : index]
    return None


def _normalize(text: str) -> str:
    text = MARKDOWN_BOLD.sub(r"\1", TEXT_COMMAND.sub(r" \1 ", text))
    for latex, plain in LATEX_REPLACEMENTS:
        text = text.replace(latex, plain)
    for pattern, braced in BARE_FRACTION_ARGUMENTS:
        text = pattern.sub(braced, text)
    return STANDALONE_EQUALS.split(text)[-1].strip()  # "x = 18", "9 * 2 = 18 dollars": the last right-hand side


def _tokenize(text: str) -> list[str] | None:
    tokens, position = [], 0
    while match := ANSWER_TOKEN.match(text, position):
        tokens.append(match.group(1))
        position = match.end()
    return tokens if text[position:].strip() == "" else None


def _is_prose(token: str) -> bool:
    return token.isalpha() or token in PROSE_PUNCTUATION


def _is_number(token: str) -> bool:
    return token[:1].isdigit() or (token[:1] == "." and len(token) > 1)


def _plain_prose(tokens: list[str], forbidden_words: frozenset[str]) -> bool:
    """Words, punctuation, %, per-unit slashes (km/h) and balanced parentheses; no number, no value-changing word."""
    depth = 0
    for index, token in enumerate(tokens):
        depth += {"(": 1, ")": -1}.get(token, 0)
        neighbours = tokens[index - 1 : index + 2] if index > 0 else []
        unit_slash = token == "/" and len(neighbours) == 3 and neighbours[0].isalpha() and neighbours[2].isalpha()
        if depth < 0 or not (_is_prose(token) or token in "()%" or unit_slash) or token.lower() in forbidden_words:
            return False
    return depth == 0


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
    if _is_number(token):
        value = _number_value(token)
        fraction = _proper_fraction(tokens, position + 1) if INTEGER_LITERAL.fullmatch(token) else None
        return (value + fraction[0], fraction[1]) if fraction else (value, position + 1)  # mixed: 1 1/2
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


def _number_value(token: str) -> Rational:
    mantissa, _, exponent = token.replace(",", "").replace(" ", "").lower().partition("e")
    whole, _, fraction = mantissa.partition(".")
    value = Rational(int(whole + fraction), 10 ** len(fraction))
    if exponent and abs(int(exponent)) > MAX_DECIMAL_EXPONENT:
        raise _Unparseable
    return value * Rational(10) ** int(exponent) if exponent else value


def _proper_fraction(tokens: list[str], position: int) -> tuple[Rational, int] | None:
    """The fraction part of a mixed number at `position` ("1/2" or "\\frac{1}{2}", 0 < value < 1), and its end."""
    shapes = (["#", "/", "#"], ["\\frac", "{", "#", "}", "{", "#", "}"])
    for shape in shapes:
        window = tokens[position : position + len(shape)]
        if len(window) == len(shape) and all(
            INTEGER_LITERAL.fullmatch(token) if expected == "#" else token == expected
            for token, expected in zip(window, shape)
        ):
            numerator, denominator = (int(re.sub("[, ]", "", token)) for token in window if token[0].isdigit())
            end = position + len(shape)
            if 0 < numerator < denominator and _peek(tokens, end) not in ("^", "**"):
                return Rational(numerator, denominator), end
    return None


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
        for row in progress_bar(rows, desc=f"GSM8K {split} -> {out_path}", unit="row"):
            example = make_example(row, template)
            line = {"prompt": example["prompt"], "response": sft_response(example)}
            out_file.write(json.dumps(line, ensure_ascii=False) + "\n")
    return len(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    sft_data = commands.add_parser("sft-data", help="write worked solutions as {prompt, response} JSONL for SFT")
    sft_data.add_argument("--data", required=True, help="GSM8K directory (train.jsonl/test.jsonl or the Hub's "
                          "layout) or Hub id (openai/gsm8k)")
    sft_data.add_argument("--out", required=True, help="output JSONL file")
    sft_data.add_argument("--split", default="train", choices=["train", "test"])
    sft_data.add_argument("--prompt-template", default="reasoning", help="name in prompts/ or a template file")
    args = parser.parse_args(argv)
    try:
        data_dir = hub.local_dir(args.data, repo_type="dataset", files=[GSM8K_HUB_FILES], key="--data")
    except InputError as error:
        exit_on_input_error(error)
    count = write_sft_data(data_dir, args.out, args.split, args.prompt_template)
    print(f"wrote {count} examples to {args.out}")


if __name__ == "__main__":
    log_to_console()
    main()
