"""train_sft.py: the masked NLL against a hand computation, and short runs on the tiny fixture."""

import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM, AutoTokenizer

import checkpoint
import config as config_lib
import countdown_task
import tasks
import train_sft
from qwen2_model import Transformer
from tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def countdown_with_solutions(tmp_path_factory):
    out = tmp_path_factory.mktemp("countdown-sft")
    countdown_task.main(["generate", "--out", str(out), "--size", "80", "--seed", "1", "--max-number", "20",
                         "--with-solutions"])
    return out


def sft_config(tmp_path, model_dir, data_dir, *overrides) -> train_sft.SFTConfig:
    values = {
        "output_dir": str(tmp_path / "sft-out"), "run_name": "sft", "device": "cpu", "progress": False,
        "model": {"dir": str(model_dir), "dtype": "float32", "gradient_checkpointing": False},
        "task": {"data_dir": str(data_dir), "test_size": 8},
        "data": {"eval_size": 16},
        "optim": {"num_steps": 12, "batch_size": 8, "micro_batch_size": 4, "learning_rate": 3e-3},
        "eval": {"interval": 12, "max_questions": 4, "max_gen_len": 24},
        "logging": {"log_dir": str(tmp_path / "logs")},
        "checkpoint": {"dir": str(tmp_path / "checkpoints")},
    }
    for assignment in overrides:
        config_lib.apply_override(values, assignment)
    return config_lib.build(train_sft.SFTConfig, values)


def test_response_nll_counts_only_response_tokens(tiny_model_dir):
    model = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32)
    examples = [([5, 6, 7, 8, 9], 2), ([10, 11, 12], 1)]  # (ids, prompt length)
    nll, count = train_sft.response_nll(model, examples, pad_token_id=0, chunk_size=2)
    expected = 0.0
    for ids, prompt_length in examples:
        log_probs = torch.log_softmax(model(torch.tensor([ids]))[0], dim=-1)
        expected -= sum(log_probs[t - 1, ids[t]].item() for t in range(prompt_length, len(ids)))
    assert count == 3 + 2
    assert nll.item() == pytest.approx(expected, rel=1e-5)


def test_countdown_sft_lowers_held_out_loss_and_saves_a_hub_model(tmp_path, tiny_model_dir, countdown_with_solutions):
    metrics = train_sft.train_sft(sft_config(tmp_path, tiny_model_dir, countdown_with_solutions))
    events = EventAccumulator(str(tmp_path / "logs" / "sft")).Reload()
    held_out_loss = {event.step: event.value for event in events.Scalars("eval/loss")}
    assert held_out_loss[12] < held_out_loss[0] - 0.5
    assert {"eval/success_rate", "eval/format_rate"} <= metrics.keys()
    saved = tmp_path / "sft-out"
    tokens = torch.randint(0, 400, (2, 9), generator=torch.Generator().manual_seed(0))
    ours = Transformer.from_pretrained(saved, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max() <= 1e-4
    assert Tokenizer(saved).eos_token == "<|im_end|>" and (saved / "config.yaml").is_file()


def test_jsonl_pairs_are_read(tmp_path, tiny_model_dir, countdown_with_solutions):
    pairs = [{"prompt": f"Q{i}: 2 + {i} =", "response": f" {2 + i}"} for i in range(30)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    config = sft_config(tmp_path, tiny_model_dir, countdown_with_solutions, f"data.train_jsonl={tmp_path / 'pairs.jsonl'}",
                        "eval.max_questions=0", "optim.num_steps=2")
    tokenizer = Tokenizer(tiny_model_dir)
    train_examples, eval_examples = train_sft.load_examples(config, tokenizer)
    assert (len(train_examples), len(eval_examples)) == (14, 16)
    ids, prompt_length = eval_examples[0]
    assert tokenizer.decode(ids[prompt_length:]) == " 16<|im_end|>"
    assert "eval/loss" in train_sft.train_sft(config)


def test_bad_inputs_are_explained(tmp_path, tiny_model_dir, countdown_with_solutions):
    (tmp_path / "bad.jsonl").write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match='"prompt" and "response"'):
        train_sft.read_pairs(tmp_path / "bad.jsonl")
    with pytest.raises(config_lib.ConfigError, match=r"optim.batch_size \(8\) must be divisible by optim.micro_batch_size \(3\)"):
        sft_config(tmp_path, tiny_model_dir, countdown_with_solutions, "optim.micro_batch_size=3")
    no_solutions = tmp_path / "plain"
    countdown_task.main(["generate", "--out", str(no_solutions), "--size", "30", "--max-number", "20"])
    with pytest.raises(ValueError, match="--with-solutions"):
        train_sft.train_sft(sft_config(tmp_path, tiny_model_dir, no_solutions))


def test_success_is_scored_on_held_out_training_questions_not_the_test_split(tmp_path, tiny_model_dir,
                                                                             countdown_with_solutions):
    config = sft_config(tmp_path, tiny_model_dir, countdown_with_solutions)
    tokenizer = Tokenizer(tiny_model_dir)
    eval_set = train_sft.task_eval_set(config, tokenizer)
    _, eval_examples = train_sft.load_examples(config, tokenizer)
    # The questions of the 16 held-out pairs, in order: never trained on by SFT.
    assert [eval_set[i]["prompt"] for i in range(len(eval_set))] == [
        tokenizer.decode(ids[:prompt_length]) for ids, prompt_length in eval_examples]
    test_set = countdown_task.CountdownDataset(countdown_with_solutions, tokenizer, "test", test_size=8)
    test_questions = {countdown_task.task_key(test_set[i]["nums"], test_set[i]["target"]) for i in range(len(test_set))}
    assert not test_questions & {countdown_task.task_key(eval_set[i]["nums"], eval_set[i]["target"])
                                 for i in range(len(eval_set))}
    # Pairs from a JSONL file have no task questions of their own: the test split, as before.
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "1 + 1 =", "response": " 2"}\n' * 20)
    with_jsonl = sft_config(tmp_path, tiny_model_dir, countdown_with_solutions, f"data.train_jsonl={tmp_path / 'pairs.jsonl'}")
    assert [item["prompt"] for item in train_sft.task_eval_set(with_jsonl, tokenizer)] == [
        test_set[i]["prompt"] for i in range(8)]


def test_full_search_leaves_out_unsolved_questions_after_holding_out_by_row(tmp_path, tiny_model_dir,
                                                                          countdown_with_solutions):
    config = sft_config(tmp_path, tiny_model_dir, countdown_with_solutions, "data.response=full_search",
                        "data.search_max_tries=1")
    tokenizer = Tokenizer(tiny_model_dir)
    train_set = tasks.load_dataset(config.task, tokenizer, "train")
    solved = [countdown_task.sft_full_search_response(train_set.example(i), 1) is not None
              for i in range(len(train_set))]
    assert 0 < sum(solved) < len(solved)
    train_examples, eval_examples = train_sft.load_examples(config, tokenizer)
    prompts = [train_set.example(i)["prompt"] for i in range(len(train_set))]
    held_out = len(prompts) - 16  # the last 16 rows, task_eval_set's questions, whether solved or not
    assert [tokenizer.decode(ids[:length]) for ids, length in eval_examples] == [
        prompt for prompt, ok in zip(prompts[held_out:], solved[held_out:]) if ok]
    assert [tokenizer.decode(ids[:length]) for ids, length in train_examples] == [
        prompt for prompt, ok in zip(prompts[:held_out], solved[:held_out]) if ok]
    with pytest.raises(config_lib.ConfigError, match=r"^data.search_max_tries: the search solves none of these "
                       r"questions within that many tries: raise it, got 1$"):
        train_sft.with_responses([{"prompt": "p", "response": None}], config)


def test_search_within_a_token_budget_writes_as_many_dead_ends_as_fit(tmp_path, tiny_model_dir,
                                                                     countdown_with_solutions):
    budget = 110  # this tokenizer: ~31 tokens a 3-number try; 0 to 2 dead ends fit
    config = sft_config(tmp_path, tiny_model_dir, countdown_with_solutions, "data.response=search",
                        f"data.search_max_tokens={budget}")
    tokenizer = Tokenizer(tiny_model_dir)
    train_set = tasks.load_dataset(config.task, tokenizer, "train")
    pairs = tasks.sft_pairs(config.task, tokenizer, config.data)
    dead_end_counts = Counter()
    for index, pair in enumerate(pairs):
        item = train_set.example(index)
        target, tries = item["target"], countdown_task.search_tries(item["nums"], item["target"])
        written = pair["response"].split(" </think>")[0].strip().split("; ")
        dead_ends = len(written) - 1
        assert [attempt.endswith(f"(not {target})") for attempt in written] == [True] * dead_ends + [False]
        tokens = len(tokenizer.encode(pair["response"])) + 1  # + the end token, as generation counts it
        assert tokens <= budget or dead_ends == 0
        if dead_ends < len(tries) - 1:  # one more of the search's dead ends would not have fitted
            longer = countdown_task.sft_search_response(item, max_dead_ends=dead_ends + 1)
            assert len(tokenizer.encode(longer)) + 1 > budget
        dead_end_counts[min(dead_ends, 3)] += 1
    assert len(dead_end_counts) >= 3  # the budget, not a fixed count, decides


@pytest.mark.parametrize("stop_at_success, expected_steps", [(0.5, 4), (None, 12)])
def test_stop_at_success_ends_at_the_first_evaluation_that_reaches_it(stop_at_success, expected_steps, tmp_path,
                                                                      tiny_model_dir, countdown_with_solutions,
                                                                      monkeypatch):
    scripted = iter([0.0, 0.2, 0.6, 0.3, 0.7, 0.8, 0.9])  # success at steps 0, 2, 4, ...: the tiny model has none
    real_run_evaluation, datasets = train_sft.run_evaluation, []

    def run_evaluation(model, tokenizer, dataset, *args, **kwargs):
        datasets.append(dataset)
        return {**real_run_evaluation(model, tokenizer, dataset, *args, **kwargs), "success_rate": next(scripted)}

    monkeypatch.setattr(train_sft, "run_evaluation", run_evaluation)
    config = sft_config(tmp_path, tiny_model_dir, countdown_with_solutions, "eval.interval=2",
                        f"optim.stop_at_success={'null' if stop_at_success is None else stop_at_success}")
    metrics = train_sft.train_sft(config)
    assert metrics["steps"] == expected_steps
    assert len(datasets) == 1 + expected_steps // 2
    assert all(isinstance(dataset, torch.utils.data.Subset) for dataset in datasets)
    events = EventAccumulator(str(tmp_path / "logs" / "sft")).Reload()
    assert [event.step for event in events.Scalars("train/loss")] == list(range(1, expected_steps + 1))
    assert (tmp_path / "sft-out" / "model.safetensors").is_file()  # saved where it stopped


def test_pairs_are_tokenized_in_batches_to_the_same_tokens_as_one_at_a_time(tiny_model_dir, countdown_with_solutions):
    tokenizer = Tokenizer(tiny_model_dir)
    task = config_lib.build(config_lib.TaskConfig, {"data_dir": str(countdown_with_solutions), "test_size": 8})
    pairs = tasks.sft_pairs(task, tokenizer)
    dataset = tasks.load_dataset(task, tokenizer, "train")
    assert [pair["prompt"] for pair in pairs] == [dataset[i]["prompt"] for i in range(len(dataset))]
    pairs.append({"prompt": "Ünïcode 12+34 =", "response": " 46\n\n  spaces\t<think>"})
    examples = train_sft.tokenize_pairs(pairs, tokenizer, max_seq_len=10_000)
    # The reference: transformers' own tokenizer of the model directory, one text at a time.
    reference = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = [(reference.encode(pair["prompt"], add_special_tokens=False), reference.encode(
        pair["response"], add_special_tokens=False) + [reference.eos_token_id]) for pair in pairs]
    assert examples == [(prompt + response, len(prompt)) for prompt, response in expected]


def test_checkpoint_then_resume_equals_an_uninterrupted_run(tmp_path, tiny_model_dir, countdown_with_solutions):
    """Steps 1-3, a checkpoint, then --resume for steps 4-6: bitwise the weights of 6 steps in one go (CPU, float32)."""
    overrides = ["optim.num_steps=6", "eval.interval=2", "checkpoint.interval=3", "optim.warmup_steps=2"]
    whole = train_sft.train_sft(sft_config(tmp_path, tiny_model_dir, countdown_with_solutions, *overrides))
    run = tmp_path / "checkpoints" / "sft"
    # The last step went to output_dir.
    assert sorted(path.name for path in run.iterdir()) == ["config.yaml", "finished", "step_000003"]
    resumed = train_sft.train_sft(sft_config(tmp_path, tiny_model_dir, countdown_with_solutions, *overrides,
                                             f"output_dir={tmp_path / 'resumed'}"), resume=str(run / "step_000003"))
    assert resumed == whole
    one_go = Transformer.from_pretrained(tmp_path / "sft-out", dtype=torch.float32)
    in_two = Transformer.from_pretrained(tmp_path / "resumed", dtype=torch.float32)
    for (name, a), b in zip(one_go.named_parameters(), in_two.parameters()):
        assert torch.equal(a, b), name
    started_from = Transformer.from_pretrained(run / "step_000003", dtype=torch.float32)
    assert not torch.equal(started_from.embed_tokens.weight, in_two.embed_tokens.weight)


def test_output_dir_may_not_hold_the_run_directory(tmp_path, tiny_model_dir, countdown_with_solutions):
    config = sft_config(tmp_path, tiny_model_dir, countdown_with_solutions, f"output_dir={tmp_path / 'checkpoints'}")
    with pytest.raises(config_lib.ConfigError, match="output_dir: must not hold the run's checkpoint directory"):
        train_sft.train_sft(config)
    assert sorted(path.name for path in tmp_path.iterdir()) == []


@pytest.mark.slow
def test_sigterm_ends_the_step_saves_and_resumes(tmp_path, tiny_model_dir, countdown_with_solutions):
    """A real SIGTERM to a running train_sft.py: one line, exit 143, a resumable checkpoint; --resume finishes it."""
    config_path = tmp_path / "sft.yaml"
    config_lib.dump(sft_config(tmp_path, tiny_model_dir, countdown_with_solutions, "optim.num_steps=100000",
                               "eval.interval=0", "checkpoint.interval=1", "checkpoint.optimizer_state=false",
                               "checkpoint.keep_last=1", "cpu_threads=1"), config_path)
    run = tmp_path / "checkpoints" / "sft"
    with open(tmp_path / "stderr.txt", "w") as log:
        process = subprocess.Popen([sys.executable, str(REPO_ROOT / "train_sft.py"), "--config", str(config_path)],
                                   cwd=REPO_ROOT, stderr=log)
        try:
            deadline = time.monotonic() + 240
            while not list(run.glob("step_*")) and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)  # a step's checkpoint: the training loop, where a signal is caught, has begun
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
        finally:
            process.kill()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert process.returncode == 143, stderr
    assert "Traceback" not in stderr
    last_line = stderr.strip().splitlines()[-1]
    match = re.fullmatch(rf"stopped by SIGTERM after step (\d+), saved in {run}/step_(\d+); "
                         rf"continue with: uv run train_sft.py --resume {run}", last_line)
    assert match and int(match[1]) == int(match[2]) >= 1, last_line
    step = int(match[1])
    # The stop's checkpoint is resumable even with optimizer_state: false; the periodic ones were weights only.
    assert (run / f"step_{step:06d}" / checkpoint.TRAINER_STATE).is_file()
    train_sft.main(["--resume", str(run), "--set", f"optim.num_steps={step + 2}"])  # its config.yaml, 2 more steps
    events = EventAccumulator(str(tmp_path / "logs" / "sft")).Reload()
    assert [event.step for event in events.Scalars("train/loss")][-2:] == [step + 1, step + 2]
    assert (tmp_path / "sft-out" / "model.safetensors").is_file()


def test_a_section_given_in_part_keeps_the_sft_defaults_and_checkpoint_keys_are_checked():
    config = config_lib.build(train_sft.SFTConfig, {"eval": {"interval": 5}, "checkpoint": {"keep_last": 1}})
    assert (config.eval.interval, config.eval.max_questions, config.eval.max_gen_len) == (5, 200, 256)
    assert (config.checkpoint.interval, config.checkpoint.keep_last) == (100, 1)
    for override, message in [("checkpoint.interval=-1", "checkpoint.interval: must be >= 0, got -1"),
                              ("checkpoint.keep_last=0", "checkpoint.keep_last: must be >= 1, got 0")]:
        with pytest.raises(config_lib.ConfigError, match=message):
            config_lib.load(train_sft.SFTConfig, None, [override])


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_every_task_points_to_a_warm_up_config_for_itself(name):
    """train.py's no-reward warning tells users to run this config: it must exist and train the same task."""
    sft = config_lib.load(train_sft.SFTConfig, REPO_ROOT / tasks.TASKS[name].SFT_CONFIG)
    assert sft.task.name == name
