"""The tasks train.py, train_sft.py and evaluate.py can run, looked up by task.name: countdown, gsm8k, or
the import path of a module of your own (task.name=my_tasks.sudoku; examples/sum_task.py is one).

Every task module exposes the same small interface:
    load_dataset(config: TaskConfig, tokenizer, split) -> a dataset whose items carry `prompt` (the rendered
        prompt) and `prompt_token_ids`, and whose `example(index)` is the item without the token ids
    reward(response, item, end_token) -> {"reward", "reward_info": {"format_reward", "answer_reward"}}
and may expose
    sft_response(item) -> the reference response SFT learns for an item (train_sft.py needs it)
    SFT_CONFIG: the train_sft.py config of the task's warm-up (named when GRPO finds no reward to learn from)
    sft_search_response(item) -> a reference response that searches (SFT's data.response: search)
    sft_full_search_response(item, max_tries) -> one that writes its whole search, or None (full_search)
    shortcut_baseline(train_set) -> an object whose report(samples) gives the metrics that a trivial policy
        scores beside the model's (CountDown: the best fixed answer forms, countdown_forms.py)
Success and format are read from reward_info the same way for every task (is_success, is_well_formatted).
"""

import functools
import importlib
from pathlib import Path
from types import ModuleType

import torch

import config as config_lib
import countdown_task
import gsm8k_task
from config import SFTDataConfig, TaskConfig
from inputs import countdown_data_hint

TASKS: dict[str, ModuleType] = {"countdown": countdown_task, "gsm8k": gsm8k_task}


def get(config: TaskConfig) -> ModuleType:
    """The module of task.name: a built-in task's, or the module of that import path (config.py checked its
    interface)."""
    return TASKS.get(config.name) or importlib.import_module(config.name)


def sft_config_of(config: TaskConfig) -> str | None:
    return getattr(get(config), "SFT_CONFIG", None)


def load_dataset(config: TaskConfig, tokenizer, split: str) -> torch.utils.data.Dataset:
    dataset = get(config).load_dataset(config, tokenizer, split)
    if len(dataset) == 0:
        raise config_lib.DataError(f"{config.data_dir}: the {config.name} {split} split is empty")
    return dataset


def is_success(reward_info: dict[str, float]) -> bool:
    """A correct final answer, whatever the format."""
    return reward_info["answer_reward"] > 0


def is_well_formatted(reward_info: dict[str, float]) -> bool:
    return reward_info["format_reward"] > 0


def sft_pairs(config: TaskConfig, tokenizer, data: SFTDataConfig | None = None) -> list[dict[str, str | None]]:
    """{"prompt", "response"} pairs from the task's training split and its reference responses (as text:
    train_sft tokenizes them all at once), one per row in order: its solutions, or (data.response "search" or
    "full_search", CountDown) the search traces its exact solver writes, which need no solution column. A
    full search's response is None where the search needs more than data.search_max_tries tries; a search
    within data.search_max_tokens is measured in this tokenizer's tokens."""
    response = data.response if data else "solution"
    dataset = load_dataset(config, tokenizer, "train")
    if response == "solution" and config.name == "countdown" and "solution" not in dataset.example(0):
        raise config_lib.DataError(f"task.data_dir: {config.data_dir} holds no reference solutions (no `solution` "
                                   f"column). {countdown_data_hint(Path(config.data_dir), with_solutions=True)}")
    module = get(config)
    if response == "full_search":
        write = functools.partial(module.sft_full_search_response, max_tries=data.search_max_tries)
    elif response == "search" and data.search_max_tokens:
        def fits(text: str) -> bool:
            return len(tokenizer.encode(text)) + 1 <= data.search_max_tokens  # + the end token
        write = functools.partial(module.sft_search_response, fits=fits)
    else:
        write = getattr(module, "sft_search_response" if response == "search" else "sft_response", None)
    if write is None:  # a module of yours, warmed up by bootstrap (train_sft.py's own config check says it first)
        raise config_lib.ConfigError(f"task.name: the task {config.name} has no sft_response(item), so SFT has no "
                                     "reference responses to learn: add one, or give pairs in data.train_jsonl")
    items = map(dataset.example, range(len(dataset)))
    return [{"prompt": item["prompt"], "response": write(item)} for item in items]


def shortcut_baseline(config: TaskConfig, train_set):
    """The task's shortcut baseline, fitted on its training split, or None if the task has none."""
    fit = getattr(get(config), "shortcut_baseline", None)
    return fit and fit(train_set)
