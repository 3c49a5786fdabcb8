"""An example of a task of your own: add two numbers. Train on it with

    uv run train.py --config configs/cpu_demo.yaml --config configs/sum_task.yaml

A task is one module with the interface tasks.py documents: load_dataset and reward, plus sft_response for an
SFT warm-up. This one makes its questions from a fixed seed, so it reads no data files (task.data_dir is not
used); the last task.test_size questions are held out for evaluation. Copy it, change the questions and the
reward, and pass your module's import path as task.name.
"""

import random

import torch

from answer_format import extract_answer_text, format_reward
from config import ConfigError, TaskConfig

NUM_QUESTIONS = 4096
QUESTION_SEED = 1234  # fixed: the train/test split must not change with the run's seed
MAX_TERM = 99
SYSTEM_MESSAGE = "You are a helpful assistant. You first think about the reasoning process and then give the answer."
QUESTION = ("What is {a} + {b}? Show your work in <think> </think> tags and give the number alone in "
            "<answer> </answer> tags.")
RESPONSE_PREFILL = "<think>"  # the format reward (answer_format.py) reads the response as if it began here


def questions() -> list[tuple[int, int]]:
    generator = random.Random(QUESTION_SEED)
    return [(generator.randint(1, MAX_TERM), generator.randint(1, MAX_TERM)) for _ in range(NUM_QUESTIONS)]


def load_dataset(config: TaskConfig, tokenizer, split: str) -> "SumDataset":
    if not 1 <= config.test_size < NUM_QUESTIONS:
        raise ConfigError(f"task.test_size: the sum task has {NUM_QUESTIONS} questions; hold out fewer "
                          f"(got {config.test_size})")
    pairs = questions()
    held_out = len(pairs) - config.test_size
    return SumDataset(pairs[:held_out] if split == "train" else pairs[held_out:], tokenizer)


class SumDataset(torch.utils.data.Dataset):
    def __init__(self, pairs: list[tuple[int, int]], tokenizer):
        self.pairs = pairs
        self.tokenizer = tokenizer

    def __len__(self) -> int:
        return len(self.pairs)

    def example(self, index: int) -> dict:
        a, b = self.pairs[index]
        messages = [{"role": "system", "content": SYSTEM_MESSAGE},
                    {"role": "user", "content": QUESTION.format(a=a, b=b)}]
        return {"a": a, "b": b, "prompt": self.tokenizer.render_chat(messages, prefill=RESPONSE_PREFILL)}

    def __getitem__(self, index: int) -> dict:
        item = self.example(index)
        item["prompt_token_ids"] = self.tokenizer.encode(item["prompt"])
        return item


def reward(response: str, item: dict, end_token: str | None = None) -> dict:
    """0.1 for the <think>...</think> <answer>...</answer> format, 1.0 more when the answer is the sum."""
    if end_token:
        response = response.removesuffix(end_token)
    format_score = format_reward(response)
    answer = extract_answer_text(response)
    answer_score = 1.0 if answer is not None and answer.strip() == str(item["a"] + item["b"]) else 0.0
    return {"reward": format_score + answer_score,
            "reward_info": {"format_reward": format_score, "answer_reward": answer_score}}


def sft_response(item: dict) -> str:
    a, b, total = item["a"], item["b"], item["a"] + item["b"]
    return f" {a} plus {b} is {total}. </think>\n<answer> {total} </answer>"
