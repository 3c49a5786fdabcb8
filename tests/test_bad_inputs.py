"""Every input a user can get wrong is refused with one line naming it and the fix, exit code 2, no traceback,
and nothing created (docs/errors.md lists these cases). The common mistakes are answered before torch loads:
those cases run with torch and the other heavy packages made unimportable."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import checkpoint
import config as config_lib
import tiny_model
import train
import train_sft
from test_config_errors import RUN_SCRIPT, run_without_heavy_packages
from test_train import countdown_dir, tiny_config  # noqa: F401 (fixture)

REPO_ROOT = Path(__file__).resolve().parents[1]


def files_under(directory: Path) -> list[str]:
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*"))


@pytest.fixture
def good(tmp_path, tiny_model_dir, countdown_dir) -> SimpleNamespace:
    """A model, CountDown data and a file, copied into tmp_path, for the cases to break."""
    return SimpleNamespace(tmp=tmp_path, model=Path(shutil.copytree(tiny_model_dir, tmp_path / "model")),
                           data=Path(shutil.copytree(countdown_dir, tmp_path / "data")),
                           file=(tmp_path / "a-file").resolve())


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def parquet_of(data_dir: Path) -> Path:
    return next((data_dir / "data").glob("*.parquet"))


def train_args(paths, *overrides: str) -> list[str]:
    """train.py on config.yaml with every path in tmp_path."""
    sets = [f"model.dir={paths.model}", f"task.data_dir={paths.data}", f"logging.log_dir={paths.tmp / 'logs'}",
            f"checkpoint.dir={paths.tmp / 'checkpoints'}", "device=cpu", *overrides]
    return ["train.py", *(argument for assignment in sets for argument in ("--set", assignment))]


def sft_args(paths, *overrides: str) -> list[str]:
    sets = [f"model.dir={paths.model}", f"task.data_dir={paths.data}", f"logging.log_dir={paths.tmp / 'logs'}",
            f"output_dir={paths.tmp / 'sft-out'}", f"checkpoint.dir={paths.tmp / 'checkpoints'}", "task.test_size=4",
            "data.eval_size=8", "device=cpu",
            "optim.stop_at_success=null", *overrides]
    return ["train_sft.py", "--config", "configs/cpu_demo_sft.yaml", *(a for s in sets for a in ("--set", s))]


def evaluate_args(paths, *extra: str) -> list[str]:
    return ["evaluate.py", "--model", str(paths.model), "--data", str(paths.data), "--set", "task.test_size=4", *extra]


def fake_run(run_dir: Path, config, steps: tuple[int, ...] = (1,)) -> Path:
    """A run directory as a trainer leaves it: config.yaml, and checkpoints with their config and a trainer state
    (not read before torch loads, so any bytes do)."""
    for directory in [run_dir] + [run_dir / f"step_{step:06d}" for step in steps]:
        directory.mkdir(parents=True)
        config_lib.dump(config, directory / "config.yaml")
    for step in steps:
        (run_dir / f"step_{step:06d}" / "trainer_state.pt").write_bytes(b"")
    return run_dir


def grpo_run(paths, *overrides: str) -> Path:
    """A GRPO run `r` of train_args(paths)'s config, with checkpoints at steps 1 and 2."""
    sets = [f"model.dir={paths.model}", f"task.data_dir={paths.data}", f"logging.log_dir={paths.tmp / 'logs'}",
            f"checkpoint.dir={paths.tmp / 'checkpoints'}", "device=cpu", "run_name=r", *overrides]
    return fake_run(paths.tmp / "checkpoints" / "r", config_lib.load(train.TrainConfig, "config.yaml", sets), (1, 2))


def sft_run(paths) -> Path:
    """An SFT run `s` of sft_args(paths)'s config that has written its model."""
    (paths.tmp / "sft-out").mkdir()
    sets = [s for s in sft_args(paths)[3:] if s != "--set"] + ["run_name=s"]
    return fake_run(paths.tmp / "checkpoints" / "s", config_lib.load(train_sft.SFTConfig, "configs/cpu_demo_sft.yaml",
                                                                     sets))


# (case, what breaks the input, the command, the start of the one line it must print). Each is answered before
# torch loads, so each runs in a subprocess that cannot import torch (fast: no torch to load).
BEFORE_TORCH = [
    ("learning rate inf", None, lambda p: train_args(p, "optim.learning_rate=inf"),
     "config error: optim.learning_rate: must be a finite number, got 'inf'"),
    ("seed beyond numpy's", None, lambda p: train_args(p, "seed=4294967296"),
     "config error: seed: must be in [0, 4294967295], got 4294967296"),
    ("100000 CPU threads", None, lambda p: train_args(p, "cpu_threads=100000"),
     "config error: cpu_threads: must be in [1, 1024], got 100000"),
    ("model directory missing", lambda p: shutil.rmtree(p.model), train_args,
     "missing input: model.dir: model directory '{model}' does not exist. Give a Hub id to download it at start-up"),
    ("model directory a file", lambda p: write(p.file, ""), lambda p: train_args(p, f"model.dir={p.file}"),
     "missing input: model.dir: model directory '{file}' is a file, not a directory: pass the directory that holds "
     "config.json and the weights, or a Hub id"),
    ("--config a directory", None, lambda p: ["train.py", "--config", str(p.tmp)],
     "config error: config file '{tmp}' is a directory; pass a YAML file in it, e.g. '{tmp}/config.yaml'"),
    ("model without config.json", lambda p: (p.model / "config.json").unlink(), train_args,
     "missing input: model.dir: '{model}' has no config.json, so it is not a Hugging Face model directory"),
    ("config.json not JSON", lambda p: write(p.model / "config.json", "{model_type: qwen2"), train_args,
     "data error: model.dir: {model}/config.json is not JSON"),
    ("model without weights", lambda p: (p.model / "model.safetensors").unlink(), train_args,
     "missing input: model.dir: Weight file '{model}/model.safetensors' is missing"),
    ("weights a Git LFS pointer", lambda p: write(p.model / "model.safetensors", "version https://git-lfs"),
     train_args, "data error: model.dir: '{model}/model.safetensors' is a git-lfs pointer"),
    ("model without tokenizer.json", lambda p: (p.model / "tokenizer.json").unlink(), train_args,
     "missing input: model.dir: '{model}/tokenizer.json' is missing"),
    ("data directory missing", lambda p: shutil.rmtree(p.data), train_args,
     "missing input: task.data_dir: No CountDown data in {data}: expected parquet files at {data}/data/*.parquet. "
     "Set task.data_dir to the Hub id"),
    ("data directory empty", lambda p: shutil.rmtree(p.data / "data"), train_args,
     "missing input: task.data_dir: No CountDown data in {data}"),
    ("parquet truncated", lambda p: truncate(parquet_of(p.data)), train_args,
     "data error: task.data_dir: {data}/data/train-00000-of-00001.parquet is truncated"),
    ("parquet a Git LFS pointer", lambda p: write(parquet_of(p.data), "version https://git-lfs"), train_args,
     "data error: task.data_dir: {data}/data/train-00000-of-00001.parquet is not a parquet file (a Git LFS pointer?)"),
    ("GSM8K without a test split", lambda p: write(p.tmp / "gsm8k" / "train.jsonl", "{}\n"),
     lambda p: train_args(p, "task.name=gsm8k", f"task.data_dir={p.tmp / 'gsm8k'}"),
     "missing input: task.data_dir: GSM8K directory {tmp}/gsm8k has neither test.jsonl or main/test-00000"),
    ("prompt + answer beyond the model's positions", None, lambda p: train_args(p, "rollout.max_gen_len=100000"),
     "config error: rollout.max_prompt_len + rollout.max_gen_len: must be <= the model's max_position_embeddings"),
    ("log directory under a file", lambda p: write(p.file, ""),
     lambda p: train_args(p, f"logging.log_dir={p.file}/logs", "run_name=r"),
     "config error: logging.log_dir: cannot create {file}/logs/r: {file} is not a directory"),
    ("checkpoint directory under a file", lambda p: write(p.file, ""),
     lambda p: train_args(p, f"checkpoint.dir={p.file}/ckpt", "run_name=r"),
     "config error: checkpoint.dir: cannot create {file}/ckpt/r: {file} is not a directory"),
    ("--resume of a typo", None, lambda p: [*train_args(p), "--resume", str(p.tmp / "checkpoints" / "typo")],
     "checkpoint error: --resume {tmp}/checkpoints/typo: no such directory"),
    ("--resume of a directory that is no run", None, lambda p: [*train_args(p), "--resume", str(p.data)],
     "checkpoint error: --resume {data}: not a run directory"),
    ("--resume of an SFT run to train.py", sft_run, lambda p: ["train.py", "--resume", str(p.tmp / "checkpoints" / "s")],
     "checkpoint error: --resume {tmp}/checkpoints/s is a run of train_sft.py, not of train.py: continue it with "
     "`uv run train_sft.py --resume {tmp}/checkpoints/s`, or train GRPO from the model it wrote"),
    ("--resume of a GRPO run to train_sft.py", grpo_run,
     lambda p: ["train_sft.py", "--resume", str(p.tmp / "checkpoints" / "r")],
     "checkpoint error: --resume {tmp}/checkpoints/r is a run of train.py, not of train_sft.py: continue it with "
     "`uv run train.py --resume {tmp}/checkpoints/r`, or fine-tune one of its checkpoints"),
    ("--resume with another seed", grpo_run,
     lambda p: [*train_args(p, "seed=7"), "--resume", str(p.tmp / "checkpoints" / "r")],
     "run directory error: --resume {tmp}/checkpoints/r: {tmp}/checkpoints/r/step_000002 was made by another run than "
     "this start asks for: seed 7 (the run's: 1337). A run continues only from its own state: drop the change to "
     "continue it, start a new run under another name (--set run_name=NAME), or start this one over with --overwrite"),
    ("--resume with another model", lambda p: (grpo_run(p), shutil.copytree(p.model, p.tmp / "other")),
     lambda p: [*train_args(p, f"model.dir={p.tmp / 'other'}"), "--resume", str(p.tmp / "checkpoints" / "r")],
     "run directory error: --resume {tmp}/checkpoints/r: {tmp}/checkpoints/r/step_000002 was made by another run than "
     "this start asks for: model.dir '{tmp}/other' (the run's: '{model}')"),
    ("--resume of an SFT run with another search budget", sft_run,
     lambda p: [*sft_args(p, "run_name=s", "data.search_max_tokens=160"), "--resume", str(p.tmp / "checkpoints" / "s")],
     "run directory error: --resume {tmp}/checkpoints/s: {tmp}/checkpoints/s/step_000001 was made by another run than "
     "this start asks for: data.search_max_tokens 160 (the run's: None)"),
    ("model.dir a run directory", grpo_run, lambda p: train_args(p, f"model.dir={p.tmp / 'checkpoints' / 'r'}"),
     "missing input: model.dir: {tmp}/checkpoints/r is the directory of the run 'r', not a model: pass one of its "
     "checkpoints, e.g. its newest, {tmp}/checkpoints/r/step_000002\n"),
    ("evaluate a run directory", grpo_run, lambda p: ["evaluate.py", "--model", str(p.tmp / "checkpoints" / "r")],
     "missing input: --model {tmp}/checkpoints/r is the directory of the run 'r', not a model: pass one of its "
     "checkpoints, e.g. its newest, --model {tmp}/checkpoints/r/step_000002\n"),
    ("evaluate an SFT run directory", sft_run, lambda p: ["evaluate.py", "--model", str(p.tmp / "checkpoints" / "s")],
     "missing input: --model {tmp}/checkpoints/s is the directory of the run 's', not a model: pass one of its "
     "checkpoints, e.g. its newest, --model {tmp}/checkpoints/s/step_000001, or the model the warm-up wrote, "
     "--model {tmp}/sft-out\n"),
    ("evaluate a run directory without checkpoints", lambda p: fake_run(p.tmp / "r", config_lib.load(
        train.TrainConfig, "config.yaml"), ()), lambda p: ["evaluate.py", "--model", str(p.tmp / "r")],
     "missing input: --model {tmp}/r is the directory of the run 'r', not a model, and it holds no checkpoint yet "
     "(pass a Hugging Face model directory)\n"),
    ("SFT data missing: the hint generates solutions", lambda p: shutil.rmtree(p.data), sft_args,
     "missing input: task.data_dir: No CountDown data in {data}: expected parquet files at {data}/data/*.parquet. "
     "SFT learns from reference solutions: generate data with them, `uv run countdown_task.py generate --out {data} "
     "--size 100000 --seed 0 --with-solutions`."),
    ("SFT pairs file missing", None, lambda p: sft_args(p, f"data.train_jsonl={p.tmp / 'pairs.jsonl'}"),
     "missing input: data.train_jsonl: SFT data file '{tmp}/pairs.jsonl' does not exist"),
    ("SFT pairs line not JSON", lambda p: write(p.tmp / "pairs.jsonl", '{"prompt": "a", "response": "b"}\n{"prompt"\n'),
     lambda p: sft_args(p, f"data.train_jsonl={p.tmp / 'pairs.jsonl'}"),
     "data error: data.train_jsonl: {tmp}/pairs.jsonl line 2: not JSON"),
    ("SFT output under a file", lambda p: write(p.file, ""), lambda p: sft_args(p, f"output_dir={p.file}/out"),
     "config error: output_dir: cannot create {file}/out: {file} is not a directory"),
    ("task module missing", None, lambda p: train_args(p, "task.name=my_tasks.sudoku"),
     "config error: task.name: no such module: put your task module where Python finds it (the repository root, "
     "or a directory on PYTHONPATH) and name it by its import path, got 'my_tasks.sudoku'\n"),
    ("task name not an import path", None, lambda p: train_args(p, "task.name=count-down"),
     "config error: task.name: must be countdown or gsm8k, or the import path of a task module (e.g. "
     "my_tasks.sudoku), got 'count-down'\n"),
    ("task module without the interface", None, lambda p: train_args(p, "task.name=json"),
     "config error: task.name: the module json ("),
    ("task module failing on import", None, lambda p: train_args(p, "task.name=tests.fixtures.tasks.fails_on_import"),
     "config error: task.name: importing tests.fixtures.tasks.fails_on_import failed: RuntimeError: the sudoku grid "
     "file is missing\n"),
    ("SFT on a task module without sft_response", None,
     lambda p: sft_args(p, "task.name=tests.fixtures.tasks.no_sft_response", "data.response=solution"),
     "config error: task.name: SFT learns the task's reference responses and this module has no sft_response(item): "
     "add one, or give pairs in data.train_jsonl, got 'tests.fixtures.tasks.no_sft_response'\n"),
    ("demo warm-up unfit for the task", None,  # the demo's SFT writes CountDown's search responses
     lambda p: ["train.py", "--config", "configs/cpu_demo.yaml", *train_args(p, f"model.dir={p.tmp / 'sft'}",
                f"bootstrap.model_dir={p.tmp / 'sft'}", "task.name=tests.fixtures.tasks.no_sft_response",
                "loss.try_reward_weight=0")[1:]],
     "config error: bootstrap.sft_config: the warm-up configs/cpu_demo_sft.yaml on task.name "
     "'tests.fixtures.tasks.no_sft_response': data.response: 'search' is a CountDown response; task.name "
     "'tests.fixtures.tasks.no_sft_response' has 'solution' only, got 'search'; change the warm-up with "
     "bootstrap.sft_overrides\n"),
    ("evaluate a model without config.json", lambda p: (p.model / "config.json").unlink(), evaluate_args,
     "missing input: model.dir: '{model}' has no config.json"),
    ("evaluate on missing data", lambda p: shutil.rmtree(p.data), evaluate_args,
     "missing input: task.data_dir: No CountDown data in {data}"),
    ("evaluate into a file's directory", lambda p: write(p.file, ""),
     lambda p: evaluate_args(p, "--out", f"{p.file}/samples.jsonl"),
     "config error: --out: cannot create {file}: {file} is not a directory"),
]


def check_refused(result: subprocess.CompletedProcess, expected: str) -> None:
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr.startswith(expected) and result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize("case, breakage, command, expected", BEFORE_TORCH, ids=[case[0] for case in BEFORE_TORCH])
def test_bad_input_is_refused_before_torch_loads_and_creates_nothing(case, breakage, command, expected, good):
    if breakage:
        breakage(good)
    before = files_under(good.tmp)
    result = run_without_heavy_packages(RUN_SCRIPT, *command(good))
    check_refused(result, expected.format(**vars(good)))
    assert files_under(good.tmp) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_log_directory_is_refused_before_torch_loads(good):
    (good.tmp / "logs").mkdir(mode=0o555)
    result = run_without_heavy_packages(RUN_SCRIPT, *train_args(good))
    check_refused(result, f"config error: logging.log_dir: cannot write into {good.tmp / 'logs'} (read-only")


# ----------------------------------------------------------------------------- after torch, before any work


def garble(path: Path) -> None:
    """Overwrite the middle of a parquet file, keeping its first and last bytes: only reading the rows finds it."""
    data = bytearray(path.read_bytes())
    data[len(data) // 4 : len(data) // 2] = b"\xab" * (len(data) // 2 - len(data) // 4)
    path.write_bytes(bytes(data))


def gsm8k_with_a_bad_line(directory: Path) -> Path:
    good_line = json.dumps({"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"})
    write(directory / "test.jsonl", good_line + "\n")
    write(directory / "train.jsonl", f"{good_line}\n{{'question': 1\n")
    return directory


def run_with_other_weights(paths) -> None:
    """A finished run `tiny` whose last checkpoint's weights were replaced by a model of another shape."""
    train.train(tiny_config(paths.tmp, paths.model, paths.data, "optim.num_steps=1", "eval.interval=0",
                            "checkpoint.interval=0"))
    other = tiny_model.build_tiny_model(paths.tmp / "other", seed=1, num_hidden_layers=1)
    for name in ("model.safetensors", "config.json"):
        shutil.copy(other / name, paths.tmp / "checkpoints" / "tiny" / "step_000001" / name)
    shutil.rmtree(other)


# (case, what breaks the input, the entry point's main and its arguments, the line it must print). These need
# torch (the device, the tokenizer, the rows); each runs in-process, as `main` does it.
AFTER_TORCH = [
    ("device cuda without a GPU", None, lambda p: (train.main, train_args(p, "device=cuda")[1:]),
     "config error: device: cuda was requested but CUDA is not usable: no NVIDIA driver is loaded (no "
     "/proc/driver/nvidia/version), so no GPU is visible; on a machine without a GPU, run the CPU demo: uv run "
     "train.py --config configs/cpu_demo.yaml\n"),
    ("no prompt fits rollout.max_prompt_len", None,
     lambda p: (train.main, train_args(p, "rollout.max_prompt_len=5", "task.test_size=4")[1:]),
     "config error: rollout.max_prompt_len: none of the first 64 training prompts fits (the shortest has "),
    ("parquet damaged inside", lambda p: garble(parquet_of(p.data)),
     lambda p: (train.main, train_args(p, "task.test_size=4")[1:]),
     "data error: {data}/data/train-00000-of-00001.parquet cannot be read ("),
    ("GSM8K line not JSON", lambda p: gsm8k_with_a_bad_line(p.tmp / "gsm8k"),
     lambda p: (train.main, train_args(p, "task.name=gsm8k", f"task.data_dir={p.tmp / 'gsm8k'}")[1:]),
     "data error: {tmp}/gsm8k/train.jsonl:2: not valid JSON"),
    ("tokenizer.json damaged", lambda p: write(p.model / "tokenizer.json", "{"),
     lambda p: (train.main, train_args(p, "task.test_size=4")[1:]),
     "data error: {model}/tokenizer.json cannot be read ("),
    ("checkpoint's weights replaced", run_with_other_weights,
     lambda p: (train.main, ["--resume", str(p.tmp / "checkpoints" / "tiny")]),
     "checkpoint error: {tmp}/checkpoints/tiny/step_000001: its optimizer state does not fit its weights ("),
    ("SFT max_seq_len no pair fits",
     lambda p: write(p.tmp / "pairs.jsonl", '{"prompt": "1 + 1 =", "response": " 2"}\n' * 4),
     lambda p: (train_sft.main, sft_args(p, "data.max_seq_len=2", f"data.train_jsonl={p.tmp / 'pairs.jsonl'}",
                                         f"data.eval_jsonl={p.tmp / 'pairs.jsonl'}")[1:]),
     "config error: data.max_seq_len: no SFT example fits (the shortest has "),
    ("SFT on CountDown data without solutions", None,  # the search response writes its own; solutions need the column
     lambda p: (train_sft.main, sft_args(p, "data.response=solution")[1:]),
     "data error: task.data_dir: {data} holds no reference solutions (no `solution` column). SFT learns from "
     "reference solutions: generate data with them, `uv run countdown_task.py generate --out {data} --size 100000 "
     "--seed 0 --with-solutions`\n"),
]


@pytest.mark.parametrize("case, breakage, command, expected", AFTER_TORCH, ids=[case[0] for case in AFTER_TORCH])
def test_bad_input_found_while_loading_is_refused_and_creates_nothing(case, breakage, command, expected, good,
                                                                      monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU
    if breakage:
        breakage(good)
    before = files_under(good.tmp)
    main, arguments = command(good)
    with pytest.raises(SystemExit) as exit_info:
        main(arguments)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith(expected.format(**vars(good))) and err.count("\n") == 1, err
    assert files_under(good.tmp) == before  # no .lock, no run or log directory


# ----------------------------------------------------------------------------- during a run

# train.py in its own process, after `patch` (Python code) has run: the process ends as a real one would.
PATCHED_TRAIN = """
import sys
sys.path.insert(0, {root!r})
{patch}
import distributed, train
distributed.run_entry_point(train.main)
"""
DISK_FULL_ON_THE_SECOND_CHECKPOINT = """
import errno, os, torch
real_save, saves = torch.save, []
def save(state, path, *args, **kwargs):
    saves.append(path)
    if len(saves) == 2:  # trainer_state.pt of step 2: half written, then the disk is full
        open(path, "wb").write(b"half a file")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    real_save(state, path, *args, **kwargs)
torch.save = save
"""
KILLED_AFTER_THE_FIRST_STEP = """
import os, signal, train
real_log_step = train.log_step
def log_step(*args, **kwargs):
    real_log_step(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)  # kill -9: no handler runs, the step's log is on disk
train.log_step = log_step
"""


def run_patched_train(patch: str, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PATCHED_TRAIN.format(root=str(REPO_ROOT), patch=patch), *arguments],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_run_resumes(good):
    config_path = good.tmp / "run.yaml"
    config_lib.dump(tiny_config(good.tmp, good.model, good.data, "optim.num_steps=3", "checkpoint.interval=1",
                                "eval.interval=0"), config_path)
    result = run_patched_train(DISK_FULL_ON_THE_SECOND_CHECKPOINT, "--config", str(config_path))
    run_dir = good.tmp / "checkpoints" / "tiny"
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines()[-1] == (  # after the run's own log lines
        f"checkpoint error: could not write {run_dir / 'step_000002'}: disk full (no space left on the filesystem of "
        f"{run_dir}); the partial copy is removed and earlier checkpoints are intact; once it can be written, "
        f"continue the run with --resume {run_dir}")
    # No staging copy left to fill the disk (the .lock file stays, its lock released with the process).
    assert sorted(path.name for path in run_dir.iterdir()) == [".lock", "config.yaml", "step_000001"]
    assert checkpoint.load_trainer_state(run_dir / "step_000001")["step"] == 1  # the last good one, whole

    train.main(["--resume", str(run_dir)])  # space again: the run goes on from step 1
    assert sorted(path.name for path in run_dir.glob("step_*")) == ["step_000001", "step_000002", "step_000003"]
    assert checkpoint.load_trainer_state(run_dir / "step_000003")["step"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("resume", [False, True], ids=["rerun", "--resume"])
def test_a_run_killed_before_its_first_checkpoint_starts_over(resume, good, caplog):
    config_path = good.tmp / "run.yaml"
    config_lib.dump(tiny_config(good.tmp, good.model, good.data, "optim.num_steps=2", "eval.interval=0"), config_path)
    killed = run_patched_train(KILLED_AFTER_THE_FIRST_STEP, "--config", str(config_path))
    run_dir, log_dir = good.tmp / "checkpoints" / "tiny", good.tmp / "logs" / "tiny"
    assert killed.returncode == -9 and "step 1 | reward" in killed.stderr
    assert not list(run_dir.glob("step_*")) and list(log_dir.glob("events.out.tfevents.*"))

    train.main(["--resume", str(run_dir)] if resume else ["--config", str(config_path)])  # no --overwrite needed
    assert "stopped before its first checkpoint, so it holds nothing to resume: starting it over (its logs are " \
           f"kept in {log_dir}/earlier-" in caplog.text
    assert sorted(path.name for path in run_dir.glob("step_*")) == ["step_000002"]
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1  # the new curves alone, not mixed with the old
    assert len(list(log_dir.glob("earlier-*/events.out.tfevents.*"))) == 1  # the old ones kept beside them


# ----------------------------------------------------------------------------- documented commands


@pytest.mark.slow
@pytest.mark.parametrize("bench", ["memory_plan", "gsm8k_grader"])  # bench.report, tests.fixtures: from the root
def test_benches_run_as_files_too(bench):
    """`uv run bench/X.py` as well as `python -m bench.X` (it stopped with No module named 'bench')."""
    result = subprocess.run([sys.executable, f"bench/{bench}.py", "--help"], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=300)
    assert (result.returncode, result.stderr) == (0, "") and result.stdout.startswith("usage:"), result.stderr


@pytest.mark.parametrize("nvidia_smi", ["missing", "no GPU"])
def test_gpu_bench_without_a_gpu_says_so_and_creates_nothing(nvidia_smi, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(shutil.which("dirname"), bin_dir / "dirname")
    if nvidia_smi == "no GPU":  # what nvidia-smi does on a machine with the driver but no device
        write(bin_dir / "nvidia-smi", "#!/bin/sh\necho 'No devices were found'\nexit 6\n").chmod(0o755)
    result = subprocess.run([shutil.which("bash"), str(REPO_ROOT / "bench" / "gpu.sh")], capture_output=True, text=True, timeout=60,
                            env={"PATH": str(bin_dir), "OUT": str(tmp_path / "out")})
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == ("bench/gpu.sh needs an NVIDIA GPU and nvidia-smi finds none here; DRY_RUN=1 bash "
                             "bench/gpu.sh runs the same commands on the CPU at toy sizes\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bin"]


# ----------------------------------------------------------------------------- a GPU asked for where none is usable


@pytest.mark.parametrize("config_file", ["config.yaml", "config_24GB.yaml"])
def test_a_gpu_config_without_a_usable_gpu_says_why_before_fetching_anything(config_file, tmp_path, monkeypatch,
                                                                            capsys):
    import hub
    import runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU, on any machine
    monkeypatch.setattr(torch.version, "cuda", "13.2")
    monkeypatch.setattr(runtime, "nvidia_driver_version", lambda: None)
    fetched = []
    monkeypatch.setattr(hub, "local_dir", lambda name, **kwargs: fetched.append(name) or name)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--config", config_file, "--set", f"checkpoint.dir={tmp_path / 'c'}",
                    "--set", f"logging.log_dir={tmp_path / 'l'}"])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in error
    assert error.startswith("config error: device: cuda was requested but CUDA is not usable: ")
    assert error.rstrip().endswith("no GPU is visible; on a machine without a GPU, run the CPU demo: uv run train.py "
                                   "--config configs/cpu_demo.yaml")
    assert fetched == [] and list(tmp_path.iterdir()) == []  # the Qwen2.5-3B download never started


@pytest.mark.parametrize("built_for, driver, visible, reason", [
    (None, None, None, "this torch ({version}) is built without CUDA; `uv sync --locked` installs the locked one"),
    ("13.0", None, None, "no NVIDIA driver is loaded (no /proc/driver/nvidia/version), so no GPU is visible; on a "
                         "machine without a GPU, run the CPU demo: uv run train.py --config configs/cpu_demo.yaml"),
    ("13.0", "575.57.08", None, "the NVIDIA driver is 575.57.08, and this torch ({version}, built for CUDA 13.0) "
                                "needs a driver >= 580: update the driver (docs/gpu.md)"),
    ("12.8", "525.60.13", "", "CUDA_VISIBLE_DEVICES='' may hide the GPUs from this process"),
    ("12.8", "575.57.08", None, "the NVIDIA driver 575.57.08 is new enough for CUDA 12.8, but torch finds no GPU"),
])
def test_why_cuda_is_not_usable_names_both_versions_and_the_way_out(built_for, driver, visible, reason,
                                                                   monkeypatch):
    import runtime

    monkeypatch.setattr(torch.version, "cuda", built_for)
    monkeypatch.setattr(runtime, "nvidia_driver_version", lambda: driver)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert runtime.cuda_unusable_reason().startswith(reason.format(version=torch.__version__))


@pytest.mark.parametrize("text, version", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\nGCC version: 12",
     "535.104.05"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16)  "
     "Tue Jul 15 2025\n", "580.65.06"),
    (None, None),
])
def test_the_driver_version_is_read_from_the_kernel_module(text, version, tmp_path):
    import runtime

    version_file = tmp_path / "version"
    if text is not None:
        version_file.write_text(text)
    assert runtime.nvidia_driver_version(version_file) == version
