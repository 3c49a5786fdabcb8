"""Smoke runs of the benchmark scripts at tiny sizes, through their command lines."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "bench"))

import memory_plan  # noqa: E402


def run_bench(script: str, tmp_path: Path, *args: str) -> tuple[dict, str]:
    json_path = tmp_path / "report.json"
    completed = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / script), *args, "--json-out", str(json_path)],
        capture_output=True, text=True, check=True, cwd=REPO_ROOT,
    )
    return json.loads(json_path.read_text()), completed.stdout


@pytest.mark.slow
def test_rollout_bench_runs_every_engine_on_the_planted_lengths(tmp_path):
    report, stdout = run_bench(
        "rollout.py", tmp_path, "--model", "tiny", "--device", "cpu", "--questions", "2", "--answers", "3",
        "--prompt-len", "10", "--min-gen-len", "2", "--max-gen-len", "20",
    )
    assert set(report["engines"]) == {"engine", "reference path", "transformers generate()"}
    assert 2 * 3 * 2 <= report["generated_tokens"] <= 2 * 3 * 20
    for name, result in report["engines"].items():
        assert result["tokens_per_second"] == pytest.approx(report["generated_tokens"] / result["seconds"])
        assert f"| {name}" in stdout
    assert report["engines"]["reference path"]["speedup_vs_reference"] == 1.0


@pytest.mark.slow
def test_update_bench_gets_equal_loss_and_gradients(tmp_path):
    report, stdout = run_bench(
        "update.py", tmp_path, "--model", "tiny", "--device", "cpu", "--seq-len", "24", "--prompt-len", "8",
        "--chunk-sizes", "5", "23",
    )
    assert set(report["variants"]) == {"full logits", "chunk 5", "chunk 23"}
    full = report["variants"]["full logits"]
    for name in ("chunk 5", "chunk 23"):
        chunked = report["variants"][name]
        assert chunked["loss"] == pytest.approx(full["loss"], abs=1e-6)
        assert chunked["grad_max_rel_diff"] < 1e-4 and chunked["grad_max_abs"] > 0
        assert chunked["peak_memory_bytes"] > 0
    assert "| chunk 5 |" in stdout


def test_memory_plan_matches_hand_arithmetic(capsys):
    report = memory_plan.main([])
    assert "| **peak (device)** |" in capsys.readouterr().out
    big, small = report["config.yaml"], report["config_24GB.yaml"]
    # Qwen2.5-3B by hand: tied embedding + 36 x (attention with biases on q/k/v, SwiGLU MLP, two norms) + final norm.
    hidden, kv_width, intermediate = 2048, 2 * 128, 11008
    per_layer = 2 * hidden * hidden + hidden + 2 * (hidden * kv_width + kv_width) + 3 * hidden * intermediate + 2 * hidden
    num_params = 151936 * hidden + 36 * per_layer + hidden
    assert big["parameters"] == small["parameters"] == num_params
    assert big["components"]["weights"] == big["components"]["gradients"] == 2 * num_params
    assert big["components"]["adamw_moments"] == 4 * num_params and small["components"]["adamw_moments"] == 0
    assert small["host"]["adamw_moments_fp32_in_cpu_ram"] == 8 * num_params
    # 256 episodes x (256 + 1024 - 1) slots x 36 layers x (k, v) x 2 kv heads x 128 dims x 2 bytes.
    assert big["components"]["kv_cache"] == 256 * 1279 * 36 * 2 * 2 * 128 * 2
    assert big["components"]["logits_chunk"] == 3 * 2 * 256 * 151936 * 4
    for plan in (big, small):
        assert plan["peak"] == max(plan["phases"].values())
    assert small["peak"] < 24e9 < big["peak"] < 48e9
