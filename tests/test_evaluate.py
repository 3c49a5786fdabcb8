"""evaluate.py's command line: what it needs (--model, --data), its defaults, and the mistakes it finds
before generating anything."""

import json

import pytest

import config as config_lib
import countdown_task
import evaluate
from test_config_errors import RUN_SCRIPT, run_without_heavy_packages
from test_train import countdown_dir, tiny_config  # noqa: F401 (fixture)


def test_a_model_directory_alone_is_evaluated_in_float32_with_the_default_answer_length(tmp_path, tiny_model_dir):
    # load_config alone: the data "d" is not there (read_command_line would refuse it, test_bad_inputs checks that).
    # --temperature fills in the eval section: its other keys must keep evaluate.py's defaults, not EvalConfig's.
    config = evaluate.load_config(evaluate.parse_args(["--model", str(tiny_model_dir), "--data", "d", "--temperature", "0"]))
    assert (config.model.dtype, config.model.gradient_checkpointing) == ("float32", False)
    assert (config.eval.max_gen_len, config.eval.temperature) == (1024, 0.0)
    # A training checkpoint brings its own: dtype, and GRPO's rollout length for a null eval.max_gen_len.
    checkpoint = tmp_path / "step_000010"
    checkpoint.mkdir()
    config_lib.dump(tiny_config(tmp_path, tiny_model_dir, "d", "model.dtype=bfloat16", "rollout.max_gen_len=40",
                                "eval.max_gen_len=null"), checkpoint / "config.yaml")
    config = evaluate.load_config(evaluate.parse_args(["--model", str(checkpoint), "--data", "d"]))
    assert (config.model.dtype, config.eval.max_gen_len) == ("bfloat16", 40)


def test_runs_with_only_model_and_data(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "countdown"
    countdown_task.main(["generate", "--out", str(data), "--size", "130", "--max-number", "20"])  # > test_size 128
    capsys.readouterr()
    out = tmp_path / "new" / "dir" / "samples.jsonl"  # a directory that does not exist yet is created at the end
    # The random tiny model never says eos: every answer runs to the default 1024 tokens (2 questions keep it short).
    evaluate.main(["--model", str(tiny_model_dir), "--data", str(data), "--out", str(out), "--max-questions", "2"])
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert [sample["num_tokens"] for sample in samples] == [1024, 1024]
    metrics = json.loads(capsys.readouterr().out.split("\nwrote")[0])
    assert metrics["num_questions"] == 2
    replayed = [countdown_task.try_reward(sample["response"], sample["nums"]) for sample in samples]
    assert metrics["mean_try_reward"] == pytest.approx(sum(replayed) / 2)
    # Success per number count asked; forms for the counts the training rows (the 2 before the test split) hold.
    counts = {len(sample["nums"]) for sample in samples}
    assert {f"{n}_numbers/success" for n in counts} <= metrics.keys()
    trained = {len(numbers) for numbers in countdown_task.read_tasks(data).column("nums").to_pylist()[:2]}
    assert {key for key in metrics if key.endswith("/best_form_coverage")} == {f"{n}_numbers/best_form_coverage"
                                                                                for n in counts & trained}


@pytest.mark.parametrize("arguments, message", [
    # A mistyped step names what the run directory holds, not the data it would need next.
    (["--model", "{run}/step_000009"], "missing input: --model {run}/step_000009: no such checkpoint or model "
                                       "directory; {run} holds step_000002, step_000004\n"),
    (["--model", "{run}/step_000002", "--data", "d", "--out", "{run}"], "error: --out {run} is a directory; pass a "
                                                                        "file, e.g. --out {run}/samples.jsonl\n"),
    (["--model", "{run}/step_000002", "--data", "d", "--out", "{run}/notes.txt/samples.jsonl"],
     "config error: --out: cannot create {run}/notes.txt: {run}/notes.txt is not a directory\n"),
])
def test_a_missing_checkpoint_or_a_bad_out_is_found_before_torch_loads(arguments, message, tmp_path):
    run = tmp_path / "checkpoints" / "run"
    for step in ("step_000002", "step_000004"):
        (run / step).mkdir(parents=True)
    (run / "notes.txt").write_text("a file, not a directory")
    result = run_without_heavy_packages(RUN_SCRIPT, "evaluate.py", *(a.format(run=run) for a in arguments))
    assert (result.returncode, result.stdout, result.stderr) == (2, "", message.format(run=run))
    assert sorted(path.name for path in run.iterdir()) == ["notes.txt", "step_000002", "step_000004"]
