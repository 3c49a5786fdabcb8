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
from typing import NamedTuple

import torch
from sympy import Rational, integer_nthroot

import hub
from answer_format import THINK_PREFILL, extract_answer_text, format_reward, format_reward_without_prefill
from config import ConfigError, DataError, InputError, TaskConfig, exit_on_input_error
from inputs import GSM8K_DOWNLOAD_HINT, GSM8K_HUB_FILES, gsm8k_files, read_parquet
from run_logging import log_to_console, progress_bar

PROMPTS_DIR = Path(__file__).resolve().parent / "configs" / "prompts"
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
    """A template from configs/prompts/<name>.txt, or from a file path; '{question}' marks where the question goes."""
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


# The SFT warm-up on the worked solutions (the GSM8K design document's; see train.py's warn_no_reward).
SFT_CONFIG = "configs/gsm8k_sft.yaml"


def load_dataset(config: TaskConfig, tokenizer, split: str) -> "GSM8KDataset":
    """The task interface's dataset (tasks.py)."""
    return GSM8KDataset(config.data_dir, tokenizer, split, config.prompt_template)


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
# answer grading: which number in an answer is "the answer", read as an exact rational
#
# Models write a bare number ("18", "$1,234", "\boxed{18}"), a sentence around it ("She makes $18 a
# day."), or a short worked answer whose other numbers justify the final one ("5 crates of 8, so 40",
# "25% of 160 is 40", "40 (8 in each crate)"). parse_answer's docstring is the rule that picks the
# one number (docs/gsm8k_grader.md shows it on each family); the text is cut into tokens and parsed,
# never evaluated.

MAX_ANSWER_CHARS = 2048  # a worked answer of ~500 tokens; the last \boxed{} is found before this limit
MAX_STATEMENT_CHARS = 256  # the clause read as the answer, spaces not counted; bounds the arithmetic
MAX_NESTING_DEPTH = 32  # parentheses, \frac, \sqrt and ^ chains; keeps recursion far from Python's limit
MAX_POWER_BITS = 4096  # refuse 9^9^9-style answers before computing them
MAX_ROOT_DEGREE = 64  # 9^(1/2) and \sqrt[3]{27} are exact; a 65th root is refused unread
MAX_DECIMAL_EXPONENT = 1000  # 1e1000 has ~3,300 bits, within MAX_POWER_BITS

BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
EMPTY_GROUP_AFTER_COMMAND = re.compile(r"(\\[A-Za-z]+)\s*\{\}")  # \texteuro{}40: the group only ends the name
TEXT_COMMAND = re.compile(r"\\(?:text|textrm|textbf|textit|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
# At most 200 characters between the stars: an unclosed "**" costs a bounded scan, not the whole text.
MARKDOWN_BOLD = re.compile(r"(?<![\w)])\*\*(?=[^\s*])(.{1,200}?)(?<=[^\s*])\*\*(?![\w(])")
LATEX_REPLACEMENTS = (
    ("\\\\", " ; "), ("\n", " ; "),  # a line break ends a sentence
    # an arrow concludes, as "so" does (before \right goes, which would leave "arrow")
    ("\\Rightarrow", " so "), ("\\rightarrow", " so "), ("\\implies", " so "), ("\u2192", " so "),
    ("\u21d2", " so "), ("=>", " so "), ("->", " so "),
    ("\\(", ""), ("\\)", ""), ("\\[", ""), ("\\]", ""), ("\\left", ""), ("\\right", ""),
    ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
    ("\\times", "*"), ("\\cdot", "*"), ("\\div", "/"), ("\u00d7", "*"), ("\u00f7", "/"), ("\u2212", "-"),
    ("\u00b2", "^2"), ("\u00b3", "^3"), ("\u221a", "\\sqrt "),
    ("{,}", ","), ("\\,", " "), ("\\!", ""), ("\\;", " "), ("\\ ", " "), ("~", " "), ("\\qquad", " "),
    ("\\quad", " "), ("\u00a0", " "), ("\u2009", " "), ("\u202f", " "),  # no-break and thin spaces
    ("\\$", ""), ("$", ""), ("\\%", "%"),
    # other currencies and degrees are units, as "$" is
    ("^{\\circ}", " "), ("^\\circ", " "), ("\\circ", " "), ("\\degree", " "), ("\\textdegree", " "),
    ("\\texteuro", " "), ("\\euro", " "), ("\\pounds", " "), ("\\textsterling", " "), ("\\yen", " "),
    ("\u20ac", " "), ("\u00a3", " "), ("\u00a5", " "), ("\u20b9", " "), ("\u00a2", " "), ("\u00b0", " "),
)  # fmt: skip
# TeX reads one digit per argument of a brace-less \frac: \frac12 is 1/2 and \frac123 is (1/2)3.
BARE_FRACTION_ARGUMENTS = (
    (re.compile(r"\\frac\s*(\d)\s*(\d)"), r"\\frac{\1}{\2}"),
    (re.compile(r"\\frac\s*(\d)\s*\{"), r"\\frac{\1}{"),
    (re.compile(r"\\frac\s*(\{[^{}]*\})\s*(\d)"), r"\\frac\1{\2}"),
)
SQRT_WORD = re.compile(r"(?<!\\)\bsqrt\s*(?=[({])", re.IGNORECASE)  # sqrt(9) is \sqrt(9)
PRONOUN_IS = re.compile(r"\b(that|this|it|which|what|here)['\u2019]s\b", re.IGNORECASE)  # "that's 40"
EXPONENT = r"(?:[eE][-+]?\d+)?"
NUMBER = (  # thousands groups of exactly three, separated by commas or by spaces; "18." is 18 and a full stop
    rf"(?:\d{{1,3}}(?:,\d{{3}})+|\d{{1,3}}(?: \d{{3}})+(?!\d)|\d+)(?:\.\d+)?{EXPONENT}|\.\d+{EXPONENT}"
)
UNIT_POWER = r"[A-Za-z]+\s*(?:\^|\*\*)\s*(?:[23]|\{\s*[23]\s*\})(?!\.?\d)"  # cm^3, m^{2}: one unit token
UNIT_POWER_TOKEN = re.compile(UNIT_POWER)
SENTENCE_ENDS = frozenset(".;?")
ABBREVIATIONS = frozenset("mr mrs ms dr st jr sr vs etc approx".split())  # their full stop ends no sentence
LABEL_MARK = "#"  # "#### 18", GSM8K's own answer line
PROSE_PUNCTUATION = frozenset(",:'\"\u2019")
# Any other character is a token of its own that nothing reads ("<", "!", "\\" of an unknown command,
# a non-ASCII digit): it makes the clause holding it unreadable and is ignored in working that is dropped.
# Comparisons are one token, so the "=" in "x >= 18" is no equation.
ANSWER_TOKEN = re.compile(  # findall skips whitespace: no alternative starts with it
    rf"{NUMBER}|\*\*|{UNIT_POWER}|\\frac|\\sqrt|[<>!=]=|[-+*/^(){{}}\[\]%=]|[A-Za-z]+|"
    rf"[{re.escape(''.join(PROSE_PUNCTUATION | SENTENCE_ENDS) + LABEL_MARK)}]|\S",
    re.ASCII,
)
UNREADABLE_REMARK = "(?)"  # stands for "(or 42)" or "(fifty)": no rule reads it, so its clause has no value
INTEGER_LITERAL = re.compile(r"\d[\d, ]*")  # starts with a digit: "," or " " alone is no number
EXPRESSION_TOKENS = frozenset(["+", "-", "*", "/", "^", "**", "(", ")", "{", "}", "[", "]", "%", "\\frac", "\\sqrt"])
VALUE_START_TOKENS = frozenset(["(", "{", "-", "+", "\\frac", "\\sqrt"])

# Words that change the value of the number next to them, anywhere in the statement read.
VALUE_WORDS = frozenset(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred hundreds "
    "thousand thousands million millions billion billions trillion trillions dozen dozens half halves "
    "third thirds quarter quarters fourth fourths fifth fifths tenth tenths hundredth hundredths thousandth "
    "thousandths millionth millionths twice double triple thrice grand k m b mn bn lakh lakhs crore crores "
    "squared cubed sqrt root roots power powers factorial pi x minus negative plus".split()
)
# Words that say the number is one of several or a bound: in the statement read or in a parenthetical
# remark ("40 (or 42)") they make the answer unreadable.
HEDGE_WORDS = frozenset("or nor least most maybe perhaps possibly probably either unless otherwise".split())
DENIAL_WORDS = frozenset("not wrong incorrect isn aren wasn weren".split())  # "not 42", "42 is wrong"
BOUND_WORDS = frozenset(  # only before the number: "more than 18" is a bound, "18 more apples" a count
    "more less fewer greater smaller larger bigger higher lower over under above below than exceeding "
    "exceeds beyond within".split()
)
FORBIDDEN_AFTER = VALUE_WORDS | HEDGE_WORDS | DENIAL_WORDS  # in the statement read, after its number
FORBIDDEN_BEFORE = FORBIDDEN_AFTER | BOUND_WORDS
# Cues that conclude: what follows them is the statement of their sentence.
CONCLUSION_WORDS = frozenset("so therefore thus hence consequently".split())
LABEL_WORDS = frozenset(["answer", "answers"])
# Cues that conclude when a value follows them (after FILLER_WORDS): "is 40", "makes a total of 40".
IDENTITY_CUES = frozenset("is are was were be equals equal".split())
RESULT_CUES = frozenset(
    "makes make making gives give giving yields yield leaves leaving totals total totaling totalling comes amounts "
    "results becomes".split()
)
FILLER_WORDS = frozenset(
    "a an the of to in up just only exactly about approximately roughly around now then still altogether overall "
    "all".split()
)
# After a value, these open its justification, up to a conclusion ("so", "answer")...
JUSTIFICATION_WORDS = frozenset("because since given as using".split())
# ...and these a relative clause, also up to a result cue ("8 in each crate, which makes 40").
RELATIVE_WORDS = frozenset("which with where".split())
LEADING_JUSTIFICATION_WORDS = JUSTIFICATION_WORDS | {"with"}  # "With 8 in each crate, she has 40."
CUE_KINDS = {
    **dict.fromkeys(JUSTIFICATION_WORDS, "justification"), **dict.fromkeys(RELATIVE_WORDS, "relative"),
    **dict.fromkeys(IDENTITY_CUES, "identity"), **dict.fromkeys(RESULT_CUES, "result"),
    **dict.fromkeys(CONCLUSION_WORDS, "conclusion"), **dict.fromkeys([*LABEL_WORDS, LABEL_MARK], "label"), "=": "equals",
}
CLAUSE_CUES = frozenset(["conclusion", "label", "equals", "identity", "result"])
# A justification is skipped up to a conclusion; a relative clause also up to a result ("which makes 40", "= 40").
JUSTIFICATION_ENDS = {"justification": {"conclusion", "label"}, "relative": {"conclusion", "label", "equals", "result"}}
NUMBER_NAMES = {
    name: value
    for value, name in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
        "seventeen eighteen nineteen".split()
    )
} | {name: 10 * tens for tens, name in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), 2)}
SCALE_NAMES = {"hundred": 100, "thousand": 10**3, "million": 10**6, "billion": 10**9}
NUMBER_NAME_GLUE = frozenset(NUMBER_NAMES) | frozenset(SCALE_NAMES) | {"-", "and"}


class _Unparseable(Exception):
    pass


class _Sentence(NamedTuple):
    statement: list[str]  # the clause stating the sentence's value; [] when it states none
    labelled: bool  # "answer" or "####"


def parse_answer(text: str) -> Rational | None:
    """The exact value an answer states, or None when it states no single value (never raises).

    Which number is the answer when the text holds several:
    1. Box. Only the last \\boxed{...} is read, if there is one (found by one linear scan, before
       the MAX_ANSWER_CHARS limit applies to what is read).
    2. Remarks. Parentheses with a word or "=" in them are a remark and are dropped: "40 (8 in each
       crate)", "40 (not 42)", "40 (5 * 8 = 40)". A number's name in words beside it is dropped when
       it is its value: "40 (forty)", "forty (40)". A remark that hedges ("40 (or 42)", "(at least)"),
       denies without a number ("42 (wrong)"), misnames ("40 (fifty)") or, read after the number it
       follows by rules 3 and 4, states another value ("42 (no, the answer is 40)", "42 (42 - 2 = 40
       left)") makes the clause holding it unreadable (rule 5), whatever it holds.
    3. Statements. Sentences end at . ; ? and line breaks. In a sentence, the cues "so",
       "therefore", "thus", "hence", "answer", "####", "=", and "is", "are", "equals", "makes",
       "gives", "leaves", "a total of", ... when a value follows them, start a new clause; the
       sentence's statement is its last clause with a number, and what comes before the last cue
       is working: "25% of 160 is 40", "42 - 2 = 40" and "not 42, the answer is 40" all state 40.
       Several numbers after "is" or "=" are the working of a lone number before it: "40 is 25% of
       160" states 40.
       A side of "=" with no number is a name and is dropped: "40 = y". Justifications are dropped:
       after a value, "because", "since", "given", "as", "using" up to the next conclusion (so,
       therefore, answer, ...), and after a single value "which", "with", "where" up to a result
       (makes, gives, leaves, =, ...): "40, which is 8 per crate" is 40, "8 in each crate, which
       makes 40" is 40. A sentence opening with "since", "because", "with", ... is a justification
       up to its first comma.
    4. Sentences. The answer is the statement of the last sentence with "answer" or "####", and
       every later sentence with a number must state the same value. Without such a label, it is
       the statement of the last sentence with a number: a worked answer ends with its result.
    5. Reading. The statement must be prose, one number or expression, prose, at most
       MAX_STATEMENT_CHARS long, with no word that changes the value (twice, squared, million,
       forty), hedges (or, least, maybe) or denies it (not, wrong), and no bound before the number
       (more than, over). Unknown characters (<, !, \\approx) in it make it unreadable.
    """
    if BOXED.search(text) and (text := _last_boxed(text)) is None:
        return None
    if len(text) > MAX_ANSWER_CHARS:
        return None
    try:
        sentences = _sentences(_without_remarks(_tokenize(_normalize(text))))
        return _answer_value([_read_sentence(sentence) for sentence in sentences])
    except _Unparseable:
        return None


def answers_match(predicted: str, gold: str) -> bool:
    predicted_value = parse_answer(predicted)
    return predicted_value is not None and predicted_value == parse_answer(gold)


def _last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...}, or None when its brace is never closed."""
    for last in BOXED.finditer(text):
        pass
    depth = 1
    for index in range(last.end(), len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[last.end() : index]
    return None


def _normalize(text: str) -> str:
    text = EMPTY_GROUP_AFTER_COMMAND.sub(r"\1 ", TEXT_COMMAND.sub(r" \1 ", text))
    text = MARKDOWN_BOLD.sub(r"\1", text)
    for latex, plain in LATEX_REPLACEMENTS:
        text = text.replace(latex, plain)
    for pattern, braced in BARE_FRACTION_ARGUMENTS:
        text = pattern.sub(braced, text)
    return SQRT_WORD.sub(r"\\sqrt", PRONOUN_IS.sub(r"\1 is", text))


def _tokenize(text: str) -> list[str]:
    return ANSWER_TOKEN.findall(text)


def _is_number(token: str) -> bool:
    return token[:1].isdigit() or (token[:1] == "." and len(token) > 1)


def _is_unit_power(token: str) -> bool:
    """cm^3, ft^{2}: a unit, unless its base changes the value (x^2); m^2 is square metres, not millions."""
    if not UNIT_POWER_TOKEN.fullmatch(token):
        return False
    base = re.match("[A-Za-z]+", token).group().lower()
    return base not in VALUE_WORDS or base == "m"


def _is_word(token: str) -> bool:
    return token.isalpha() or _is_unit_power(token)


def _is_prose(token: str) -> bool:
    return _is_word(token) or token in PROSE_PUNCTUATION


def _peek(tokens: list[str], position: int) -> str:
    return tokens[position] if position < len(tokens) else ""


# --- remarks


def _without_remarks(tokens: list[str]) -> list[str]:
    """The tokens without parenthetical remarks (a word or "=" inside: "40 (8 in each crate)") and
    without the name in words of a number written beside it ("forty (40)"). A remark that hedges or
    misnames its number becomes one UNREADABLE_REMARK token."""
    remarks, open_groups = [], []  # open_groups: [index of "(", whether a word is inside]
    for index, token in enumerate(tokens):
        if token == "(":
            open_groups.append([index, False])
        elif token == ")" and open_groups:
            start, has_word = open_groups.pop()
            if has_word:
                remarks.append((start, index))
                if open_groups:
                    open_groups[-1][1] = True
        elif open_groups and (_is_word(token) or token == "="):  # "(8 in each crate)", "(= 5 * 8)"
            open_groups[-1][1] = True
    kept, dropped_until = list(tokens), -1
    for start, end in sorted(remarks):  # an enclosing remark sorts before the ones inside it
        if start > dropped_until:
            kept[start : end + 1] = [None] * (end + 1 - start)
            if not _is_plain_remark(tokens, start, end):
                kept[start] = UNREADABLE_REMARK  # whatever cues it holds: "40 (or so 42 because ...)" is no 42
            dropped_until = end
    return _without_names_before_digits([token for token in kept if token is not None])


def _is_plain_remark(tokens: list[str], start: int, end: int) -> bool:
    """Working beside a value: no hedge ("40 (or 42)"); without a number, no denial ("42 (wrong)") and
    no other number's name ("40 (fifty)"); with numbers, no value of its own but the one it follows
    ("42 (no, the answer is 40)"), read after that number as a sentence ("40 (5 * 8 = 40)" is plain)."""
    inside = tokens[start + 1 : end]
    words = {token.lower() for token in inside}
    if words & HEDGE_WORDS:
        return False
    number = _number_before(tokens, start)
    value = None if number is None else _read_statement(number)
    if not any(map(_is_number, inside)):
        name = _number_name(inside)
        return not words & DENIAL_WORDS and (name is None or name == value)
    # the comma keeps the remark's first number from joining the one before: "-7 (-6 in each crate)"
    return number is None or _remark_value([*number, ",", *inside]) in (None, value)


def _number_before(tokens: list[str], position: int) -> list[str] | None:
    """The number a remark at `position` follows, with its sign, over at most three words ("40 melons (forty)")."""
    for index in range(position - 1, max(position - 5, -1), -1):
        if _is_number(tokens[index]):
            return tokens[index - 1 : index + 1] if index > 0 and tokens[index - 1] == "-" else tokens[index : index + 1]
        if not tokens[index].isalpha():
            return None
    return None


def _remark_value(tokens: list[str]) -> Rational | None:
    """The value a remark states, read after the number it follows; None when it states no single value
    ("40, 8 in each crate")."""
    try:
        return _answer_value([_read_sentence(sentence) for sentence in _sentences(tokens)])
    except _Unparseable:
        return None


def _integer_value(token: str) -> int | None:
    return int(re.sub("[, ]", "", token)) if INTEGER_LITERAL.fullmatch(token) else None


def _number_name(tokens: list[str]) -> int | None:
    """The value of the first number written in words ("forty-two", "one hundred and five"), or None."""
    words = [token.lower() for token in tokens]
    start = next((index for index, word in enumerate(words) if word in NUMBER_NAMES), None)
    if start is None:
        return None
    total = current = 0
    for word in words[start:]:
        if word in NUMBER_NAMES:
            current += NUMBER_NAMES[word]
        elif word == "hundred":
            current *= 100
        elif word in SCALE_NAMES:
            total, current = total + current * SCALE_NAMES[word], 0
        elif word not in NUMBER_NAME_GLUE:
            break
    return total + current


def _without_names_before_digits(tokens: list[str]) -> list[str]:
    kept = []
    for index, token in enumerate(tokens):
        if token == "(" and _is_number(_peek(tokens, index + 1)) and _peek(tokens, index + 2) == ")":
            name_start = len(kept)
            while name_start > 0 and kept[name_start - 1].lower() in NUMBER_NAME_GLUE:
                name_start -= 1
            if _number_name(kept[name_start:]) == _integer_value(tokens[index + 1]) is not None:
                del kept[name_start:]  # "forty (40)"; "fifty (40)" keeps its words, which make it unreadable
        kept.append(token)
    return kept


# --- sentences and their statements


def _sentences(tokens: list[str]) -> list[list[str]]:
    sentences = [[]]
    for index, token in enumerate(tokens):
        if token == "." and index > 0 and tokens[index - 1].lower() in ABBREVIATIONS:
            continue  # "Mr. Benson"
        if token in SENTENCE_ENDS:
            sentences.append([])
        else:
            sentences[-1].append(token)
    return [sentence for sentence in sentences if sentence]


def _read_sentence(tokens: list[str]) -> _Sentence:
    """Cut a sentence into clauses at its cues, without its justifications; its statement is its last
    clause with a number."""
    clauses, runs, openers = [[]], [0], [None]  # each clause's tokens, its values, the cue that opened it
    run_counted, labelled, explaining = False, False, None  # explaining: the kind of justification skipped
    position = _after_leading_justification(tokens)
    while position < len(tokens):
        token = tokens[position]
        position += 1
        kind = CUE_KINDS.get(token.lower())
        if explaining and kind not in JUSTIFICATION_ENDS[explaining]:
            continue  # "40 because 5 crates hold 8", "40, which is 8 per crate"
        if kind == "justification" and runs[-1] >= 1 or kind == "relative" and runs[-1] == 1:
            explaining = kind
            continue
        if kind == "equals":
            if _peek(tokens, position) == "=":
                raise _Unparseable  # "==" compares
            side_end = next((index for index in range(position, len(tokens)) if tokens[index] == "="), len(tokens))
            if not any(map(_is_number, tokens[position:side_end])):
                position = side_end  # "40 = y": a side without a number is a name
                continue
        elif kind in ("identity", "result") and not _value_follows(tokens, position):
            kind = None  # "40 is the answer", "it makes sense"
        if kind in CLAUSE_CUES:
            clauses.append([]), runs.append(0), openers.append(kind)
            run_counted, explaining = False, None
            labelled = labelled or kind == "label"
        elif not explaining:
            clauses[-1].append(token)
            if _is_number(token):
                runs[-1], run_counted = runs[-1] + (not run_counted), True  # "5 * 8" is one value
            elif token not in EXPRESSION_TOKENS:
                run_counted = False  # "5 crates of 8" is two
    stating = [index for index, values in enumerate(runs) if values]
    if not stating:
        return _Sentence([], labelled)
    statement = stating[-1]
    working = runs[statement] > 1 and openers[statement] in ("identity", "equals") and not any(
        token.lower() in HEDGE_WORDS or token.lower() in DENIAL_WORDS for token in clauses[statement]
    )
    if working and len(stating) > 1 and sum(map(_is_number, clauses[stating[-2]])) == 1:
        statement = stating[-2]  # "40 is 25% of 160": what follows "is" is the working of the number before it
    return _Sentence(clauses[statement], labelled)


def _value_follows(tokens: list[str], position: int) -> bool:
    """Whether a value comes at `position`, after filler words: "is 40", "makes a total of 40"."""
    while (token := _peek(tokens, position)).lower() in FILLER_WORDS or token in (",", ":"):
        position += 1
    return _is_number(token) or token in VALUE_START_TOKENS


def _after_leading_justification(tokens: list[str]) -> int:
    """Where a sentence starts once an opening justification is dropped ("Since each crate holds 8, ...")."""
    if tokens[0].lower() not in LEADING_JUSTIFICATION_WORDS:
        return 0
    depth = 0
    for index, token in enumerate(tokens):
        depth += {"(": 1, ")": -1}.get(token, 0)
        if token == "," and depth == 0:
            return index + 1
    return len(tokens)


def _answer_value(sentences: list[_Sentence]) -> Rational:
    stating = [sentence for sentence in sentences if sentence.statement]
    if not stating:
        raise _Unparseable
    labelled = [index for index, sentence in enumerate(stating) if sentence.labelled]
    chosen = (labelled or [len(stating) - 1])[-1]
    value = _read_statement(stating[chosen].statement)
    if any(_read_statement(sentence.statement) != value for sentence in stating[chosen + 1 :]):
        raise _Unparseable  # a later sentence states another value
    return value


def _read_statement(tokens: list[str]) -> Rational:
    """The value of prose, one number or expression, prose."""
    if sum(map(len, tokens)) > MAX_STATEMENT_CHARS:
        raise _Unparseable
    start = next(index for index, token in enumerate(tokens) if not _is_prose(token))
    value, end = _parse_sum(tokens, start, 0)
    if not (_plain_prose(tokens[:start], FORBIDDEN_BEFORE) and _plain_prose(tokens[end:], FORBIDDEN_AFTER)):
        raise _Unparseable
    return value


def _plain_prose(tokens: list[str], forbidden_words: frozenset[str]) -> bool:
    """Words, punctuation, %, per-unit slashes (km/h) and balanced parentheses; no number, no forbidden word."""
    depth = 0
    for index, token in enumerate(tokens):
        depth += {"(": 1, ")": -1}.get(token, 0)
        neighbours = tokens[index - 1 : index + 2] if index > 0 else []
        unit_slash = token == "/" and len(neighbours) == 3 and _is_word(neighbours[0]) and _is_word(neighbours[2])
        if depth < 0 or not (_is_prose(token) or token in "()%" or unit_slash) or token.lower() in forbidden_words:
            return False
    return depth == 0


# --- arithmetic


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
    return _power(base, exponent), position


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
    if token == "\\sqrt":  # \sqrt{9}, \sqrt[3]{27}
        degree, position = Rational(2), position + 1
        if _peek(tokens, position) == "[":
            degree, position = _parse_sum(tokens, position + 1, depth + 1)
            if _peek(tokens, position) != "]" or degree.q != 1 or degree < 1:
                raise _Unparseable
            position += 1
        radicand, position = _parse_atom(tokens, position, depth + 1)
        return _power(radicand, 1 / degree), position
    if token in ("(", "{"):
        value, position = _parse_sum(tokens, position + 1, depth + 1)
        if _peek(tokens, position) != {"(": ")", "{": "}"}[token]:
            raise _Unparseable
        return value, position + 1
    raise _Unparseable


def _power(base: Rational, exponent: Rational) -> Rational:
    """base^exponent when it is rational: 2^3, 9^(1/2), 8^(2/3); sizes are bounded before computing."""
    if exponent.q > MAX_ROOT_DEGREE or (base == 0 and exponent < 0):
        raise _Unparseable  # 0^-1 is undefined
    root = _exact_root(base, int(exponent.q))
    if max(abs(root.p).bit_length(), root.q.bit_length()) * abs(exponent.p) > MAX_POWER_BITS:
        raise _Unparseable
    return root ** int(exponent.p)


def _exact_root(value: Rational, degree: int) -> Rational:
    if degree == 1:
        return value
    if value < 0 and degree % 2 == 0:
        raise _Unparseable  # not a real number
    numerator, numerator_exact = integer_nthroot(abs(int(value.p)), degree)
    denominator, denominator_exact = integer_nthroot(int(value.q), degree)
    if not (numerator_exact and denominator_exact):
        raise _Unparseable  # irrational: 2^(1/2)
    return (-1 if value < 0 else 1) * Rational(numerator, denominator)


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
            numerator, denominator = (_integer_value(token) for token in window if token[0].isdigit())
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


def grade(
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


def reward(response: str, item: dict, end_token: str | None = None) -> dict:
    """The task interface's reward (tasks.py): of a response to a dataset item."""
    return grade(response, item["answer"], end_token, item["prompt_ends_with_think"])


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
    sft_data.add_argument("--prompt-template", default="reasoning", help="name in configs/prompts/ or a template file")
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
