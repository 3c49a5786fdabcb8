import os
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
torch.set_num_threads(1)  # tiny models: one thread per pytest worker (pyproject runs two workers)

from tiny_model import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A seeded random tiny Qwen2 model directory in the Hugging Face layout (tied head, GQA 2)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), seed=0)


GSM8K_SAMPLE_DIR = REPO_ROOT / "tests" / "fixtures" / "gsm8k"  # 87 real rows, committed (see its README)


@pytest.fixture(scope="session")
def gsm8k_sample_dir() -> Path:
    """A committed sample of the real GSM8K files: every test that needs GSM8K rows runs on it."""
    return GSM8K_SAMPLE_DIR


@pytest.fixture(scope="session")
def gsm8k_full_dir() -> Path:
    """The full GSM8K files (never committed): $GSM8K_DIR, else ../shared/data/gsm8k beside the repository.

    Tests over all 8,792 rows are skipped, with this reason, where neither exists.
    """
    if os.environ.get("GSM8K_DIR"):
        path = Path(os.environ["GSM8K_DIR"])
        if not (path / "train.jsonl").is_file():
            pytest.fail(f"GSM8K_DIR={path} has no train.jsonl; point it at the directory holding train.jsonl/test.jsonl")
        return path
    path = REPO_ROOT.parent / "shared" / "data" / "gsm8k"
    if not (path / "train.jsonl").is_file():
        pytest.skip(f"full GSM8K data not found (set GSM8K_DIR, or put train.jsonl/test.jsonl in {path})")
    return path
