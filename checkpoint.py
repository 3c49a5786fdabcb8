"""Checkpoints: a Hugging Face model directory (weights, config, tokenizer) plus trainer state.

Written under a temporary name and renamed into place, so a crash never leaves half a checkpoint,
and loadable as-is by `Transformer.from_pretrained`, `transformers` and `evaluate.py`.
"""

import os
import shutil
from pathlib import Path

import torch

import config as config_lib

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt")
TRAINER_STATE = "trainer_state.pt"


def save(out_dir, model, tokenizer_dir, run_config=None, trainer_state: dict | None = None) -> Path:
    out_dir = Path(out_dir)
    staging = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    for name in TOKENIZER_FILES:
        source = Path(tokenizer_dir) / name
        if source.is_file():
            shutil.copy(source, staging / name)
    if trainer_state is not None:
        torch.save(trainer_state, staging / TRAINER_STATE)
    if run_config is not None:
        config_lib.dump(run_config, staging / "config.yaml")
    if out_dir.exists():  # overwrite an older checkpoint of the same name
        old = out_dir.with_name(f".{out_dir.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
        os.replace(staging, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(staging, out_dir)
    return out_dir


def load_trainer_state(checkpoint_dir) -> dict:
    return torch.load(Path(checkpoint_dir) / TRAINER_STATE, weights_only=False)


def find(path) -> Path:
    """A checkpoint directory, or the latest checkpoint inside a run directory."""
    path = Path(path)
    if (path / TRAINER_STATE).is_file():
        return path
    candidates = sorted(path.glob(f"step_*/{TRAINER_STATE}"))
    if not candidates:
        raise FileNotFoundError(f"--resume {path}: no checkpoint (step_*/{TRAINER_STATE}) found there.")
    return candidates[-1].parent
