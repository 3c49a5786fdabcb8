"""ablate.py: the suite runner on tiny CountDown runs, and the shipped ablation configs against the document."""

import csv
import re
from pathlib import Path

import pytest
import yaml

import ablate
import config as config_lib
import train
from test_train import countdown_dir, digit_reward, read_scalars  # noqa: F401 (fixtures)

REPO_ROOT = Path(__file__).resolve().parents[1]
ABLATIONS = REPO_ROOT / "configs" / "ablations"
RESULT_COLUMNS = ["experiment", "changes", "final_eval_success", "best_eval_success", "final_format_rate", "steps",
                  "wall_seconds", "note"]
# The document's ablation table: each row's one change to the reference run.
DOCUMENT_ROWS = {
    "baseline": {},
    "no_baseline": {"loss.baseline": "none", "loss.std_normalization": False},
    "lr_5e-6": {"optim.learning_rate": 5e-6},
    "lr_2e-5": {"optim.learning_rate": 2e-5},
    "length_norm": {"loss.aggregation": "constant"},
    "no_std_norm": {"loss.std_normalization": False},
    "offpolicy_k4_clip": {"loss.epochs_per_rollout": 4, "loss.clip": "ppo"},
    "offpolicy_k2_clip": {"loss.epochs_per_rollout": 2, "loss.clip": "ppo"},
    "offpolicy_k4_noclip": {"loss.epochs_per_rollout": 4, "loss.clip": "none"},
    "minimal_prompt": {"task.prompt_template": "minimal"},
}


def write_base_config(path: Path, model_dir, data_dir, num_steps: int) -> Path:
    path.write_text(yaml.safe_dump({
        "run_name": "ignored", "device": "cpu", "progress": False,
        "model": {"dir": str(model_dir), "dtype": "float32", "gradient_checkpointing": False},
        "task": {"data_dir": str(data_dir), "test_size": 4},
        "rollout": {"episodes_per_step": 6, "num_answers_per_question": 3, "max_gen_len": 12},
        "optim": {"num_steps": num_steps, "learning_rate": 1e-3, "micro_batch_size": 4},
        "eval": {"interval": 1, "max_questions": 4, "max_gen_len": 8},
        "logging": {"log_dir": str(path.parent / "ignored-logs"), "sample_interval": 0},
        "checkpoint": {"dir": str(path.parent / "ignored-checkpoints"), "interval": 0},
    }))
    return path


def write_experiment(directory: Path, name: str, text: str) -> None:
    directory.mkdir(exist_ok=True)
    (directory / f"{name}.yaml").write_text(text)


@pytest.fixture
def train_calls(monkeypatch) -> list[tuple[str, dict]]:
    """(run name, returned eval metrics) of every run the suite makes (train.train_from)."""
    calls = []
    real_train = train.train_from

    def recording_train(plan):
        metrics = real_train(plan)
        calls.append((plan.config.run_name, metrics))
        return metrics

    monkeypatch.setattr(train, "train_from", recording_train)
    return calls


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as csv_file:
        return list(csv.DictReader(csv_file))


@pytest.mark.slow
def test_suite_runs_each_override_and_tabulates_the_logged_results(tmp_path, tiny_model_dir, countdown_dir,
                                                                    digit_reward, train_calls):
    base = write_base_config(tmp_path / "base.yaml", tiny_model_dir, countdown_dir, num_steps=3)
    experiments, out = tmp_path / "experiments", tmp_path / "out"
    write_experiment(experiments, "no_std_norm", "loss:\n  std_normalization: false\n")
    write_experiment(experiments, "higher_lr", "optim:\n  learning_rate: 1.0e-2\n")
    write_experiment(experiments, "minimal_prompt", (ABLATIONS / "minimal_prompt.yaml").read_text())
    ablate.main([str(experiments), "--base", str(base), "--out", str(out), "--set", "optim.num_steps=2"])

    # In name order; minimal_prompt does not run, as CountDown has no prompt templates.
    assert [name for name, _ in train_calls] == ["higher_lr", "no_std_norm"]
    rows = read_csv(out / "results.csv")
    assert list(rows[0]) == RESULT_COLUMNS
    assert [row["experiment"] for row in rows] == ["higher_lr", "minimal_prompt", "no_std_norm"]
    assert [row["changes"] for row in rows] == ["optim.learning_rate=0.01", "task.prompt_template=minimal",
                                                "loss.std_normalization=false"]
    table_rows = [[cell.strip() for cell in line.split("|")[1:-1]]
                  for line in (out / "results.md").read_text().splitlines() if line.startswith("| ")]
    markdown_rows = {cells[0]: cells[1:] for cells in table_rows}
    returned_metrics = dict(train_calls)
    for row in (rows[0], rows[2]):
        name = row["experiment"]
        scalars = read_scalars(out / "logs" / name)
        success = [value for _, value in scalars["eval/success_rate"]]
        assert [step for step, _ in scalars["eval/success_rate"]] == [0, 1, 2]
        assert float(row["final_eval_success"]) == pytest.approx(success[-1]) == returned_metrics[name]["success_rate"]
        assert float(row["best_eval_success"]) == pytest.approx(max(success))
        assert float(row["final_format_rate"]) == pytest.approx(scalars["eval/format_rate"][-1][1])
        assert row["steps"] == "2" and float(row["wall_seconds"]) > 0 and row["note"] == ""
        assert markdown_rows[name] == [row["changes"], f"{success[-1]:.1%}", f"{max(success):.1%}",
                                       f"{scalars['eval/format_rate'][-1][1]:.1%}", "2",
                                       ablate.format_duration(float(row["wall_seconds"]))]
    learning_rates = read_scalars(out / "logs" / "higher_lr")["train/learning_rate"]
    assert learning_rates == [(1, pytest.approx(1e-2)), (2, pytest.approx(1e-2))]
    saved = config_lib.read_yaml(out / "checkpoints" / "no_std_norm" / "config.yaml")
    assert (saved["run_name"], saved["loss"]["std_normalization"]) == ("no_std_norm", False)
    assert saved["optim"]["learning_rate"] == 1e-3
    assert sorted(p.name for p in (out / "checkpoints" / "no_std_norm").iterdir()) == ["config.yaml", "finished", "step_000002"]

    not_applicable = rows[1]
    assert not_applicable["note"].startswith("not applicable: task.prompt_template")
    assert not_applicable["final_eval_success"] == not_applicable["steps"] == ""
    assert markdown_rows["minimal_prompt"][1:] == ["n/a", "n/a", "n/a", "-", "-"]
    assert not (out / "logs" / "minimal_prompt").exists() and not (tmp_path / "ignored-logs").exists()


@pytest.mark.slow
def test_rerun_skips_recorded_experiments_unless_changed_or_forced(tmp_path, tiny_model_dir, countdown_dir,
                                                                     digit_reward, train_calls):
    base = write_base_config(tmp_path / "base.yaml", tiny_model_dir, countdown_dir, num_steps=1)
    experiments, out = tmp_path / "experiments", tmp_path / "out"
    write_experiment(experiments, "clipped", "loss:\n  clip: ppo\n")
    first = ablate.run_suite(experiments, base, [], out)
    assert ablate.run_suite(experiments, base, [], out) == first
    assert len(train_calls) == 1

    write_experiment(experiments, "clipped", "loss:\n  clip: ppo\n  epochs_per_rollout: 2\n")
    ablate.run_suite(experiments, base, [], out)
    ablate.run_suite(experiments, base, [], out, force=True)
    assert len(train_calls) == 3
    assert read_csv(out / "results.csv")[0]["changes"] == "loss.clip=ppo, loss.epochs_per_rollout=2"
    # A rerun starts from clean directories: one event file, each step logged once.
    assert len(list((out / "logs" / "clipped").glob("events.out.tfevents.*"))) == 1
    assert [step for step, _ in read_scalars(out / "logs" / "clipped")["reward/mean"]] == [1]


def test_a_typo_in_any_experiment_stops_the_suite_before_any_run(tmp_path, train_calls, capsys):
    base = write_base_config(tmp_path / "base.yaml", tmp_path / "no-model", tmp_path / "no-data", num_steps=1)
    write_experiment(tmp_path / "experiments", "a_fine", "loss:\n  clip: ppo\n")
    write_experiment(tmp_path / "experiments", "b_typo", "loss:\n  aggregaton: constant\n")
    write_experiment(tmp_path / "bad_value", "k0", "loss:\n  epochs_per_rollout: 0\n")
    (tmp_path / "empty").mkdir()
    for directory, message in (("experiments", r"config error: .*b_typo.yaml: unknown key 'loss.aggregaton'"),
                               ("bad_value", r"config error: .*k0.yaml: loss.epochs_per_rollout: must be >= 1, got 0"),
                               ("empty", "config error: no experiments: .* has no \\*.yaml files")):
        with pytest.raises(SystemExit) as exit_info:
            ablate.main([str(tmp_path / directory), "--base", str(base), "--out", str(tmp_path / "out")])
        assert exit_info.value.code == 2
        assert re.match(message, capsys.readouterr().err)
    assert train_calls == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("base", ["config.yaml", "configs/gsm8k.yaml"])
def test_every_ablation_file_is_its_document_row_and_validates_on_the_base(base, tmp_path):
    experiments = ablate.load_experiments(ABLATIONS, REPO_ROOT / base, [], tmp_path)
    assert {experiment.name: experiment.changes for experiment in experiments} == DOCUMENT_ROWS
    base_values = ablate.flatten(config_lib.to_dict(config_lib.load(train.TrainConfig, REPO_ROOT / base)))
    suite_keys = {"run_name", "logging.log_dir", "checkpoint.dir"}
    for experiment in experiments:
        values = ablate.flatten(config_lib.to_dict(experiment.config))
        changed = {key for key in values if values[key] != base_values[key]} - suite_keys
        assert changed <= experiment.changes.keys(), experiment.name
        assert all(values[key] == value for key, value in experiment.changes.items()), experiment.name
        assert (values["run_name"], values["logging.log_dir"]) == (experiment.name, str(tmp_path / "logs"))
        applicable = ablate.not_applicable_reason(experiment) is None
        assert applicable == (experiment.name != "minimal_prompt" or values["task.name"] == "gsm8k")
