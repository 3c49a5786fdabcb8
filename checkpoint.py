"""Checkpoints, and the run directory they live in.

A run directory (<checkpoint.dir>/<run_name>) holds the run's config.yaml and step_NNNNNN checkpoints:
each a Hugging Face model directory (weights, config, tokenizer), loadable as-is by
`Transformer.from_pretrained`, `transformers` and `evaluate.py`, plus trainer_state.pt to resume from.

What keeps a run's files whole:
- One process owns a run directory and its log directory: `claim_run` takes a lock file in each
  (an flock, released by the kernel however the process ends; the file names the holder).
- A checkpoint is written under a hidden name unique to the process, fsynced, and renamed into place.
  Overwriting a step first moves the old copy aside and deletes it only once the new one is in place;
  if a crash falls in between, the next claim of the run puts the old copy back.
"""

import fcntl
import os
import shutil
import socket
from pathlib import Path

import config as config_lib

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt")
TRAINER_STATE = "trainer_state.pt"
LOCK_FILE = ".lock"
STEP_GLOB = "step_[0-9]*"
EVENTS_GLOB = "events.out.tfevents.*"


class CheckpointError(config_lib.InputError):
    label = "checkpoint error"


class RunDirectoryError(config_lib.InputError):
    label = "run directory error"


# ----------------------------------------------------------------------------- owning a directory


def lock_directory(directory: Path, advice: str) -> int:
    """Create `directory` if needed and lock it for this process; returns the lock's file descriptor.
    If another process holds it, stop with who holds it and `advice`."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(descriptor, 256).decode(errors="replace").strip() or "another process"
            os.close(descriptor)
            raise RunDirectoryError(f"{directory} is in use by {holder}; {advice}") from None
        try:  # the previous holder may have removed the file between our open and our lock
            if os.path.samestat(os.fstat(descriptor), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(descriptor)
    os.ftruncate(descriptor, 0)
    os.write(descriptor, f"process {os.getpid()} on host {socket.gethostname()}\n".encode())
    return descriptor


def unlock_directory(directory: Path, descriptor: int) -> None:
    (directory / LOCK_FILE).unlink(missing_ok=True)  # while still locked, so no one locks a removed file
    os.close(descriptor)
    try:
        directory.rmdir()  # a run that wrote nothing leaves nothing behind
    except OSError:
        pass


class RunClaim:
    """The locks a run holds on its directories; `release()` when done (process exit releases them too)."""

    def __init__(self, directories: list[Path], advice: str):
        self.locks = []
        try:
            for directory in dict.fromkeys(Path(d).resolve() for d in directories):  # once each
                self.locks.append((directory, lock_directory(directory, advice)))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for directory, descriptor in reversed(self.locks):
            unlock_directory(directory, descriptor)
        self.locks = []


def claim_run(run_dir: Path, log_dir: Path, resuming: bool, overwrite: bool) -> RunClaim:
    """Own a run's checkpoint and log directories, repair an interrupted checkpoint write, and refuse
    to mix a new run into an earlier run's files unless `overwrite` (then they are deleted)."""
    run_dir, log_dir = Path(run_dir), Path(log_dir)
    claim = RunClaim([run_dir, log_dir], f"wait for it to end, pick another name (--set run_name=NAME), "
                                         f"or later continue it with --resume {run_dir}")
    try:
        recover_interrupted_saves(run_dir)
        earlier = sorted(run_dir.glob(STEP_GLOB)) + sorted(log_dir.glob(EVENTS_GLOB))
        if earlier and not resuming:
            if not overwrite:
                raise RunDirectoryError(
                    f"{earlier[0]} is from an earlier run named {run_dir.name!r}; continue it with --resume {run_dir}, "
                    f"pick another name (--set run_name=NAME), or delete its checkpoints and logs with --overwrite")
            for path in earlier:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    except BaseException:
        claim.release()
        raise
    return claim


# ----------------------------------------------------------------------------- writing


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def save(out_dir, model, tokenizer_dir, run_config=None, trainer_state: dict | None = None) -> Path:
    import torch  # here, so entry points can validate their config before loading torch

    out_dir = Path(out_dir)
    staging = out_dir.with_name(f".{out_dir.name}.tmp.{os.getpid()}")  # unique per process
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
    for file in staging.iterdir():  # on disk before the rename makes them the checkpoint
        _fsync(file)
    _fsync(staging)
    old = out_dir.with_name(f".{out_dir.name}.old.{os.getpid()}")
    if out_dir.exists():  # overwriting: the old copy stays whole, under `old`, until the new one is in place
        os.replace(out_dir, old)
    os.replace(staging, out_dir)
    _fsync(out_dir.parent)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def recover_interrupted_saves(run_dir: Path) -> None:
    """Undo what a crash in `save` left: put back an old copy whose replacement never arrived, delete
    the rest (staging copies, old copies already replaced)."""
    for leftover in sorted(run_dir.glob(".*.old*")) + sorted(run_dir.glob(".*.tmp*")):
        original = run_dir / leftover.name[1:].split(".old")[0]
        if ".old" in leftover.name and not original.exists():
            os.replace(leftover, original)
        else:
            shutil.rmtree(leftover, ignore_errors=True)


def prune(run_dir: Path, keep_last: int | None) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints, always keeping the newest resumable one."""
    steps = sorted(Path(run_dir).glob(STEP_GLOB))
    if keep_last is None or len(steps) <= keep_last:
        return []
    resumable = [step for step in steps if (step / TRAINER_STATE).is_file()]
    keep = set(steps[-keep_last:]) | set(resumable[-1:])
    deleted = [step for step in steps if step not in keep]
    for step in deleted:
        shutil.rmtree(step)
    return deleted


# ----------------------------------------------------------------------------- reading


def load_trainer_state(checkpoint_dir) -> dict:
    import torch

    path = Path(checkpoint_dir) / TRAINER_STATE
    try:
        return torch.load(path, weights_only=False)
    except Exception as error:  # truncated or corrupt: say which file, and what to do
        raise CheckpointError(f"{path} cannot be read ({type(error).__name__}: {error}); the checkpoint is damaged: "
                              f"resume from another step (--resume {path.parent.parent}/step_...)") from None


def run_directory_of(path) -> Path:
    """The run directory of a checkpoint or run directory given to --resume."""
    path = Path(path)
    return path.parent if path.name.startswith("step_") or (path / TRAINER_STATE).is_file() else path


def latest_resumable(run_dir) -> Path | None:
    candidates = sorted(Path(run_dir).glob(f"{STEP_GLOB}/{TRAINER_STATE}"))
    return candidates[-1].parent if candidates else None


def find(path) -> Path:
    """A checkpoint directory, or the latest resumable checkpoint inside a run directory."""
    path = Path(path)
    if (path / TRAINER_STATE).is_file():
        return path
    latest = latest_resumable(path)
    if latest is None:
        raise CheckpointError(f"--resume {path}: no checkpoint ({STEP_GLOB}/{TRAINER_STATE}) found there")
    return latest
