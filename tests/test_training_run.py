"""GRPO and SFT live one run life (training_run.py): the same calls in the same order, the same step numbers,
the same checkpoints when stopped, and the same way back after a crash before the first checkpoint."""

import ast
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import config as config_lib
import runtime
import train
import train_sft
import training_run
from test_train import countdown_dir, digit_reward, tiny_config  # noqa: F401 (fixtures)
from test_train_sft import countdown_with_solutions, sft_config  # noqa: F401 (fixture)

REPO_ROOT = Path(__file__).resolve().parents[1]
LIFE = ["TrainingRun", "claim", "loading", "restore", "open_logger", "steps", "end_step", "finish"]
# What only training_run.py may call: a trainer that did would live a run life of its own.
LIFE_PARTS = {"claim_run", "released_on_error", "StopRequest", "save_checkpoint", "restore_trainer_state",
              "set_up_process", "mark_finished", "RunLogger", "find", "continue_in_resumed_run", "check_own_state",
              "check_model_and_data", "plan_resume"}


def calls_in_order(source: Path, function: str) -> list[str]:
    tree = ast.parse(source.read_text())
    [body] = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == function]
    calls = sorted((node for node in ast.walk(body) if isinstance(node, ast.Call)),
                   key=lambda node: (node.lineno, node.col_offset))
    return [node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "") for node in calls]


@pytest.mark.parametrize("script, function", [("train.py", "train_from"), ("train_sft.py", "train_sft_from")])
def test_both_trainers_make_the_same_calls_in_the_same_order(script, function):
    calls = calls_in_order(REPO_ROOT / script, function)
    assert [call for call in calls if call in LIFE] == LIFE
    assert not LIFE_PARTS & set(calls)


def stop_after(step_to_stop: int, monkeypatch):
    """A SIGTERM as the run asks after step `step_to_stop` (what StopRequest.handle would have recorded)."""
    asked = iter(range(1, 10_000))

    def requested(self):
        if next(asked) == step_to_stop:
            self.signal = signal.SIGTERM
        return self.signal is not None

    monkeypatch.setattr(training_run.StopRequest, "requested", requested)


def stopped_run(trainer, monkeypatch) -> training_run.RunStopped:
    stop_after(3, monkeypatch)
    with pytest.raises(training_run.RunStopped) as stopped:
        trainer()
    return stopped.value


def test_a_stop_ends_both_trainers_after_the_same_step_with_the_same_checkpoints(
        tmp_path, monkeypatch, tiny_model_dir, countdown_dir, countdown_with_solutions, digit_reward):
    overrides = ("optim.num_steps=6", "checkpoint.interval=2", "eval.interval=0")
    grpo_config = tiny_config(tmp_path / "grpo", tiny_model_dir, countdown_dir, *overrides)
    sft = sft_config(tmp_path / "sft", tiny_model_dir, countdown_with_solutions, *overrides)
    grpo_stop = stopped_run(lambda: train.train(grpo_config), monkeypatch)
    sft_stop = stopped_run(lambda: train_sft.train_sft(sft), monkeypatch)
    for stop, run_dir, log_dir, script in ((grpo_stop, tmp_path / "grpo/checkpoints/tiny", tmp_path / "grpo/logs/tiny",
                                            "train.py"),
                                           (sft_stop, tmp_path / "sft/checkpoints/sft", tmp_path / "sft/logs/sft",
                                            "train_sft.py")):
        assert str(stop) == (f"stopped by SIGTERM after step 3, saved in {run_dir}/step_000003; continue with: "
                             f"uv run {script} --resume {run_dir}")
        assert sorted(path.name for path in run_dir.iterdir()) == ["config.yaml", "step_000002", "step_000003"]
        events = EventAccumulator(str(log_dir)).Reload()
        assert [event.step for event in events.Scalars("train/learning_rate")] == [1, 2, 3]
    assert not (tmp_path / "sft" / "sft-out").exists()  # a stopped warm-up has no result yet


KILLED_AT_STEP_2 = """
import os, signal, sys
sys.path.insert(0, {root!r})
import train_sft
real_sft_step = train_sft.sft_step
def sft_step(*args, step, **kwargs):
    if step == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # no handler, nothing saved
    return real_sft_step(*args, step=step, **kwargs)
train_sft.sft_step = sft_step
train_sft.main(sys.argv[1:])
"""


def test_an_sft_run_killed_before_its_first_checkpoint_starts_over_from_its_own_config(
        tmp_path, tiny_model_dir, countdown_with_solutions):
    """As a GRPO run: the run directory keeps the config, so --resume RUN_DIR needs nothing else."""
    config = sft_config(tmp_path, tiny_model_dir, countdown_with_solutions, "optim.num_steps=4", "eval.interval=0",
                        "checkpoint.interval=0", "cpu_threads=1")
    config_lib.dump(config, tmp_path / "sft.yaml")
    killed = subprocess.run([sys.executable, "-c", KILLED_AT_STEP_2.format(root=str(REPO_ROOT)), "--config",
                             str(tmp_path / "sft.yaml")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    run_dir = tmp_path / "checkpoints" / "sft"
    assert sorted(path.name for path in run_dir.iterdir() if not path.name.startswith(".")) == ["config.yaml"]
    plan = train_sft.read_command_line(["--resume", str(run_dir)])
    assert plan.config == config and plan.checkpoint_dir is None
    assert train_sft.train_sft_from(plan)["steps"] == 4
    assert (tmp_path / "sft-out" / "model.safetensors").is_file()


COUNTED = """
import atexit, functools, json, runpy, sys
sys.path.insert(0, {root!r})
import checkpoint, config, inputs
counts = {{}}
def counted(owner, name):
    real = getattr(owner, name)
    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return real(*args, **kwargs)
    setattr(owner, name, wrapper)
for owner, name in [(checkpoint, "find"), (checkpoint, "check_trainer"), (checkpoint, "continue_in_resumed_run"),
                    (checkpoint, "check_own_state"), (config, "load"), (inputs, "check_model_and_data"),
                    (config.TrainConfig, "validate_for_model")]:
    counted(owner, name)
atexit.register(lambda: print("COUNTS", json.dumps(counts)))
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


def counts_of_a_start(script: str, *args) -> dict:
    done = subprocess.run([sys.executable, "-c", COUNTED.format(root=str(REPO_ROOT), script=script), *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    [line] = [line for line in done.stdout.splitlines() if line.startswith("COUNTS ")]
    return json.loads(line.removeprefix("COUNTS "))


@pytest.mark.slow
def test_each_check_runs_once_per_start_of_train_py(tmp_path, tiny_model_dir, countdown_dir):
    """Read at the top of the script before torch loads, the plan is the one the run then uses: the config is read
    and every input is checked once, for a new run and for a resume."""
    config_path = tmp_path / "run.yaml"
    config_lib.dump(tiny_config(tmp_path, tiny_model_dir, countdown_dir, "optim.num_steps=1", "eval.interval=0",
                                "cpu_threads=1"), config_path)
    once = {"load": 1, "check_model_and_data": 1, "find": 1, "continue_in_resumed_run": 1, "validate_for_model": 1}
    assert counts_of_a_start("train.py", "--config", str(config_path)) == once
    resumed = counts_of_a_start("train.py", "--resume", str(tmp_path / "checkpoints" / "tiny"), "--set",
                                "optim.num_steps=2")
    assert resumed == {**once, "check_trainer": 1, "check_own_state": 1}
    assert (tmp_path / "checkpoints" / "tiny" / "step_000002").is_dir()


@pytest.mark.slow
def test_each_check_runs_once_per_start_of_train_sft_py(tmp_path, tiny_model_dir, countdown_with_solutions):
    config_path = tmp_path / "sft.yaml"
    config_lib.dump(sft_config(tmp_path, tiny_model_dir, countdown_with_solutions, "optim.num_steps=2",
                               "eval.interval=0", "checkpoint.interval=1", "cpu_threads=1"), config_path)
    once = {"load": 1, "check_model_and_data": 1, "find": 1, "continue_in_resumed_run": 1}
    assert counts_of_a_start("train_sft.py", "--config", str(config_path)) == once
    resumed = counts_of_a_start("train_sft.py", "--resume", str(tmp_path / "checkpoints" / "sft" / "step_000001"))
    assert resumed == {**once, "check_trainer": 1, "check_own_state": 1}


@pytest.mark.skipif(sys.platform != "linux", reason="THP_MEM_ALLOC_ENABLE is torch's allocator setting on Linux")
@pytest.mark.parametrize("user_setting, page_aligned", [(None, True), ("0", False)])
def test_a_process_puts_large_cpu_tensors_on_huge_pages_unless_told_not_to(user_setting, page_aligned):
    """torch reads THP_MEM_ALLOC_ENABLE once, at its first large allocation: a fresh process that sets up as the
    trainers do, then allocates, shows whether the setting came in time (torch page-aligns such tensors)."""
    environment = {key: value for key, value in os.environ.items() if key != "THP_MEM_ALLOC_ENABLE"}
    if user_setting is not None:
        environment["THP_MEM_ALLOC_ENABLE"] = user_setting
    script = ("import runtime, torch; runtime.set_up_process('cpu', 1, 0); "
              "tensors = [torch.empty(3 << 20, dtype=torch.uint8) for _ in range(8)]; "
              "print(sum(tensor.data_ptr() % 4096 == 0 for tensor in tensors))")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=environment, capture_output=True,
                            text=True, check=True)
    assert (int(result.stdout) == 8) == page_aligned


@pytest.mark.skipif(runtime._glibc() is None, reason="malloc_trim is glibc's: musl, macOS and Windows lack it")
def test_releasing_freed_cpu_memory_gives_the_heap_pages_back():
    """Tensors under glibc's mmap threshold live in its heap; freed, their pages stay resident until released. A
    fresh process sets up as the trainers do, fills the heap, pins its top with one tensor made last, frees the
    rest, and reads its resident memory before and after the release."""
    script = (
        "import re, runtime, torch; runtime.set_up_process('cpu', 1, 0)\n"
        "rss = lambda: int(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) // 1024\n"
        "tensors = [torch.ones(16 << 10) for _ in range(5000)]  # 64 KiB each (under the mmap threshold): ~310 MiB\n"
        "pin = torch.ones(16 << 10)\n"
        "del tensors\n"
        "held = rss(); runtime.release_freed_cpu_memory(torch.device('cpu')); print(held, rss())\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    held, released = map(int, result.stdout.split())
    assert held - released >= 200, (held, released)  # MiB
