"""The tasks train.py, train_sft.py and evaluate.py can run, behind one small interface.

A task gives a dataset whose items carry `prompt` and `prompt_token_ids`, and a reward function
`reward_for_item(response, item, end_token) -> {"reward", "reward_info": {"format_reward", "answer_reward"}}`.
"""

from pathlib import Path

import torch

import config as config_lib
import countdown_task
import gsm8k_task
from config import TaskConfig
from inputs import countdown_data_hint


def load_dataset(config: TaskConfig, tokenizer, split: str) -> torch.utils.data.Dataset:
    if config.name == "countdown":
        dataset = countdown_task.CountdownDataset(config.data_dir, tokenizer, split, config.test_size,
                                                  config.question_last)
    else:
        dataset = gsm8k_task.GSM8KDataset(config.data_dir, tokenizer, split, config.prompt_template)
    if len(dataset) == 0:
        raise config_lib.DataError(f"{config.data_dir}: the {config.name} {split} split is empty")
    return dataset


def reward_function(config: TaskConfig):
    return countdown_task.reward_for_item if config.name == "countdown" else gsm8k_task.reward_for_item


def is_success(reward_info: dict[str, float]) -> bool:
    """A correct final answer, whatever the format."""
    return reward_info["answer_reward"] > 0


def is_well_formatted(reward_info: dict[str, float]) -> bool:
    return reward_info["format_reward"] > 0


def sft_pairs(config: TaskConfig, tokenizer) -> list[dict[str, str]]:
    """{"prompt", "response"} pairs from the task's training split and its reference solutions (as text:
    train_sft tokenizes them all at once)."""
    task_module = countdown_task if config.name == "countdown" else gsm8k_task
    dataset = load_dataset(config, tokenizer, "train")
    if "solution" not in dataset.example(0):  # CountDown data from the Hub, or generated without --with-solutions
        raise config_lib.DataError(f"task.data_dir: {config.data_dir} holds no reference solutions (no `solution` "
                                   f"column). {countdown_data_hint(Path(config.data_dir), with_solutions=True)}")
    items = map(dataset.example, range(len(dataset)))
    return [{"prompt": item["prompt"], "response": task_module.sft_response(item)} for item in items]
