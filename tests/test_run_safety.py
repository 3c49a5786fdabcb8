"""No run loses or mixes data: the run-directory lock, checkpoint writes that survive a crash, retention,
a bootstrap that builds only its own paths, and data errors that name file and row."""

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import ablate
import bootstrap
import checkpoint
import config as config_lib
import countdown_task
import evaluate
import train
import train_sft
import training_run
from test_train import countdown_dir, tiny_config  # noqa: F401 (fixture)

REPO_ROOT = Path(__file__).resolve().parents[1]
HOLD_LOCK = """
import sys
sys.path.insert(0, {root!r})
import checkpoint
claim = checkpoint.claim_run(__import__("pathlib").Path(sys.argv[1]), __import__("pathlib").Path(sys.argv[2]), False, False)
print("locked", flush=True)
sys.stdin.read()  # hold it until the test closes our stdin (or kills us)
"""


def hold_lock(run_dir: Path, log_dir: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK.format(root=str(REPO_ROOT)), str(run_dir), str(log_dir)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    return holder


def test_a_second_process_on_the_same_run_stops_at_once_naming_the_holder(tmp_path, tiny_model_dir, countdown_dir):
    config_path = tmp_path / "run.yaml"
    config_lib.dump(tiny_config(tmp_path, tiny_model_dir, countdown_dir), config_path)
    holder = hold_lock(tmp_path / "checkpoints" / "tiny", tmp_path / "logs" / "tiny")
    try:
        second = subprocess.run([sys.executable, str(REPO_ROOT / "train.py"), "--config", str(config_path)],
                                cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    finally:
        holder.kill()  # as a crash would: the kernel releases the lock
        holder.wait()
    assert second.returncode == 2
    assert second.stderr.startswith(f"run directory error: {(tmp_path / 'checkpoints' / 'tiny').resolve()} is in use "
                                    f"by process {holder.pid} on host "), second.stderr
    assert "--set run_name=NAME" in second.stderr and "--resume" in second.stderr
    assert "Traceback" not in second.stderr and not (tmp_path / "checkpoints" / "tiny" / "config.yaml").exists()
    # The killed holder left its lock file, but not its lock: the next run takes the directory.
    claim = checkpoint.claim_run(tmp_path / "checkpoints" / "tiny", tmp_path / "logs" / "tiny", False, False)
    claim.release()
    assert not (tmp_path / "checkpoints" / "tiny").exists()  # nothing written: nothing left behind


def test_ablate_locks_its_output_directory(tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK.format(root=str(REPO_ROOT)), str(tmp_path / "out"),
                               str(tmp_path / "out")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "a.yaml").write_text("seed: 1\n")
    (tmp_path / "out" / "logs" / "a").mkdir(parents=True)  # the first suite's live run
    try:
        with pytest.raises(SystemExit) as exit_info:
            ablate.main([str(tmp_path / "experiments"), "--base", "configs/cpu_demo.yaml", "--out", str(tmp_path / "out")])
    finally:
        holder.stdin.close()
        holder.wait()
    assert exit_info.value.code == 2
    assert f"is in use by process {holder.pid}" in capsys.readouterr().err
    assert (tmp_path / "out" / "logs" / "a").is_dir()


def test_a_new_run_refuses_an_earlier_runs_files_unless_overwrite(tmp_path):
    run_dir, log_dir = tmp_path / "checkpoints" / "r", tmp_path / "logs" / "r"
    (run_dir / "step_000010").mkdir(parents=True)
    log_dir.mkdir(parents=True)
    (log_dir / "events.out.tfevents.1.host").write_text("x")
    with pytest.raises(checkpoint.RunDirectoryError, match=r"step_000010 is from an earlier run named 'r'; continue it "
                                                           r"with --resume .*--overwrite"):
        checkpoint.claim_run(run_dir, log_dir, resuming=False, overwrite=False)
    checkpoint.claim_run(run_dir, log_dir, resuming=True, overwrite=False).release()  # resuming is fine
    assert (run_dir / "step_000010").is_dir()
    checkpoint.claim_run(run_dir, log_dir, resuming=False, overwrite=True).release()
    assert not (run_dir / "step_000010").exists() and not list(log_dir.glob("events*"))


class Weights:
    """What checkpoint.save needs of a model: save_pretrained, and its adapter_settings (none)."""

    adapter_settings = None

    def __init__(self, value: str):
        self.value = value

    def save_pretrained(self, directory: Path) -> None:
        directory.mkdir()
        (directory / "model.safetensors").write_text(self.value)


def test_a_crash_between_the_two_renames_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    checkpoint.save(run_dir / "step_000002", Weights("old"), tmp_path, trainer_state={"step": 2})
    real_replace, calls = os.replace, []

    def crash_on_second_rename(source, destination):
        calls.append((source, destination))
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the renames")
        real_replace(source, destination)

    monkeypatch.setattr(checkpoint.os, "replace", crash_on_second_rename)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(run_dir / "step_000002", Weights("new"), tmp_path, trainer_state={"step": 2})
    monkeypatch.setattr(checkpoint.os, "replace", real_replace)
    assert not (run_dir / "step_000002").exists()  # only the hidden copies are left
    assert sorted(p.name.rsplit(".", 1)[0] for p in run_dir.iterdir()) == [".step_000002.old", ".step_000002.tmp"]

    checkpoint.claim_run(run_dir, tmp_path / "logs", resuming=True, overwrite=False).release()
    assert sorted(p.name for p in run_dir.iterdir()) == ["step_000002"]
    assert (run_dir / "step_000002" / "model.safetensors").read_text() == "old"
    assert checkpoint.find(run_dir) == run_dir / "step_000002"


def test_retention_keeps_the_newest_k_and_the_newest_resumable(tmp_path):
    for step in (1, 2, 3, 4, 5):
        checkpoint.save(tmp_path / f"step_{step:06d}", Weights(str(step)), tmp_path,
                        trainer_state={"step": step} if step <= 2 else None)
    checkpoint.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000002", "step_000004", "step_000005"]
    assert checkpoint.find(tmp_path) == tmp_path / "step_000002"
    checkpoint.prune(tmp_path, keep_last=None)
    assert len(list(tmp_path.glob("step_*"))) == 3


class SmallDisk:
    """shutil.disk_usage of a filesystem of `capacity` bytes that holds only the files under `directory`."""

    def __init__(self, directory: Path, capacity: int):
        self.directory, self.capacity = directory, capacity

    def __call__(self, path):
        used = sum(file.stat().st_size for file in self.directory.rglob("*") if file.is_file())
        return shutil._ntuple_diskusage(self.capacity, used, self.capacity - used)


def fake_steps(run_dir: Path, resumable: dict[int, bool]) -> None:
    """Checkpoints of 1,000 bytes each; resumable ones hold a trainer state."""
    for step, has_state in resumable.items():
        directory = run_dir / f"step_{step:06d}"
        directory.mkdir(parents=True)
        (directory / ("trainer_state.pt" if has_state else "model.safetensors")).write_bytes(b"x" * 1000)


@pytest.mark.parametrize("resumable, keep_last, capacity, deleted", [
    ({1: True, 2: True, 3: True}, 3, 10_000, []),  # room enough: pruning waits for the write
    ({1: True, 2: True, 3: True}, 3, 3_500, [1]),  # step 1 goes after the write anyway: it goes first
    ({1: True, 2: True, 3: True}, 1, 3_500, [1]),  # one deletion is room enough; step 2 waits
    ({1: True, 2: False, 3: False}, 1, 3_500, [2]),  # step 1 is the newest resumable, step 3 the newest
])
def test_a_checkpoint_makes_room_by_deleting_first_what_pruning_would(resumable, keep_last, capacity, deleted,
                                                                     tmp_path, monkeypatch):
    fake_steps(tmp_path, resumable)
    monkeypatch.setattr(checkpoint, "DISK_MARGIN_BYTES", 0)
    monkeypatch.setattr(shutil, "disk_usage", SmallDisk(tmp_path, capacity))
    assert checkpoint.make_room(tmp_path, "step_000004", 1000, keep_last) == [
        tmp_path / f"step_{step:06d}" for step in deleted]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [f"step_{s:06d}" for s in resumable if s not in deleted]


@pytest.mark.parametrize("resumable", [{1: True}, {1: True, 2: False}])
def test_without_room_the_newest_and_the_newest_resumable_stay_and_nothing_is_written(resumable, tmp_path,
                                                                                      monkeypatch):
    fake_steps(tmp_path, resumable)
    monkeypatch.setattr(checkpoint, "DISK_MARGIN_BYTES", 0)
    monkeypatch.setattr(shutil, "disk_usage", SmallDisk(tmp_path, 1000 * len(resumable) + 500))
    with pytest.raises(checkpoint.CheckpointError, match=r"not enough disk space for .*step_000003: it needs about "
                                                         r"0.00 GB .* nothing was written. Free space, or keep fewer"):
        checkpoint.make_room(tmp_path, "step_000003", 1000, keep_last=1)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [f"step_{s:06d}" for s in resumable]


def test_a_run_without_room_for_its_checkpoint_stops_before_writing_it(tmp_path, tiny_model_dir, countdown_dir,
                                                                       monkeypatch):
    """The size asked for is the checkpoint's: weights (tied ones once) and trainer state, as written."""
    config = tiny_config(tmp_path, tiny_model_dir, countdown_dir, "optim.num_steps=2", "checkpoint.interval=1",
                         "eval.interval=0")
    written = []
    real_make_room = checkpoint.make_room

    def make_room_then_fill(run_dir, new_step, needed_bytes, keep_last):
        real_make_room(run_dir, new_step, needed_bytes, keep_last)
        written.append(needed_bytes)
        if new_step == "step_000001":  # the first checkpoint fits; then the disk is full
            monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12, 0))

    monkeypatch.setattr(checkpoint, "make_room", make_room_then_fill)
    run_dir = tmp_path / "checkpoints" / "tiny"
    with pytest.raises(checkpoint.CheckpointError, match=rf"not enough disk space for {run_dir}/step_000002: .*"
                                                         rf"once it can be written, continue the run with --resume "
                                                         rf"{run_dir}$"):
        train.train(config)
    on_disk = sum(file.stat().st_size for file in (run_dir / "step_000001").iterdir()
                  if file.name in ("model.safetensors", "trainer_state.pt"))
    assert 0.95 * on_disk < written[0] <= on_disk
    assert sorted(p.name for p in run_dir.glob("step_*")) == ["step_000001"]


def test_truncated_checkpoint_files_are_named(tmp_path, tiny_model_dir):
    torch.save({"step": 3, "optimizer": {"x": torch.zeros(1000)}}, tmp_path / checkpoint.TRAINER_STATE)
    data = (tmp_path / checkpoint.TRAINER_STATE).read_bytes()
    (tmp_path / checkpoint.TRAINER_STATE).write_bytes(data[: len(data) // 2])
    with pytest.raises(checkpoint.CheckpointError, match=f"{tmp_path / checkpoint.TRAINER_STATE} cannot be read"):
        checkpoint.load_trainer_state(tmp_path)

    import shutil
    from runtime import ModelSetup, load_model
    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    weights = (model_dir / "model.safetensors").read_bytes()
    (model_dir / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(config_lib.DataError, match=f"{model_dir / 'model.safetensors'} cannot be read"):
        load_model(ModelSetup(dtype="float32"), torch.device("cpu"), model_dir)


def test_resume_writes_into_the_resumed_runs_directory_and_keeps_last(tmp_path, tiny_model_dir, countdown_dir,
                                                                      monkeypatch):
    monkeypatch.setattr(countdown_task, "reward", lambda response, item, end: {
        "reward": float(len(response) % 2), "reward_info": {"format_reward": 0.0, "answer_reward": 0.0}})
    config = tiny_config(tmp_path, tiny_model_dir, countdown_dir, "optim.num_steps=2", "checkpoint.interval=1",
                         "eval.interval=0")
    train.train(config)
    moved = tmp_path / "elsewhere" / "renamed"
    moved.parent.mkdir()
    (tmp_path / "checkpoints" / "tiny").rename(moved)
    resumed = tiny_config(tmp_path, tiny_model_dir, countdown_dir, "optim.num_steps=4", "checkpoint.interval=1",
                          "eval.interval=0", "checkpoint.keep_last=2", "checkpoint.optimizer_state=false")
    train.train(resumed, resume=str(moved))
    assert sorted(p.name for p in moved.iterdir()) == ["config.yaml", "finished", "step_000003", "step_000004"]
    assert not (moved / "step_000003" / checkpoint.TRAINER_STATE).exists()  # weights only between
    assert (moved / "step_000004" / checkpoint.TRAINER_STATE).is_file()
    assert not (tmp_path / "checkpoints" / "tiny").exists()
    assert list((tmp_path / "logs" / "renamed").glob("events.out.tfevents.*"))
    # A new run (no --resume) under the moved run's name refuses to mix into it.
    with pytest.raises(checkpoint.RunDirectoryError, match="from an earlier run named 'renamed'"):
        train.train(tiny_config(tmp_path, tiny_model_dir, countdown_dir, "run_name=renamed",
                                f"checkpoint.dir={moved.parent}"))


def test_bootstrap_builds_only_its_own_paths(tmp_path, tiny_model_dir, countdown_dir):
    demo = config_lib.load(train.TrainConfig, "configs/cpu_demo.yaml", [
        f"bootstrap.data_dir={tmp_path / 'data'}", f"bootstrap.model_dir={tmp_path / 'model'}",
        f"task.data_dir={countdown_dir}", f"model.dir={tmp_path / 'modle'}"])  # a typo in model.dir
    with pytest.raises(bootstrap.MissingInputError, match=r"model.dir: model directory '.*modle' does not exist\. "
                                                          r"Give a Hub id .* git clone https://huggingface.co/Qwen/"):
        train.plan_run(demo)
    demo.model.dir, demo.task.name, demo.task.data_dir = str(tiny_model_dir), "gsm8k", str(tmp_path / "data")
    with pytest.raises(bootstrap.MissingInputError, match="task.data_dir: GSM8K directory .* does not exist"):
        train.plan_run(demo)
    demo.task.name, demo.task.data_dir = "countdown", str(tmp_path / "typo")
    with pytest.raises(bootstrap.MissingInputError, match="countdown_task.py generate --out .*typo"):
        train.plan_run(demo)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    with pytest.raises(config_lib.ConfigError, match="bootstrap.model_dir: must name the directory that sft_config"):
        config_lib.load(train.TrainConfig, "configs/cpu_demo.yaml", ["bootstrap.model_dir=null"])


def test_train_reports_a_missing_model_in_one_line_before_creating_anything(tmp_path, tiny_model_dir, countdown_dir,
                                                                            capsys):
    config_path = tmp_path / "run.yaml"
    config_lib.dump(tiny_config(tmp_path, tmp_path / "no-model", countdown_dir), config_path)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--config", str(config_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith(f"missing input: model.dir: model directory '{tmp_path / 'no-model'}'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


def write_countdown(directory: Path, nums, target) -> Path:
    (directory / "data").mkdir(parents=True)
    pq.write_table(pa.table({"nums": [[1, 2]] * 3, "target": [3] * 3}), directory / "data" / "a.parquet")
    pq.write_table(pa.table({"nums": nums, "target": target}), directory / "data" / "b.parquet")
    return directory / "data" / "b.parquet"


@pytest.mark.parametrize("nums, target, message", [
    ([[1, 2], [3, 4]], ["3", "7"], r"b\.parquet: column `target` is string"),
    ([["1", "2"], ["3"]], [3, 7], r"b\.parquet: column `nums` is list<.*string>"),
    ([[1, 2], None], [3, 7], r"b\.parquet row 1: \{'nums': None, 'target': 7\}"),
    ([[1, 2], [3, None]], [3, 7], r"b\.parquet row 1: \{'nums': \[3, None\], 'target': 7\}"),
    ([[1, 2], []], [3, 7], r"b\.parquet row 1: \{'nums': \[\], 'target': 7\}"),
    ([[1, 2], [3, 4]], [3, None], r"b\.parquet row 1: \{'nums': \[3, 4\], 'target': None\}"),
])
def test_countdown_data_errors_name_file_and_row(nums, target, message, tmp_path):
    write_countdown(tmp_path, nums, target)
    with pytest.raises(config_lib.DataError, match=message):
        countdown_task.read_tasks(tmp_path)


def test_evaluate_needs_only_model_and_data(tmp_path, tiny_model_dir, countdown_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no config.yaml here, nor needed
    out = tmp_path / "samples.jsonl"
    evaluate.main(["--model", str(tiny_model_dir), "--data", str(countdown_dir), "--max-questions", "2",
                   "--threads", "1", "--set", "eval.max_gen_len=4", "--set", "task.test_size=4", "--out", str(out)])
    assert len(out.read_text().splitlines()) == 2
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("config_text, message", [
    ("optim:\n  learning_rate: 1.0e-5\n", "unknown key 'optim' in the top level"),
    ("model:\n  dir: x\n", "model.dir: evaluate.py takes the model from --model"),
    ("eval:\n  top_k: 3\n", "unknown key 'eval.top_k'"),
])
def test_evaluate_refuses_keys_it_would_ignore(config_text, message, tmp_path, tiny_model_dir, capsys):
    (tmp_path / "eval.yaml").write_text(config_text)
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(["--model", str(tiny_model_dir), "--data", "d", "--config", str(tmp_path / "eval.yaml")])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_progress_bars_only_on_a_terminal(tmp_path, tiny_model_dir, countdown_dir):
    """Redirected to a file, the log holds plain lines and no progress-bar redraws."""
    config_path = tmp_path / "run.yaml"
    config = tiny_config(tmp_path, tiny_model_dir, countdown_dir, "progress=true", "optim.num_steps=1")
    config_lib.dump(config, config_path)
    with open(tmp_path / "log.txt", "w") as log:
        subprocess.run([sys.executable, str(REPO_ROOT / "train.py"), "--config", str(config_path)], cwd=REPO_ROOT,
                       stdout=log, stderr=subprocess.STDOUT, timeout=300, check=True)
    text = (tmp_path / "log.txt").read_text()
    assert "step 1 | reward" in text and "\r" not in text and "it/s" not in text


def test_sigterm_or_kill_never_leaves_a_lock_held(tmp_path):
    holder = hold_lock(tmp_path / "run", tmp_path / "logs")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    checkpoint.claim_run(tmp_path / "run", tmp_path / "logs", False, False).release()


@pytest.mark.parametrize("text, message", [
    ('{"prompt": "a", "response": "b"}\n\n{"prompt": "a", "response": \n', r"pairs\.jsonl line 3: not JSON"),
    ('{"prompt": "a", "response": "b"}\n["a", "b"]\n', r"pairs\.jsonl line 2: every line must be a JSON object"),
    ('{"prompt": "a", "response": null}\n', r"pairs\.jsonl line 1: every line must be a JSON object"),
    ("\n\n", r"pairs\.jsonl: no pairs"),
])
def test_sft_jsonl_errors_name_file_and_line(text, message, tmp_path):
    import train_sft
    (tmp_path / "pairs.jsonl").write_text(text)
    with pytest.raises(config_lib.DataError, match=message):
        train_sft.read_pairs(tmp_path / "pairs.jsonl")


def test_prompt_and_answer_must_fit_the_models_positions(tmp_path, tiny_model_dir, countdown_dir, capsys):
    import json
    positions = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    config_path = tmp_path / "run.yaml"
    config_lib.dump(tiny_config(tmp_path, tiny_model_dir, countdown_dir, f"rollout.max_gen_len={positions}"), config_path)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--config", str(config_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (f"config error: rollout.max_prompt_len + rollout.max_gen_len: must be <= the "
                                       f"model's max_position_embeddings ({positions}), got {256 + positions}\n")
    assert not list(tmp_path.rglob("step_*")) and not list(tmp_path.rglob("events.out.tfevents.*"))


def test_sft_runs_of_one_name_never_share_a_log_directory(tmp_path, tiny_model_dir, countdown_dir, capsys):
    import train_sft
    log_dir = tmp_path / "logs" / "sft-x"
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "1 + 1 =", "response": " 2"}\n' * 4)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK.format(root=str(REPO_ROOT)), str(log_dir), str(log_dir)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    try:
        with pytest.raises(SystemExit) as exit_info:
            train_sft.main(["--config", "configs/cpu_demo_sft.yaml", f"--set=model.dir={tiny_model_dir}", "--set=run_name=sft-x",
                            f"--set=task.data_dir={countdown_dir}", f"--set=logging.log_dir={tmp_path / 'logs'}",
                            f"--set=output_dir={tmp_path / 'out'}", f"--set=checkpoint.dir={tmp_path / 'checkpoints'}",
                            f"--set=data.train_jsonl={tmp_path / 'pairs.jsonl'}",
                            f"--set=data.eval_jsonl={tmp_path / 'pairs.jsonl'}", "--set=optim.stop_at_success=null",
                            "--set=eval.interval=0"])
    finally:
        holder.stdin.close()
        holder.wait()
    assert exit_info.value.code == 2
    assert f"{log_dir.resolve()} is in use by process {holder.pid}" in capsys.readouterr().err


def test_a_first_signal_waits_for_the_step_a_second_stops_at_once(capsys):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers can only be set in the main thread")
    # Python's own Ctrl-C handler, as in a terminal (a shell starts background jobs with SIGINT ignored).
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with training_run.StopRequest() as stop:
            assert not stop.requested()
            os.kill(os.getpid(), signal.SIGINT)  # noted: the loop finishes its step, saves it, then stops
            assert stop.requested() and stop.signal == signal.SIGINT
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)  # the user insists: Python's own handler, at once
        assert signal.getsignal(signal.SIGTERM) != stop.handle  # the handlers are put back
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with training_run.StopRequest():
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # ignored (a background job): stays so
    finally:
        signal.signal(signal.SIGINT, outer)
    with pytest.raises(SystemExit) as exit_info:
        training_run.exit_on_interrupt(KeyboardInterrupt())
    assert exit_info.value.code == 130
    assert capsys.readouterr().err == ("interrupted: stopped at once, without saving; --resume continues from the last "
                                       "checkpoint, if any\n")


def test_an_inherited_ignored_sigint_is_said_once_with_what_still_stops_the_run(caplog, monkeypatch):
    monkeypatch.setattr(training_run.StopRequest, "warned_sigint_ignored", False)
    outer = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as `cmd &` in a script starts it
    try:
        with caplog.at_level(logging.WARNING, logger="training_run"):
            for _ in range(2):  # train.py's warm-up, then GRPO: one warning
                with training_run.StopRequest():
                    pass
    finally:
        signal.signal(signal.SIGINT, outer)
    warnings = [record.getMessage() for record in caplog.records if "SIGINT" in record.getMessage()]
    assert warnings == [f"Ctrl-C (SIGINT) is ignored by this process (started in the background by a script?); "
                        f"SIGTERM (kill {os.getpid()}) still stops the run cleanly after its current step"]


# ----------------------------------------------------------------------------- the SFT warm-up's runs


def warm_up_config(tmp_path, *overrides: str):
    return config_lib.load(train_sft.SFTConfig, "configs/cpu_demo_sft.yaml", [
        f"output_dir={tmp_path / 'out' / 'sft-model'}", f"checkpoint.dir={tmp_path / 'checkpoints'}",
        f"logging.log_dir={tmp_path / 'logs'}", *overrides])


def stopped_warm_up(tmp_path, name: str, *overrides: str) -> Path:
    """A warm-up stopped at step 3, as train_sft.py leaves it: a resumable checkpoint with its config."""
    step = tmp_path / "checkpoints" / name / "step_000003"
    step.mkdir(parents=True)
    config_lib.dump(warm_up_config(tmp_path, *overrides), step / checkpoint.RUN_CONFIG)
    (step / checkpoint.TRAINER_STATE).write_bytes(b"")
    return step


def test_a_warm_up_continues_only_its_own_stopped_run_and_never_reuses_another(tmp_path):
    base = "sft-" + str(tmp_path / "out" / "sft-model").strip("/").replace("/", "-")
    config = warm_up_config(tmp_path)
    assert bootstrap.warm_up_run(config) == (base, None)  # named after its output, whatever the YAML's name
    stopped = stopped_warm_up(tmp_path, base)
    assert bootstrap.warm_up_run(config) == (base, stopped)  # the same warm-up, stopped: it goes on
    assert bootstrap.warm_up_run(warm_up_config(tmp_path, "seed=1")) == (f"{base}-2", None)  # another seed
    assert bootstrap.warm_up_run(warm_up_config(tmp_path, f"model.dir={tmp_path}")) == (f"{base}-2", None)
    (stopped.parent / checkpoint.FINISHED).touch()  # it ended later: nothing is left to continue
    assert bootstrap.warm_up_run(config) == (f"{base}-2", None)
    (tmp_path / "logs" / f"{base}-2").mkdir(parents=True)
    (tmp_path / "logs" / f"{base}-2" / "events.out.tfevents.1").write_bytes(b"")  # curves of a killed one: kept
    assert bootstrap.warm_up_run(config) == (f"{base}-3", None)
    third = stopped_warm_up(tmp_path, f"{base}-3")
    assert bootstrap.warm_up_run(config) == (f"{base}-3", third)
    other = warm_up_config(tmp_path, f"output_dir={tmp_path / 'elsewhere'}")
    assert bootstrap.warm_up_run(other)[0] == "sft-" + str(tmp_path / "elsewhere").strip("/").replace("/", "-")


STOPPED_WARM_UP = """
import os, signal, sys
sys.path.insert(0, {root!r})
sys.argv[0] = "train.py"  # as `uv run train.py ...` runs it
import distributed, run_logging, train, train_sft
run_logging.PROGRESS_LINE_SECONDS = 0.0  # a progress line at every step
real_sft_step = train_sft.sft_step
def sft_step(*args, step, **kwargs):
    if step == 3:
        os.kill(os.getpid(), signal.SIGTERM)  # during the warm-up's third step
    return real_sft_step(*args, step=step, **kwargs)
train_sft.sft_step = sft_step
distributed.run_entry_point(train.main)
"""


@pytest.mark.slow
def test_a_warm_up_stopped_inside_train_py_names_the_users_command_and_that_command_finishes_it(tmp_path, caplog):
    demo = tmp_path / "demo.yaml"
    demo.write_text(f"""
model: {{dir: {tmp_path / 'sft-model'}}}
task: {{data_dir: {tmp_path / 'countdown'}, test_size: 16}}
rollout: {{episodes_per_step: 8, dynamic_sampling: false}}
optim: {{num_steps: 1}}
eval: {{interval: 0}}
checkpoint: {{dir: {tmp_path / 'checkpoints'}, interval: 0}}
logging: {{log_dir: {tmp_path / 'logs'}}}
progress: true
cpu_threads: 1
bootstrap:
  data_dir: {tmp_path / 'countdown'}
  model_dir: {tmp_path / 'sft-model'}
  dataset_args: --size 300 --min-numbers 2 --max-numbers 2 --max-number 20 --max-target 40 --with-solutions
  sft_overrides: [model.dir={tmp_path / 'base-model'}, checkpoint.dir={tmp_path / 'checkpoints'},
                  logging.log_dir={tmp_path / 'logs'}, optim.num_steps=6, optim.stop_at_success=null,
                  eval.interval=0, data.eval_size=16, cpu_threads=1]
""")
    command = ["--config", "configs/cpu_demo.yaml", "--config", str(demo)]
    stopped = subprocess.run([sys.executable, "-c", STOPPED_WARM_UP.format(root=str(REPO_ROOT)), *command],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert stopped.returncode == 143 and "Traceback" not in stopped.stderr, stopped.stderr
    [run] = (tmp_path / "checkpoints").glob("sft-*")
    assert run.name.endswith("-sft-model")
    lines = stopped.stderr.strip().splitlines()
    assert lines[-1] == (f"stopped by SIGTERM after step 3, saved in {run}/step_000003; continue with: uv run "
                         f"train.py {' '.join(command)} (the same command: it finishes the warm-up, then trains)")
    assert [line.split()[2] for line in lines if " sft: " in line][-1] == "3/6"  # the saved step, not one behind

    with caplog.at_level(logging.INFO):
        train.main(command)  # the user's command again: the warm-up goes on from step 3, then GRPO
    assert f"run {run.name}, continuing from {run}/step_000003" in caplog.text
    assert (tmp_path / "sft-model" / "model.safetensors").is_file() and checkpoint.is_finished(run)
    assert (tmp_path / "checkpoints" / "cpu-demo" / "step_000001").is_dir()
