"""A task of your own, named by its import path (task.name=examples.sum_task): its reward, and GRPO, SFT and
evaluate.py running it through the same entry points as the built-in tasks."""

import json

import pytest
import torch

import config as config_lib
import evaluate
import train
import train_sft
from examples import sum_task
from qwen2_model import Transformer
from test_train import read_scalars, tiny_config
from test_train_sft import sft_config

TASK = "task.name=examples.sum_task"


@pytest.mark.parametrize("response, end_token, expected", [
    (" 3 plus 4 is 7. </think>\n<answer> 7 </answer>", None, (0.1, 1.0)),
    (" 3 plus 4 is 7. </think>\n<answer> 7 </answer><|im_end|>", "<|im_end|>", (0.1, 1.0)),
    (" three and four </think> <answer>8</answer>", None, (0.1, 0.0)),
    (" 7 <answer> 7 </answer>", None, (0.0, 1.0)),  # no </think>: the sum is right, the format is not
    (" </think> <answer> 7 = 3 + 4 </answer>", None, (0.1, 0.0)),  # the number alone, as the prompt asks
    (" </think> <answer> 7 </answer> <answer> 7 </answer>", None, (0.0, 0.0)),
])
def test_reward_is_format_plus_the_right_sum(response, end_token, expected):
    scored = sum_task.reward(response, {"a": 3, "b": 4}, end_token)
    assert (scored["reward_info"]["format_reward"], scored["reward_info"]["answer_reward"]) == expected
    assert scored["reward"] == pytest.approx(sum(expected))


def test_held_out_questions_are_the_last_ones_and_prompts_end_in_think(tiny_model_dir):
    from tokenizer import Tokenizer
    task = config_lib.build(config_lib.TaskConfig, {"name": "examples.sum_task", "test_size": 5})
    tokenizer = Tokenizer(tiny_model_dir)
    train_set, test_set = (sum_task.load_dataset(task, tokenizer, split) for split in ("train", "test"))
    assert (len(train_set), len(test_set)) == (sum_task.NUM_QUESTIONS - 5, 5)
    last = test_set[4]
    assert (last["a"], last["b"]) == sum_task.questions()[-1]
    assert last["prompt"].endswith("<think>") and f"What is {last['a']} + {last['b']}?" in last["prompt"]
    assert last["prompt_token_ids"] == tokenizer.encode(last["prompt"])


@pytest.fixture
def scored_items(monkeypatch):
    """The module's own reward, plus the share of digits in the response: a tiny random model's answers
    then differ within a group, so every step updates."""
    items, real_reward = [], sum_task.reward

    def reward(response, item, end_token):
        items.append(item)
        scored = real_reward(response, item, end_token)
        digits = sum(character.isdigit() for character in response) / max(len(response), 1)
        return {**scored, "reward": scored["reward"] + digits}

    monkeypatch.setattr(sum_task, "reward", reward)
    return items


def test_grpo_trains_a_task_module_named_by_its_import_path(tmp_path, tiny_model_dir, scored_items):
    train.train(tiny_config(tmp_path, tiny_model_dir, tmp_path / "unused", TASK))
    scalars = read_scalars(tmp_path / "logs" / "tiny")
    assert [step for step, _ in scalars["reward/mean"]] == [1, 2, 3]
    assert [step for step, _ in scalars["eval/success_rate"]] == [0, 2]
    assert len(scored_items) == 3 * 6 + 2 * 4  # three steps of 6 answers, two evaluations of 4 questions
    assert all(set(item) >= {"a", "b", "prompt"} for item in scored_items)
    trained = Transformer.from_pretrained(tmp_path / "checkpoints" / "tiny" / "step_000003", dtype=torch.float32)
    initial = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokens = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        assert (trained(tokens) - initial(tokens)).abs().max() > 1e-4


def test_sft_learns_the_module_responses_and_evaluate_scores_them(tmp_path, tiny_model_dir):
    config = sft_config(tmp_path, tiny_model_dir, tmp_path / "unused", TASK, "optim.num_steps=2", "eval.interval=0")
    result = train_sft.train_sft(config)
    assert result["steps"] == 2
    out = tmp_path / "samples.jsonl"
    evaluate.main(["--model", config.output_dir, "--task", "examples.sum_task", "--set", "task.test_size=3",
                   "--max-questions", "3", "--set", "eval.max_gen_len=6", "--out", str(out)])
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(samples) == 3 and all("What is" in sample["prompt"] for sample in samples)


def test_the_example_config_warms_up_on_the_module_own_responses():
    config = config_lib.load(train.TrainConfig, ["configs/cpu_demo.yaml", "configs/sum_task.yaml"])
    assert (config.task.name, config.model.dir) == ("examples.sum_task", config.bootstrap.model_dir)
    warm_up = config_lib.warm_up_config(config.bootstrap, config.task, config.model.dir)
    assert (warm_up.task, warm_up.data.response, warm_up.output_dir) == (config.task, "solution", config.model.dir)
