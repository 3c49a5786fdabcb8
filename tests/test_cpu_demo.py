"""The CPU demo's commands, shortened: `train.py --config configs/cpu_demo.yaml` from nothing (dataset, base
model, SFT warm-up, GRPO), greedy `evaluate.py` on its final checkpoint, and bench/learning_cpu.py."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import countdown_task

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_script(*command: str) -> str:
    completed = subprocess.run([sys.executable, *command], capture_output=True, text=True, cwd=REPO_ROOT)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout


def set_flags(overrides: list[str]) -> list[str]:
    return [flag for override in overrides for flag in ("--set", override)]


@pytest.mark.slow
def test_shortened_demo_learns_and_its_checkpoint_evaluates_greedily(tmp_path):
    """The demo command on a 2-number task with shorter SFT (300 steps) and GRPO (30) phases, with the demo's
    dynamic sampling and 2 optimizer steps per rollout (2.1 min alone on one core; seed 0: 48.4% -> 66.8%, a
    margin kept on purpose: kernels differ between CPUs)."""
    overrides = [
        f"task.data_dir={tmp_path / 'countdown'}", f"model.dir={tmp_path / 'sft-model'}",
        f"bootstrap.data_dir={tmp_path / 'countdown'}", f"bootstrap.model_dir={tmp_path / 'sft-model'}",
        f"logging.log_dir={tmp_path / 'logs'}", f"checkpoint.dir={tmp_path / 'checkpoints'}",
        "progress=false", "cpu_threads=1", "optim.num_steps=30", "eval.interval=30", "eval.max_questions=128",
        "task.test_size=128",
        "bootstrap.dataset_args=--size 12000 --seed 0 --min-numbers 2 --max-numbers 2 --max-number 20 --max-target 40 --with-solutions",
        f"bootstrap.sft_overrides=[model.dir={tmp_path / 'base-model'}, logging.log_dir={tmp_path / 'logs'},"
        f" checkpoint.dir={tmp_path / 'checkpoints'},"
        " optim.num_steps=300, optim.stop_at_success=null, eval.interval=0, progress=false, cpu_threads=1]",
    ]
    run_script("train.py", "--config", "configs/cpu_demo.yaml", *set_flags(overrides))

    events = EventAccumulator(str(tmp_path / "logs" / "cpu-demo")).Reload()
    success = {event.step: event.value for event in events.Scalars("eval/success_rate")}
    assert sorted(success) == [0, 30]
    assert success[0] > 0.1, "the SFT warm-up should already solve some held-out questions"
    assert success[30] > success[0], f"GRPO did not raise held-out success: {success}"
    assert events.Scalars("eval/format_rate")[-1].value > 0.9

    final_checkpoint = tmp_path / "checkpoints" / "cpu-demo" / "step_000030"
    samples_file = tmp_path / "greedy.jsonl"
    run_script("evaluate.py", "--model", str(final_checkpoint), "--temperature", "0", "--samples", "1", "--out", str(samples_file))
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == 128  # the checkpoint's config: its task.test_size held-out questions, one answer each
    # Scored again here by the task's own reward on the saved text, independent of evaluate.py's summary.
    rescored = [countdown_task.answer_reward(s["response"], s["nums"], s["target"]) == 1.0 for s in samples]
    assert [s["reward_info"]["answer_reward"] == 1.0 for s in samples] == rescored
    assert sum(rescored) / len(samples) > 0.1


# bench/learning_cpu.py's stages at toy sizes: 48 held-out questions, 8 SFT steps, 2 GRPO steps of 2 questions.
# Dynamic sampling draws 2 questions a round for 2 rounds, not the demo's 32 for 6, and answers stop at 32 tokens:
# an 8-step SFT model earns no reward, so every round of every step runs to the length limit (the demo's
# 6 x 32 questions x 8 answers x 128 tokens were most of these tests' time).
TINY_BENCH = [
    "task.test_size=48", "eval.max_questions=16", "eval.interval=2", "optim.num_steps=2", "checkpoint.interval=0",
    "rollout.episodes_per_step=16", "rollout.dynamic_sampling_questions_per_round=2", "cpu_threads=1",
    "rollout.max_gen_len=32", "rollout.dynamic_sampling_max_rounds=2",
    "bootstrap.dataset_args=--size 400 --min-numbers 2 --max-numbers 2 --max-number 20 --max-target 40 --with-solutions",
    "bootstrap.sft_overrides=[optim.num_steps=8, optim.stop_at_success=null, eval.interval=0, data.eval_size=16]",
]


@pytest.mark.slow
def test_learning_bench_runs_every_seed_and_reuses_its_cache(tmp_path):
    """bench/learning_cpu.py at toy sizes: per-seed data and models, the table, and the cache a variant reuses."""
    tiny = TINY_BENCH
    cache = tmp_path / "cache"
    variant = tmp_path / "variant.yaml"
    variant.write_text("loss:\n  aggregation: sequence\n")
    run_script("bench/learning_cpu.py", "--seeds", "2", "--cache-dir", str(cache), "--out", str(tmp_path / "a"),
               *set_flags(tiny))
    run_script("bench/learning_cpu.py", "--seeds", "2", "--jobs", "2", "--cache-dir", str(cache), "--out",
               str(tmp_path / "b"), "--overlay", str(variant), *set_flags(tiny))

    first, second = (json.loads((tmp_path / out / "learning_cpu.json").read_text()) for out in ("a", "b"))
    assert [r["seed"] for r in first["seeds"]] == [0, 1]
    datasets = [countdown_task.read_tasks(Path(r["sft_model"]).parent / "countdown").to_pylist() for r in first["seeds"]]
    assert datasets[0] != datasets[1], "each seed must generate its own dataset"
    for before, after in zip(first["seeds"], second["seeds"]):
        assert not before["stages"]["cached"] and after["stages"]["cached"]
        assert after["sft_model"] == before["sft_model"] and after["before"] == before["before"]
        assert before["held_out_questions"] == 48
        assert 0 <= before["after"]["exact_tries_greedy"] <= 1  # evaluate.py's mean_try_reward, greedy
        assert before["gain_t1"] == pytest.approx(before["after"]["success_t1"] - before["before"]["success_t1"], abs=1e-4)
    assert second["overlay"] == str(variant) and (first["jobs"], second["jobs"]) == (1, 2)
    table = (tmp_path / "a" / "learning_cpu.md").read_text()
    assert "GRPO exact tries" in table
    assert "| mean |" in table and "| min |" in table and "| max |" in table and "standard error" in table
    assert (tmp_path / "a" / "curves.png").stat().st_size > 0


@pytest.mark.slow
def test_variants_table_starts_every_variant_from_the_seeds_sft_model_and_resumes(tmp_path):
    """bench/variants_table.py's plumbing at toy sizes: two variants and the same-compute control on one seed."""
    out = tmp_path / "variants"
    command = ("bench/variants_table.py", "--seeds", "1", "--variants", "grpo", "dapo", "--out", str(out),
               *set_flags([*TINY_BENCH, "task.test_size=16", "eval.max_questions=8"]))
    run_script(*command)
    paths = {path.stem: path for path in (out / "rows").glob("*.json")}
    assert sorted(paths) == ["dapo-s0", "grpo-s0", "grpo_same_compute-s0"]
    rows = {name: json.loads(path.read_text()) for name, path in paths.items()}
    assert len({row["result"]["sft_model"] for row in rows.values()}) == 1 and len(list((out / "cache").iterdir())) == 1
    assert rows["grpo-s0"]["grpo_config"]["loss"]["kl_beta"] == 0.0  # the preset's, not configs/cpu_demo.yaml's 0.05
    assert rows["grpo-s0"]["answers_sampled"] == 2 * 16  # 2 steps of 16 answers
    assert rows["dapo-s0"]["grpo_config"]["rollout"]["dynamic_sampling"]
    # The control: plain GRPO with as many 16-answer steps as it takes to sample what the costlier variant did.
    steps = math.ceil(max(rows[name]["answers_sampled"] for name in ("grpo-s0", "dapo-s0")) / 16)
    control = rows["grpo_same_compute-s0"]
    assert control["grpo_config"]["optim"]["num_steps"] == steps and control["answers_sampled"] == 16 * steps
    assert control["grpo_config"]["loss"] == rows["grpo-s0"]["grpo_config"]["loss"]
    table = (out / "variants.md").read_text()
    assert all(f"| {name} | 0 |" in table for name in ("grpo", "dapo", "grpo_same_compute"))

    # Resumed after an interrupted grpo run (no row, a partial run directory): only grpo runs again.
    paths["grpo-s0"].unlink()
    written = {name: path.stat().st_mtime_ns for name, path in paths.items() if name != "grpo-s0"}
    stdout = run_script(*command)
    assert "dapo, seed 0: done" in stdout and "grpo_same_compute, seed 0: done" in stdout
    assert {name: paths[name].stat().st_mtime_ns for name in written} == written
    rerun = json.loads(paths["grpo-s0"].read_text())
    assert rerun["result"]["stages"]["cached"] and rerun["result"]["sft_model"] == rows["grpo-s0"]["result"]["sft_model"]
