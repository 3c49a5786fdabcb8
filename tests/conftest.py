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


@pytest.fixture(scope="session")
def gsm8k_data_dir() -> Path:
    """The real GSM8K files that sit beside the repository (never committed)."""
    path = REPO_ROOT.parent / "shared" / "data" / "gsm8k"
    if not (path / "train.jsonl").is_file():
        pytest.fail(f"GSM8K test data not found at {path}; it is expected beside the repository as ../shared/data/gsm8k")
    return path
