"""Every bad config value stops the entry point with `config error: <key>: ...`, exit code 2, before any work."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import ablate
import checkpoint
import config as config_lib
import train
import train_sft

REPO_ROOT = Path(__file__).resolve().parents[1]

# (override, the message's start); each would otherwise train silently wrong or crash later.
BAD_TRAIN_VALUES = [
    ("rollout.max_decode_rows=4", "rollout.max_decode_rows: must be >= num_answers_per_question (8): a question's "
                                  "answers decode together, on its prompt's cache, got 4"),
    ("optim.master_weights=float16", "optim.master_weights: 'float16' is not allowed; use one of 'float32'"),
    ("model.lora.rank=0", "model.lora.rank: must be >= 1, got 0"),
    ("model.lora.layers=[embed_tokens]", "model.lora.layers: must be distinct names among q_proj"),
    ("optim.max_grad_norm=-1", "optim.max_grad_norm: must be in (0, 10000], got -1.0"),
    ("optim.max_grad_norm=0", "optim.max_grad_norm: must be in (0, 10000], got 0.0"),
    ("loss.try_reward_weight=1.5", "loss.try_reward_weight: must be in [0, 1], got 1.5"),
    ("loss.try_reward_weight=-0.1", "loss.try_reward_weight: must be in [0, 1], got -0.1"),
    ("loss.advantage_eps=-1", "loss.advantage_eps: must be in (0, 1], got -1.0"),
    ("rollout.temperature=0", "rollout.temperature: must be in (0, 10], got 0.0"),
    ("checkpoint.interval=-1", "checkpoint.interval: must be >= 0, got -1"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last: must be >= 1, got 0"),
    ("eval.interval=-1", "eval.interval: must be >= 0, got -1"),
    ("eval.max_questions=0", "eval.max_questions: must be >= 1 or null (all); eval.interval: 0 turns evaluation off, got 0"),
    ("eval.max_questions=-1", "eval.max_questions: must be >= 0, got -1"),
    ("logging.num_samples=-1", "logging.num_samples: must be >= 0, got -1"),
    ("logging.sample_interval=-2", "logging.sample_interval: must be >= 0, got -2"),
    ("run_name=../x", "run_name: must be a plain name"),
    ("run_name=a/b", "run_name: must be a plain name"),
    ("run_name=..", "run_name: must be a plain name"),
    ("loss.clip_range=2", "loss.clip_range: must be in (0, 1), got 2.0"),
    ("loss.epochs_per_rollout=0", "loss.epochs_per_rollout: must be >= 1, got 0"),
    ("loss.aggregation_constant=0", "loss.aggregation_constant: must be >= 1, got 0"),
    ("rollout.num_answers_per_question=0", "rollout.num_answers_per_question: must be >= 1, got 0"),
    ("rollout.episodes_per_step=0", "rollout.episodes_per_step: must be >= 1, got 0"),
    ("rollout.max_prompt_len=0", "rollout.max_prompt_len: must be >= 1, got 0"),
    ("rollout.max_gen_len=0", "rollout.max_gen_len: must be >= 1, got 0"),
    ("rollout.top_p=2", "rollout.top_p: must be in (0, 1], got 2.0"),
    ("rollout.top_p=0", "rollout.top_p: must be in (0, 1], got 0.0"),
    ("optim.learning_rate=-1", "optim.learning_rate: must be in (0, 1], got -1.0"),
    ("optim.betas=[1.5,-1]", "optim.betas: each must be in [0, 1), got [1.5, -1.0]"),
    ("optim.eps=0", "optim.eps: must be in (0, 1), got 0.0"),
    ("optim.weight_decay=-0.1", "optim.weight_decay: must be in [0, 1], got -0.1"),
    ("optim.logprob_chunk_size=0", "optim.logprob_chunk_size: must be >= 1, got 0"),
    ("optim.num_steps=0", "optim.num_steps: must be >= 1, got 0"),
    ("optim.micro_batch_size=0", "optim.micro_batch_size: must be >= 1, got 0"),
    ("eval.batch_size=0", "eval.batch_size: must be >= 1, got 0"),
    ("eval.num_samples=0", "eval.num_samples: must be >= 1, got 0"),
    ("eval.temperature=-1", "eval.temperature: must be in [0, 10], got -1.0"),
    ("eval.top_p=1.5", "eval.top_p: must be in (0, 1], got 1.5"),
    ("eval.max_gen_len=0", "eval.max_gen_len: must be >= 1, got 0"),
    ("task.test_size=0", "task.test_size: must be >= 1, got 0"),
    ("rollout.outside_forms_repeat=0", "rollout.outside_forms_repeat: must be in [1, 100], got 0"),
    ("rollout.outside_forms_numbers=[3,5]", "rollout.outside_forms_numbers: must be number counts among [2, 3, 4], "
     "got [3, 5]"),
    ("rollout.outside_forms_numbers=[]", "rollout.outside_forms_numbers: must be number counts among [2, 3, 4], got []"),
    ("rollout.train_number_counts=[]", "rollout.train_number_counts: must be null (every question) or a non-empty list "
     "of number counts >= 1, got []"),
    ("rollout.train_number_counts=[0,3]", "rollout.train_number_counts: must be null (every question) or a non-empty "
     "list of number counts >= 1, got [0, 3]"),
    ("task.data_dir=''", "task.data_dir: must be a non-empty path"),
    ("model.dir=''", "model.dir: must be a non-empty path"),
    ("cpu_threads=0", "cpu_threads: must be in [1, 1024], got 0"),
    ("device=tpu", "device: must be auto, cpu, cuda, cuda:N or mps, got 'tpu'"),
    ("device=cuda:x", "device: must be auto, cpu, cuda, cuda:N or mps, got 'cuda:x'"),
    ("seed=-1", "seed: must be in [0, 4294967295], got -1"),
    ("optim.max_grad_norm=.nan", "optim.max_grad_norm: must be a finite number, got nan"),
    # Accepted before, then ruined the run (NaN weights, a crash at step 2) or the machine.
    ("optim.learning_rate=inf", "optim.learning_rate: must be a finite number, got 'inf'"),
    ("optim.learning_rate=.inf", "optim.learning_rate: must be a finite number, got inf"),
    ("loss.kl_beta=1e999", "loss.kl_beta: must be a finite number, got '1e999'"),
    ("loss.kl_beta=100", "loss.kl_beta: must be in [0, 10], got 100.0"),
    ("optim.max_grad_norm=inf", "optim.max_grad_norm: must be a finite number, got 'inf'"),
    ("optim.weight_decay=1e300", "optim.weight_decay: must be in [0, 1], got 1e+300"),
    ("optim.eps=inf", "optim.eps: must be a finite number, got 'inf'"),
    ("optim.betas=[0.9,.nan]", "optim.betas: must be a finite number, got nan"),
    ("optim.learning_rate=" + "9" * 400, "optim.learning_rate: must be a finite number, got 9999"),  # beyond float
    ("eval.temperature=inf", "eval.temperature: must be a finite number, got 'inf'"),
    ("rollout.temperature=1e6", "rollout.temperature: must be in (0, 10], got 1000000.0"),
    ("loss.overlong_penalty_factor=inf", "loss.overlong_penalty_factor: must be a finite number, got 'inf'"),
    ("loss.advantage_eps=5", "loss.advantage_eps: must be in (0, 1], got 5.0"),
    ("cpu_threads=100000", "cpu_threads: must be in [1, 1024], got 100000"),
    ("seed=4294967296", "seed: must be in [0, 4294967295], got 4294967296"),  # numpy's seed range,
]


def isolated_overrides(tmp_path: Path) -> list[str]:
    """Every path of the CPU demo moved into tmp_path, so 'nothing was created' is checkable."""
    return [f"--set={key}={tmp_path / name}" for key, name in (
        ("task.data_dir", "data"), ("model.dir", "model"), ("logging.log_dir", "logs"), ("checkpoint.dir", "ckpt"),
        ("bootstrap.data_dir", "data"), ("bootstrap.model_dir", "model"))]


def run_main(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("override, message", BAD_TRAIN_VALUES)
def test_bad_training_value_stops_before_any_work(override, message, tmp_path, capsys):
    # configs/cpu_demo.yaml bootstraps its data and model: a late check would have generated them first.
    err = run_main(train.main, ["--config", "configs/cpu_demo.yaml", *isolated_overrides(tmp_path), "--set", override], capsys)
    assert err.startswith(f"config error: {message}"), err
    assert err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("override, message", [
    ("loss.try_reward_weight=0.2", "loss.try_reward_weight: only countdown's reward checks written tries, not gsm8k's; "
     "set it to 0, got 0.2"),
    ("rollout.outside_forms_repeat=4", "rollout.outside_forms_repeat: only countdown has answer forms, not gsm8k; set "
     "it to 1, got 4"),
    ("rollout.train_number_counts=[3]", "rollout.train_number_counts: only countdown's questions have a number count, "
     "not gsm8k's; set it to null, got [3]"),
])
def test_countdown_only_keys_are_refused_for_another_task(tmp_path, capsys, override, message):
    # the demo's own try reward off, so that the key under test is the only CountDown one (a later --set wins)
    overrides = ["--set", "task.name=gsm8k", "--set", "loss.try_reward_weight=0", "--set", override]
    err = run_main(train.main, ["--config", "configs/cpu_demo.yaml", *isolated_overrides(tmp_path), *overrides], capsys)
    assert err.startswith(f"config error: {message}"), err
    assert list(tmp_path.iterdir()) == []


def test_prompt_limit_no_prompt_fits_is_refused_before_the_bootstrap_works(tmp_path, capsys):
    # On a fresh clone the prompts exist only once the bootstrap has generated the data and warmed the model up:
    # the limit is checked against the shortest prompt the dataset could hold, with the base model's tokenizer.
    overrides = [*isolated_overrides(tmp_path), f"--set=bootstrap.sft_overrides=[model.dir={tmp_path / 'base'}]",
                 "--set=rollout.max_prompt_len=5"]
    err = run_main(train.main, ["--config", "configs/cpu_demo.yaml", *overrides], capsys)
    assert err.startswith("config error: rollout.max_prompt_len: even the shortest prompt of the bootstrap's dataset "
                          "has "), err
    shortest = int(err.split(" has ")[1].split(" ")[0])
    assert err.endswith(f"raise it to at least {shortest}, got 5\n") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # the base model built for the check is removed again


@pytest.mark.parametrize("override, message", [
    ("optim.min_learning_rate_ratio=2", "optim.min_learning_rate_ratio: must be in [0, 1], got 2.0"),
    ("optim.warmup_steps=-1", "optim.warmup_steps: must be >= 0, got -1"),
    ("optim.batch_size=0", "optim.batch_size: must be >= 1, got 0"),
    ("optim.betas=[0.9,1]", "optim.betas: each must be in [0, 1), got [0.9, 1.0]"),
    ("data.eval_size=0", "data.eval_size: must be >= 1, got 0"),
    ("data.max_seq_len=1", "data.max_seq_len: must be >= 2, got 1"),
    ("eval.num_samples=0", "eval.num_samples: must be >= 1, got 0"),
    ("eval.max_questions=-1", "eval.max_questions: must be >= 0, got -1"),
    ("optim.stop_at_success=0", "optim.stop_at_success: must be in (0, 1], got 0"),
    ("optim.stop_at_success=1.5", "optim.stop_at_success: must be in (0, 1], got 1.5"),
    ("eval.interval=0 optim.stop_at_success=0.3", "optim.stop_at_success: needs evaluations: eval.interval >= 1"),
    ("eval.max_questions=0 optim.stop_at_success=0.3", "optim.stop_at_success: needs evaluations"),
    ("data.eval_jsonl=pairs.jsonl optim.stop_at_success=0.3", "optim.stop_at_success: needs held-out questions "
     "from the task's training split (never the test split)"),
    ("output_dir=''", "output_dir: must be a non-empty path"),
    ("seed=-3", "seed: must be in [0, 4294967295], got -3"),
    ("optim.learning_rate=nan", "optim.learning_rate: must be a finite number, got 'nan'"),
    ("optim.min_learning_rate_ratio=.inf", "optim.min_learning_rate_ratio: must be a finite number, got inf"),
    ("data.response=trace", "data.response: 'trace' is not allowed; use one of 'solution', 'search', 'full_search'"),
    ("data.search_max_tries=0", "data.search_max_tries: must be in [1, 1000], got 0"),
    ("data.search_max_tokens=0", "data.search_max_tokens: must be in [1, 512], got 0"),  # max_seq_len 512
    ("data.search_max_tokens=600", "data.search_max_tokens: must be in [1, 512], got 600"),
    ("data.response=full_search data.search_max_tokens=160", "data.search_max_tokens: is read by data.response: "
     "search only; remove it or set that, got 160"),
    ("task.name=gsm8k data.response=full_search", "data.response: 'full_search' is a CountDown response"),
    ("task.name=gsm8k data.response=search", "data.response: 'search' is a CountDown response; task.name 'gsm8k' "
     "has 'solution' only, got 'search'"),
])
def test_bad_sft_value_stops_before_any_work(override, message, tmp_path, capsys):
    paths = [f"--set=model.dir={tmp_path / 'model'}", f"--set=output_dir={tmp_path / 'out'}",
             f"--set=logging.log_dir={tmp_path / 'logs'}"]
    overrides = sum((["--set", assignment] for assignment in override.split(" ")), [])
    err = run_main(train_sft.main, ["--config", "configs/cpu_demo_sft.yaml", *paths, *overrides], capsys)
    assert err.startswith(f"config error: {message}"), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text, message", [
    (b"optim:\n  num_steps: [1\n", r"bad\.yaml: line 3, column 1: "),  # unclosed flow sequence
    (b"optim:\n num_steps: 1\n  lr: 2\n", r"bad\.yaml: line 3, column 5: mapping values are not allowed here"),
    ("optim:\n  num_steps: 1\n".encode("utf-16"), r"bad\.yaml: line 1, column 1: not UTF-8 text"),
    (b"optim:\n  num_steps: 1\n\x00\x01\x02\xff", r"bad\.yaml: line 3, column 4: not UTF-8 text"),
    (b"seed: 1\n\x00\x00", r"bad\.yaml: line 2: a NUL byte"),
    (b"- a\n- b\n", r"bad\.yaml: the top level must be a mapping"),
])
def test_unreadable_yaml_names_file_line_and_column(text, message, tmp_path, capsys):
    (tmp_path / "bad.yaml").write_bytes(text)
    err = run_main(train.main, ["--config", str(tmp_path / "bad.yaml")], capsys)
    assert err.startswith("config error: ") and re.search(message, err), err


def test_a_bom_is_accepted(tmp_path):
    (tmp_path / "bom.yaml").write_bytes("seed: 3\n".encode("utf-8-sig"))
    assert config_lib.load(train.TrainConfig, tmp_path / "bom.yaml").seed == 3


def test_config_files_merge_in_order_later_files_winning(tmp_path):
    (tmp_path / "a.yaml").write_text("seed: 1\noptim:\n  num_steps: 5\n  learning_rate: 0.5\n")
    (tmp_path / "b.yaml").write_text("optim:\n  num_steps: 7\n")
    config = config_lib.load(train.TrainConfig, [tmp_path / "a.yaml", tmp_path / "b.yaml"], ["seed=2"])
    assert (config.seed, config.optim.num_steps, config.optim.learning_rate) == (2, 7, 0.5)
    assert checkpoint.parse_run_arguments("", None, ["--config", "a.yaml", "--config", "b.yaml"]).config == ["a.yaml", "b.yaml"]


# Every config the repository ships, with the configs its header merges it on top of (in order).
SHIPPED_GRPO = {
    "config.yaml": [], "config_24GB.yaml": [], "configs/cpu_demo.yaml": [], "configs/gsm8k.yaml": [],
    "configs/smollm2_cpu.yaml": [], "configs/lora.yaml": ["config_24GB.yaml"],
    "configs/sum_task.yaml": ["configs/cpu_demo.yaml"], "configs/cpu_demo_long_search.yaml": ["configs/cpu_demo.yaml"],
    "configs/smollm2_cpu_search.yaml": ["configs/smollm2_cpu.yaml"],
    "configs/smollm2_cpu_search_kl.yaml": ["configs/smollm2_cpu.yaml", "configs/smollm2_cpu_search.yaml"],
}
SHIPPED_SFT = ["configs/countdown_sft.yaml", "configs/cpu_demo_sft.yaml", "configs/gsm8k_sft.yaml",
               "configs/smollm2_cpu_sft.yaml"]


def test_every_shipped_config_is_valid(monkeypatch):
    """A config a user is told to run must not stop on a config error: each one (over its bases) validates."""
    top_level = {path.relative_to(REPO_ROOT).as_posix() for path in
                 [*REPO_ROOT.glob("config*.yaml"), *(REPO_ROOT / "configs").glob("*.yaml")]}
    assert top_level == set(SHIPPED_GRPO) | set(SHIPPED_SFT)  # a new config joins the table above
    monkeypatch.chdir(REPO_ROOT)  # configs/sum_task.yaml names its task by import path, from the repository root
    for name, bases in SHIPPED_GRPO.items():
        config_lib.load(train.TrainConfig, [REPO_ROOT / path for path in [*bases, name]])
    for name in SHIPPED_SFT:
        config_lib.load(train_sft.SFTConfig, REPO_ROOT / name)


def test_paths_expand_home_and_environment_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_TEST_ROOT", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    config = config_lib.load(train.TrainConfig, None, ["model.dir=~/qwen", "task.data_dir=$GRPO_TEST_ROOT/data",
                                                      "logging.log_dir=${GRPO_TEST_ROOT}/logs", "checkpoint.dir=~/ck"])
    assert config.model.dir == str(tmp_path / "home" / "qwen")
    assert (config.task.data_dir, config.logging.log_dir) == (str(tmp_path / "data"), str(tmp_path / "logs"))
    assert config.checkpoint.dir == str(tmp_path / "home" / "ck")


def test_ablate_reports_a_bad_value_in_one_line(tmp_path, capsys):
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "neg.yaml").write_text("optim:\n  max_grad_norm: -1\n")
    err = run_main(ablate.main, [str(tmp_path / "experiments"), "--base", "configs/cpu_demo.yaml",
                                 "--out", str(tmp_path / "out")], capsys)
    assert err == f"config error: {tmp_path / 'experiments' / 'neg.yaml'}: optim.max_grad_norm: must be in (0, 10000], got -1.0\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script, arguments, message", [
    ("train.py", ["--config", "configs/cpu_demo.yaml", "--set", "optim.max_grad_norm=-1"],
     "config error: optim.max_grad_norm: must be in (0, 10000], got -1.0\n"),
    ("train.py", ["--config", "configs/cpu_demo.yaml", "--set", "run_name=../escape"],
     "config error: run_name: must be a plain name (no '/', '\\' or '..'; it names one directory), got '../escape'\n"),
    ("train_sft.py", ["--config", "configs/cpu_demo_sft.yaml", "--set", "optim.learning_rate=-1"],
     "config error: optim.learning_rate: must be in (0, 1], got -1.0\n"),
    ("evaluate.py", ["--set", "eval.num_samples=0"], "config error: eval.num_samples: must be >= 1, got 0\n"),
])
def test_real_entry_point_exits_2_with_one_line(script, arguments, message, tmp_path):
    if script == "evaluate.py":
        paths = ["--model", str(tmp_path / "model"), "--data", str(tmp_path / "data")]
    else:
        paths = [f"--set=model.dir={tmp_path / 'model'}", f"--set=task.data_dir={tmp_path / 'data'}",
                 f"--set=logging.log_dir={tmp_path / 'logs'}"]
    result = subprocess.run([sys.executable, str(REPO_ROOT / script), *arguments, *paths],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert (result.returncode, result.stderr, result.stdout) == (2, message, "")
    assert list(tmp_path.iterdir()) == []


# Python with the heavy packages made unimportable (None in sys.modules): code that imported any of
# them would die with an ImportError instead of doing its job.
WITHOUT_HEAVY_PACKAGES = """
import runpy, sys
for name in ("torch", "numpy", "transformers", "tokenizers", "safetensors", "tensorboard", "pyarrow", "sympy"):
    sys.modules[name] = None
sys.path.insert(0, ".")
"""
RUN_SCRIPT = "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def run_without_heavy_packages(code: str, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_HEAVY_PACKAGES + code, *arguments], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)


def test_config_module_imports_nothing_heavy():
    result = run_without_heavy_packages("import config; print(config.load(config.TrainConfig, 'config.yaml').rollout)")
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.startswith("RolloutConfig(episodes_per_step=")


@pytest.mark.parametrize("script, arguments, output", [
    ("train.py", ["--help"], "usage: train.py"),
    ("train_sft.py", ["--help"], "usage: train_sft.py"),
    ("evaluate.py", ["--help"], "usage: evaluate.py"),
    ("ablate.py", ["--help"], "usage: ablate.py"),
    ("train.py", ["--set", "optim.learning_rate=-1"], "config error: optim.learning_rate: must be in (0, 1], got -1.0\n"),
    ("train.py", ["--config", "configs/cpu_demo.yaml", "--set", "loss.clip_range=2"],
     "config error: loss.clip_range: must be in (0, 1), got 2.0\n"),
    ("train.py", ["--resume", "no/such/run"], "checkpoint error: --resume no/such/run: no such directory"),
    ("train_sft.py", ["--config", "configs/cpu_demo_sft.yaml", "--set", "optim.batch_size=0"],
     "config error: optim.batch_size: must be >= 1, got 0\n"),
    ("evaluate.py", ["--model", "m", "--data", "d", "--set", "eval.top_p=0"],
     "config error: eval.top_p: must be in (0, 1], got 0.0\n"),
])
def test_help_and_config_errors_come_before_torch_loads(script, arguments, output):
    result = run_without_heavy_packages(RUN_SCRIPT, script, *arguments)
    if arguments == ["--help"]:
        assert (result.returncode, result.stderr) == (0, "") and result.stdout.startswith(output)
    else:
        assert (result.returncode, result.stdout) == (2, "") and result.stderr.startswith(output), result.stderr


def test_ablate_config_error_comes_before_torch_loads(tmp_path):
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "neg.yaml").write_text("optim:\n  max_grad_norm: -1\n")
    result = run_without_heavy_packages(RUN_SCRIPT, "ablate.py", str(tmp_path / "experiments"), "--base",
                                        "configs/cpu_demo.yaml", "--out", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"config error: {tmp_path / 'experiments' / 'neg.yaml'}: optim.max_grad_norm: "
                             "must be in (0, 10000], got -1.0\n")
    assert not (tmp_path / "out").exists()


def test_rank_count_comes_from_torchrun_environment(monkeypatch):
    """Validation runs before the process group exists, so it reads WORLD_SIZE, as torchrun sets it."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(config_lib.ConfigError, match="the 32 questions per step must split evenly over 3 ranks"):
        config_lib.load(train.TrainConfig, None, ["rollout.episodes_per_step=256"])
    with pytest.raises(config_lib.ConfigError, match=r"optim.batch_size \(32\) must split evenly over 3 ranks"):
        config_lib.load(train_sft.SFTConfig, None)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert config_lib.load(train.TrainConfig, None).rollout.questions_per_step == 32
    dynamic = ["rollout.dynamic_sampling=true", "rollout.dynamic_sampling_questions_per_round=6"]
    with pytest.raises(config_lib.ConfigError,
                       match=r"rollout.dynamic_sampling_questions_per_round \(6\) must split evenly over 4 ranks"):
        config_lib.load(train.TrainConfig, None, dynamic)
    assert config_lib.load(train.TrainConfig, None, [dynamic[0], "rollout.dynamic_sampling_questions_per_round=8"]
                           ).rollout.questions_per_round == 8
    assert config_lib.load(train.TrainConfig, None, dynamic[1:]).rollout.questions_per_round == 32  # inert without dynamic sampling
