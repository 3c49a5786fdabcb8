"""Progress of long stages: a tqdm bar on a terminal, elsewhere one plain log line per interval."""

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from tqdm import tqdm

import countdown_task
import run_logging

REPO_ROOT = Path(__file__).resolve().parents[1]


class Clock:
    """time.monotonic for run_logging, moved by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(run_logging.time, "monotonic", clock)
    return clock


def progress_lines(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == run_logging.logger.name]


def test_a_log_file_gets_one_line_per_interval_with_rate_and_eta(clock, caplog):
    caplog.set_level(logging.INFO)
    bar = run_logging.progress_bar(range(10), desc="sft", unit="step")
    assert isinstance(bar, run_logging.ProgressLines)  # pytest's stderr is no terminal
    for step in bar:
        clock.now += 12.0  # each step takes 12 s: a line every third step (>= 30 s apart), and the totals at the end
        bar.set_postfix(loss=f"{1 / (step + 1):.3f}")
    # After 3 steps (36 s): 12 s/step, 7 left: 84 s. After 6 (72 s): 4 left, 48 s. After 9 (108 s): 1 left, 12 s.
    assert progress_lines(caplog) == [
        "sft: 3/10 (30%) | 12.0 s/step | elapsed 00:36 | ETA 01:24 | loss 0.333",
        "sft: 6/10 (60%) | 12.0 s/step | elapsed 01:12 | ETA 00:48 | loss 0.167",
        "sft: 9/10 (90%) | 12.0 s/step | elapsed 01:48 | ETA 00:12 | loss 0.111",
        "sft: 10/10 (100%) | 12.0 s/step | took 02:00 | loss 0.100",
    ]


def test_a_resumed_stage_counts_from_its_first_step_and_rates_only_its_own(clock, caplog):
    caplog.set_level(logging.INFO)
    bar = run_logging.progress_bar(desc="grpo", total=10, initial=4, unit="step")  # steps 1-4 ran before the resume
    for _ in range(3):
        clock.now += 10.0
        bar.update()
    bar.close()
    # 3 steps in 30 s, not 7: 10 s a step, 3 left.
    assert progress_lines(caplog) == ["grpo: 7/10 (70%) | 10.0 s/step | elapsed 00:30 | ETA 00:30",
                                      "grpo: 7/10 (70%) | 10.0 s/step | took 00:30"]


def test_short_inner_and_disabled_stages_print_nothing(clock, caplog):
    caplog.set_level(logging.INFO)
    for _ in run_logging.progress_bar(range(100), desc="fast", unit="task"):
        clock.now += 0.2  # 20 s in all: under the interval
    inner = run_logging.progress_bar(desc="generate", total=64, unit="token", leave=False)
    for _ in range(4):
        clock.now += 10.0
        inner.update(16)
    inner.close()
    for _ in run_logging.progress_bar(range(5), desc="rank 1", enabled=False):
        clock.now += 60.0
    # Only the inner stage lasted 30 s: one line then (48 tokens in 30 s), and no totals (leave=False, as a tqdm bar).
    assert progress_lines(caplog) == ["generate: 48/64 (75%) | 1.60 token/s | elapsed 00:30 | ETA 00:10"]


def test_a_terminal_gets_a_tqdm_bar(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    bar = run_logging.progress_bar(range(3), desc="sft", unit="step")
    assert isinstance(bar, tqdm) and not bar.disable
    bar.close()
    assert isinstance(run_logging.progress_bar(range(3), desc="sft", enabled=False), run_logging.ProgressLines)


def test_dataset_generation_reports_in_lines_not_redraws(tmp_path, monkeypatch, caplog):
    """The CountDown generator goes through progress_bar: redirected, no bar redraws; long, lines in the log."""
    result = subprocess.run([sys.executable, "countdown_task.py", "generate", "--out", str(tmp_path / "a"), "--size",
                             "300", "--max-number", "20"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr and "it/s" not in result.stderr and "generating" not in result.stderr
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(run_logging, "PROGRESS_LINE_SECONDS", 0.0)  # as if every task took 30 s
    countdown_task.main(["generate", "--out", str(tmp_path / "b"), "--size", "3", "--max-number", "20"])
    lines = progress_lines(caplog)
    assert [line.split(" | ")[0] for line in lines] == [f"generating CountDown tasks: {done}" for done in
                                                        ("1/3 (33%)", "2/3 (67%)", "3/3 (100%)", "3/3 (100%)")]
