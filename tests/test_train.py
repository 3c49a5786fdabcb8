"""train.py end to end on the tiny fixture: logs, checkpoints, resume, and config errors."""

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM

import config as config_lib
from config import DataError
import countdown_task
import train
from qwen2_model import Transformer
from tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]

EXPECTED_SCALARS = [
    "train/loss", "reward/mean", "reward/std", "reward/format", "train/success_rate", "eval/success_rate",
    "eval/format_rate", "train/grad_norm", "train/entropy", "train/learning_rate", "response_length/mean",
    "response_length/min", "response_length/max", "train/finished_episodes", "train/zero_spread_group_fraction",
    "time/rollout_seconds", "train/update_seconds", "time/generated_tokens_per_second", "train/update_skipped",
]


@pytest.fixture(scope="module")
def countdown_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("countdown")
    countdown_task.main(["generate", "--out", str(out), "--size", "60", "--seed", "0", "--max-number", "20"])
    return out


@pytest.fixture
def digit_reward(monkeypatch):
    """A random tiny model never solves CountDown (all rewards 0, so no gradient); reward digits instead."""

    def reward(response, item, end_token):
        digits = sum(character.isdigit() for character in response) / max(len(response), 1)
        return {"reward": digits, "reward_info": {"format_reward": 0.0, "answer_reward": float(digits > 0.3)}}

    monkeypatch.setattr(countdown_task, "reward", reward)


def tiny_config(tmp_path, model_dir, data_dir, *overrides) -> train.TrainConfig:
    values = {
        "run_name": "tiny", "device": "cpu", "progress": False,
        "model": {"dir": str(model_dir), "dtype": "float32", "gradient_checkpointing": False},
        "task": {"data_dir": str(data_dir), "test_size": 4},
        "rollout": {"episodes_per_step": 6, "num_answers_per_question": 3, "max_gen_len": 12},
        "optim": {"num_steps": 3, "learning_rate": 1e-3, "micro_batch_size": 4},
        "eval": {"interval": 2, "max_questions": 4, "max_gen_len": 8},
        "logging": {"log_dir": str(tmp_path / "logs"), "sample_interval": 1, "num_samples": 2},
        "checkpoint": {"dir": str(tmp_path / "checkpoints"), "interval": 2},
    }
    for assignment in overrides:
        config_lib.apply_override(values, assignment)
    return config_lib.build(train.TrainConfig, values)


def read_scalars(log_dir):
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_short_run_logs_metrics_and_writes_loadable_checkpoints(tmp_path, tiny_model_dir, countdown_dir, digit_reward):
    train.train(tiny_config(tmp_path, tiny_model_dir, countdown_dir))
    scalars = read_scalars(tmp_path / "logs" / "tiny")
    missing = [tag for tag in EXPECTED_SCALARS if tag not in scalars]
    assert not missing, missing
    assert [step for step, _ in scalars["reward/mean"]] == [1, 2, 3]
    # A step whose groups all have equal rewards skips its update, and logs no loss.
    skipped = [step for step, value in scalars["train/update_skipped"] if value]
    assert [step for step, _ in scalars["train/loss"]] == [step for step in (1, 2, 3) if step not in skipped]
    assert [step for step, _ in scalars["eval/success_rate"]] == [0, 2]
    events = EventAccumulator(str(tmp_path / "logs" / "tiny")).Reload()
    assert any(tag.startswith("episodes/") for tag in events.Tags()["tensors"])

    run_dir = tmp_path / "checkpoints" / "tiny"
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "finished", "step_000002", "step_000003"]
    checkpoint = run_dir / "step_000003"
    ours = Transformer.from_pretrained(checkpoint, dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    initial = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, 400, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max() <= 1e-4
        assert (ours(tokens) - initial(tokens)).abs().max() > 1e-4  # training changed the policy


@pytest.mark.parametrize("questions", [[], ["rollout.outside_forms_repeat=20", "rollout.outside_forms_repeat_after=1",
                                             "rollout.outside_forms_numbers=[3,4]"]], ids=["plain", "repeat_after_1"])
def test_resume_equals_uninterrupted_run(tmp_path, tiny_model_dir, countdown_dir, digit_reward, questions):
    # The eval after the resume samples too, long enough answers to earn different rewards. The second case
    # resumes after the step at which the outside-forms repeat starts.
    sampled_eval = ["eval.temperature=1.0", "eval.num_samples=2", "eval.max_gen_len=16", "eval.max_questions=16",
                    "task.test_size=16", *questions]
    train.train(tiny_config(tmp_path / "full", tiny_model_dir, countdown_dir, "optim.num_steps=4", *sampled_eval))
    train.train(tiny_config(tmp_path / "cut", tiny_model_dir, countdown_dir, "optim.num_steps=2", *sampled_eval))
    resumed_config = tiny_config(tmp_path / "cut", tiny_model_dir, countdown_dir, "optim.num_steps=4", *sampled_eval)
    train.train(resumed_config, resume=str(tmp_path / "cut" / "checkpoints" / "tiny"))
    full = Transformer.from_pretrained(tmp_path / "full" / "checkpoints" / "tiny" / "step_000004", dtype=torch.float32)
    resumed = Transformer.from_pretrained(tmp_path / "cut" / "checkpoints" / "tiny" / "step_000004", dtype=torch.float32)
    for (name, a), b in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    full_loss = read_scalars(tmp_path / "full" / "logs" / "tiny")["train/loss"]
    # One events file per run: read each in the order written (TensorBoard orders them by file name, and in
    # one process a name's counter can sort 10 before 9), the resumed run's steps after the first run's.
    files = sorted((tmp_path / "cut" / "logs" / "tiny").glob("events.out.tfevents.*"), key=lambda f: f.stat().st_mtime)
    resumed_loss = {step: value for file in files for step, value in read_scalars(file).get("train/loss", [])}
    assert sorted(resumed_loss.items()) == full_loss
    # The evaluation after the resume (step 4) answers with the same samples: its reward is the same float.
    full_eval = read_scalars(tmp_path / "full" / "logs" / "tiny")["eval/mean_reward"]
    resumed_eval = dict(read_scalars(files[-1])["eval/mean_reward"])
    assert resumed_eval == {4: dict(full_eval)[4]} and len({value for _, value in full_eval}) > 1


def test_zero_reward_steps_skip_the_update_and_warn_with_the_sft_fix(tmp_path, tiny_model_dir, countdown_dir, caplog):
    """The random tiny model never earns CountDown's reward: every group is flat, nothing to learn from."""
    config = tiny_config(tmp_path, tiny_model_dir, countdown_dir, "optim.num_steps=3", "eval.interval=0",
                         "optim.warn_after_zero_reward_steps=2")
    with caplog.at_level(logging.INFO):
        train.train(config)
    step_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(step_lines) == 3
    assert all("flat groups 1.00 | update skipped: no reward spread" in line for line in step_lines)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no episode has earned any reward for 2 steps" in warnings[0]
    assert (f"uv run train_sft.py --config configs/countdown_sft.yaml --set model.dir={tiny_model_dir} "
            f"--set task.data_dir={countdown_dir}") in warnings[0]
    scalars = read_scalars(tmp_path / "logs" / "tiny")
    assert scalars["train/update_skipped"] == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert "train/loss" not in scalars
    after = Transformer.from_pretrained(tmp_path / "checkpoints" / "tiny" / "step_000003", dtype=torch.float32)
    before = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(after.parameters(), before.parameters()))


def test_distinct_try_reward_is_logged_beside_the_try_reward(tmp_path, tiny_model_dir, countdown_dir):
    # CountDown's own reward: a repeated try counts once in reward/distinct_tries, so it never exceeds reward/tries.
    train.train(tiny_config(tmp_path, tiny_model_dir, countdown_dir, "optim.num_steps=2", "eval.interval=0",
                            "loss.try_reward_weight=0.3", "loss.try_reward_distinct=true"))
    scalars = read_scalars(tmp_path / "logs" / "tiny")
    assert [step for step, _ in scalars["reward/distinct_tries"]] == [1, 2]
    assert all(distinct <= tries for (_, distinct), (_, tries) in zip(scalars["reward/distinct_tries"],
                                                                      scalars["reward/tries"]))


def test_rewarded_steps_update_and_never_warn(tmp_path, tiny_model_dir, countdown_dir, digit_reward, caplog):
    config = tiny_config(tmp_path, tiny_model_dir, countdown_dir, "optim.num_steps=2", "eval.interval=0",
                         "optim.warn_after_zero_reward_steps=0")
    with caplog.at_level(logging.INFO):
        train.train(config)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert read_scalars(tmp_path / "logs" / "tiny")["train/update_skipped"] == [(1, 0.0), (2, 0.0)]


def asked_questions(tmp_path, model_dir, data_dir, monkeypatch, *overrides) -> list[list[tuple]]:
    """The questions each step of a 3-step run asks (2 per step, 3 answers each, no evaluation)."""
    asked = []

    def reward(response, item, end_token):
        asked.append((tuple(item["nums"]), item["target"]))
        return {"reward": 0.0, "reward_info": {"format_reward": 0.0, "answer_reward": 0.0}}

    monkeypatch.setattr(countdown_task, "reward", reward)
    train.train(tiny_config(tmp_path, model_dir, data_dir, "optim.num_steps=3", "eval.interval=0", *overrides))
    return [sorted(set(asked[step * 6:(step + 1) * 6])) for step in range(3)]


def test_outside_forms_repeat_starts_after_the_configured_step(tmp_path, tiny_model_dir, countdown_dir, monkeypatch,
                                                               caplog):
    """Steps up to rollout.outside_forms_repeat_after ask what a run without the repeat asks; later steps what a
    run repeating from the start asks (which questions repeat: test_countdown_forms.py), and they differ."""
    repeat = ["rollout.outside_forms_repeat=20", "rollout.outside_forms_numbers=[3,4]"]
    plain = asked_questions(tmp_path / "plain", tiny_model_dir, countdown_dir, monkeypatch)
    with caplog.at_level(logging.INFO):
        repeated = asked_questions(tmp_path / "repeated", tiny_model_dir, countdown_dir, monkeypatch, *repeat)
    after_1 = asked_questions(tmp_path / "after_1", tiny_model_dir, countdown_dir, monkeypatch, *repeat,
                              "rollout.outside_forms_repeat_after=1")
    assert after_1 == plain[:1] + repeated[1:] and repeated[1:] != plain[1:]
    [line] = [r.getMessage() for r in caplog.records if "outside the 10 best forms" in r.getMessage()]
    outside, draws = int(line.split()[0]), int(line.split(" of the ")[-1].split()[0])
    training_rows = len(countdown_task.CountdownDataset(countdown_dir, Tokenizer(tiny_model_dir), test_size=4))
    assert " of 3/4 numbers " in line and 0 < outside and draws == training_rows + 19 * outside


def test_grpo_asks_only_the_configured_number_counts(tmp_path, tiny_model_dir, countdown_dir, monkeypatch):
    """rollout.train_number_counts=[4]: every question asked has 4 numbers (a plain run asks some with 3), also with
    a repeat of the 3-number questions outside the best forms; counts the data lacks stop the run before a step."""
    plain = asked_questions(tmp_path / "plain", tiny_model_dir, countdown_dir, monkeypatch)
    assert {len(numbers) for step in plain for numbers, _ in step} == {3, 4}
    four = asked_questions(tmp_path / "four", tiny_model_dir, countdown_dir, monkeypatch,
                           "rollout.train_number_counts=[4]", "rollout.outside_forms_repeat=20")
    assert all(len(numbers) == 4 for step in four for numbers, _ in step)
    with pytest.raises(DataError, match=r"train_number_counts \[2\]: no training question has that many numbers"):
        train.train(tiny_config(tmp_path / "two", tiny_model_dir, countdown_dir, "rollout.train_number_counts=[2]"))


def test_all_unfinished_episodes_skip_the_update(tmp_path, tiny_model_dir, countdown_dir, caplog):
    """A random tiny model never says eos within 12 tokens, so overlong filtering leaves nothing."""
    config = tiny_config(tmp_path, tiny_model_dir, countdown_dir, "optim.skip_unfinished_episodes=true",
                         "optim.num_steps=1", "eval.interval=0")
    train.train(config)
    assert "no episodes to train on" in caplog.text
    after = Transformer.from_pretrained(tmp_path / "checkpoints" / "tiny" / "step_000001", dtype=torch.float32)
    before = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(after.parameters(), before.parameters()))


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.learning_rat=1e-5", "unknown key 'optim.learning_rat'.*valid keys: num_steps, learning_rate"),
        ("rollout.episodes_per_step=7", r"episodes_per_step \(7\) must be divisible by .*num_answers_per_question \(3\)"),
        ("loss.aggregation=mean", "loss.aggregation: 'mean' is not allowed; use one of 'token', 'sequence', 'constant'"),
        ("optim.micro_batch_size=two", "optim.micro_batch_size: expected int, got 'two'"),
        ("optim.betas=[0.9]", "optim.betas: expected 2 values"),
        ("modle.dir=x", "unknown key 'modle' in the top level"),
    ],
)
def test_bad_config_names_the_key(tmp_path, tiny_model_dir, countdown_dir, override, message):
    with pytest.raises(config_lib.ConfigError, match=message):
        tiny_config(tmp_path, tiny_model_dir, countdown_dir, override)


def test_command_line_reports_config_errors_before_any_work(tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("optim:\n  num_step: 3\n")
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--config", str(tmp_path / "bad.yaml")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("config error: unknown key 'optim.num_step'")


def test_missing_model_and_data_say_how_to_get_them(tmp_path, tiny_model_dir, countdown_dir):
    with pytest.raises(FileNotFoundError, match="git clone https://huggingface.co/Qwen/Qwen2.5-3B-Instruct"):
        train.train(tiny_config(tmp_path, tmp_path / "no-model", countdown_dir))
    with pytest.raises(FileNotFoundError, match="Countdown-Tasks-3to4"):
        train.train(tiny_config(tmp_path, tiny_model_dir, tmp_path / "no-data"))


def test_cuda_without_a_gpu_is_a_clear_error(tmp_path, tiny_model_dir, countdown_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU
    with pytest.raises(config_lib.ConfigError, match="device: cuda was requested but CUDA is not usable: "):
        train.train(tiny_config(tmp_path, tiny_model_dir, countdown_dir, "device=cuda"))
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "logs").exists()


def test_console_shows_the_formatted_fraction_as_evaluate_does(tmp_path, tiny_model_dir, countdown_dir, monkeypatch,
                                                               caplog):
    """Every answer formatted, none right: the console's format is 1.000 (a fraction, as eval/format_rate), while
    reward/format stays the mean format reward, 0.1."""
    monkeypatch.setattr(countdown_task, "reward", lambda response, item, end_token: {
        "reward": 0.1, "reward_info": {"format_reward": 0.1, "answer_reward": 0.0}})
    with caplog.at_level(logging.INFO):
        train.train(tiny_config(tmp_path, tiny_model_dir, countdown_dir, "optim.num_steps=1", "eval.interval=1"))
    [step_line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 1 ")]
    assert "| success 0.000 | format 1.000 |" in step_line
    [eval_line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("eval step 1:")]
    assert "format 1.000" in eval_line
    scalars = read_scalars(tmp_path / "logs" / "tiny")
    assert scalars["train/format_rate"] == [(1, 1.0)] and scalars["eval/format_rate"][-1] == (1, 1.0)
    assert scalars["reward/format"] == [(1, pytest.approx(0.1))]


STOPPED_RUN = """
import os, signal, sys
sys.path.insert(0, {root!r})
import countdown_task, train
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if this test runs in the background
calls = 0

def parity_reward(response, item, end_token):  # as parity_reward below; SIGINT during step 2's scoring
    global calls
    calls += 1
    if calls == 8:
        os.kill(os.getpid(), signal.SIGINT)
    return {{"reward": float(len(response) % 2), "reward_info": {{"format_reward": 0.0, "answer_reward": 0.0}}}}

countdown_task.reward = parity_reward
train.main(sys.argv[1:])
"""


def parity_reward(response, item, end_token):
    """Rewards that differ within almost every group, so every step of the tiny model updates it."""
    return {"reward": float(len(response) % 2), "reward_info": {"format_reward": 0.0, "answer_reward": 0.0}}


@pytest.mark.slow
def test_ctrl_c_ends_the_step_saves_it_and_resume_matches_an_uninterrupted_run(tmp_path, tiny_model_dir,
                                                                               countdown_dir, monkeypatch):
    monkeypatch.setattr(countdown_task, "reward", parity_reward)
    overrides = ["optim.num_steps=4", "eval.interval=0", "checkpoint.interval=0", "cpu_threads=1"]
    config_path = tmp_path / "cut.yaml"
    config_lib.dump(tiny_config(tmp_path / "cut", tiny_model_dir, countdown_dir, *overrides), config_path)
    stopped = subprocess.run([sys.executable, "-c", STOPPED_RUN.format(root=str(REPO_ROOT)), "--config",
                              str(config_path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    run = tmp_path / "cut" / "checkpoints" / "tiny"
    assert stopped.returncode == 130, stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert stopped.stderr.strip().splitlines()[-1] == (f"stopped by SIGINT after step 2, saved in {run}/step_000002; "
                                                       f"continue with: uv run train.py --resume {run}")
    assert "step 2 | reward" in stopped.stderr and "step 3 |" not in stopped.stderr  # step 2 ended, no step 3
    assert sorted(path.name for path in run.iterdir()) == ["config.yaml", "step_000002"]
    train.train(tiny_config(tmp_path / "cut", tiny_model_dir, countdown_dir, *overrides), resume=str(run))
    train.train(tiny_config(tmp_path / "whole", tiny_model_dir, countdown_dir, *overrides))
    whole = Transformer.from_pretrained(tmp_path / "whole" / "checkpoints" / "tiny" / "step_000004", dtype=torch.float32)
    resumed = Transformer.from_pretrained(run / "step_000004", dtype=torch.float32)
    for (name, a), b in zip(whole.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    assert read_scalars(tmp_path / "whole" / "logs" / "tiny")["train/update_skipped"] == [(step, 0.0) for step in
                                                                                         (1, 2, 3, 4)]


@pytest.mark.parametrize("release", [True, False])
def test_each_rollout_starts_after_the_freed_cpu_memory_is_released(tmp_path, tiny_model_dir, countdown_dir,
                                                                     digit_reward, monkeypatch, release):
    """With rollout.release_cpu_memory, the last update's freed activations go back to the system before the
    rollout maps its KV cache, so the GRPO stage peaks at the larger of the two, not their sum
    (runtime.release_freed_cpu_memory); without it, nothing is released."""
    events = []
    release_memory, sample_step = train.release_freed_cpu_memory, train.sample_step
    monkeypatch.setattr(train, "release_freed_cpu_memory",
                        lambda device: events.append("release") or release_memory(device))
    monkeypatch.setattr(train, "sample_step", lambda *args, **kwargs: events.append("rollout") or sample_step(*args, **kwargs))
    train.train(tiny_config(tmp_path, tiny_model_dir, countdown_dir, "eval.interval=0",
                            f"rollout.release_cpu_memory={str(release).lower()}"))
    assert events == (["release", "rollout"] if release else ["rollout"]) * 3
