"""The answer format both tasks reward: "<think> reasoning </think> <answer> final answer </answer>".

CountDown's prompt ends inside <think> (the response prefill), so its responses start in the think block;
a GSM8K prompt template may end there too, or leave the model to open <think> itself.
"""

import string

FORMAT_REWARD = 0.1
FORMAT_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
THINK_PREFILL = "<think>"
# ASCII only: str.isspace() and \s would also accept Unicode spaces.
WHITESPACE = string.whitespace


def format_reward(response: str) -> float:
    """FORMAT_REWARD when "<think>" + response is <think>...</think> <answer>...</answer> with
    each tag exactly once, only ASCII whitespace between </think> and <answer> and after </answer>."""
    text = THINK_PREFILL + response
    if any(text.count(tag) != 1 for tag in FORMAT_TAGS):
        return 0.0
    think_end, answer_start, answer_end = (text.index(tag) for tag in FORMAT_TAGS[1:])
    if not think_end < answer_start < answer_end:
        return 0.0
    between = text[think_end + len("</think>") : answer_start]
    after = text[answer_end + len("</answer>") :]
    return FORMAT_REWARD if not between.strip(WHITESPACE) and not after.strip(WHITESPACE) else 0.0


def format_reward_without_prefill(text: str) -> float:
    """The format rule for a whole text that must open its own <think>."""
    before_think, think, after_think = text.partition(THINK_PREFILL)
    if not think or any(tag in before_think for tag in FORMAT_TAGS):
        return 0.0  # a tag before the first <think> is out of order or repeated
    return format_reward(after_think)


def extract_answer_text(response: str) -> str | None:
    """The text inside the response's only <answer>...</answer> pair, or None when there is no single pair."""
    if response.count("<answer>") != 1 or response.count("</answer>") != 1:
        return None
    start, end = response.index("<answer>") + len("<answer>"), response.index("</answer>")
    return response[start:end] if start <= end else None
