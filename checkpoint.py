"""Checkpoints, and the run directory they live in.

A run directory (<checkpoint.dir>/<run_name>) holds the run's config.yaml and step_NNNNNN checkpoints:
each a Hugging Face model directory (weights, config, tokenizer), loadable as-is by
`Transformer.from_pretrained`, `transformers` and `evaluate.py`, plus trainer_state.pt to resume from.
A LoRA run's checkpoints hold its adapters in adapter/ (PEFT's layout) and, after the last step only, the
merged weights too; evaluate.py and model.dir take either.

What keeps a run's files whole:
- One process owns a run directory and its log directory: `claim_run` takes a lock file in each
  (an flock, released by the kernel however the process ends; the file names the holder).
- A checkpoint is written under a hidden name unique to the process, fsynced, and renamed into place.
  Overwriting a step first moves the old copy aside and deletes it only once the new one is in place;
  if a crash falls in between, the next claim of the run puts the old copy back.
- A run continues only from its own state: the config.yaml in each checkpoint records what made it (trainer,
  base model, data, task, seed: `run_identity`), and a start that differs is refused (`check_own_state`).
  A run that ended normally leaves a `finished` file, so nothing continues it unasked (bootstrap.py).
- A new run never deletes an earlier run's TensorBoard logs unless told to (--overwrite): logs of a run that
  stopped before its first checkpoint are moved aside, into a folder TensorBoard shows beside the new run.
"""

import argparse
import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import config as config_lib

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt")
TRAINER_STATE = "trainer_state.pt"
LOCK_FILE = ".lock"
STEP_GLOB = "step_[0-9]*"
EVENTS_GLOB = "events.out.tfevents.*"
RUN_CONFIG = "config.yaml"  # in the run directory and in every checkpoint
ADAPTER_SUBDIR = "adapter"  # a LoRA run's adapters in a checkpoint, in PEFT's layout
FINISHED = "finished"  # in the run directory of a run that ended normally (not stopped, not killed)
LOW_DISK_BYTES = 16 * 2**20  # a failed write with less than this left on its filesystem ran out of space

logger = logging.getLogger("checkpoint")


class CheckpointError(config_lib.InputError):
    label = "checkpoint error"


class RunDirectoryError(config_lib.InputError):
    label = "run directory error"


# ----------------------------------------------------------------------------- owning a directory


def lock_directory(directory: Path, advice: str) -> int:
    """Create `directory` if needed and lock it for this process; returns the lock's file descriptor.
    If another process holds it, stop with who holds it and `advice`."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # what inputs.check_writable cannot foresee: a filesystem that only looks writable
        raise RunDirectoryError(f"cannot create {directory}: {error.strerror}; choose a directory you can write "
                                "to") from None
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
        self.created_parents = []  # made for the directories; removed again at release while empty
        try:
            for directory in dict.fromkeys(Path(d).resolve() for d in directories):  # once each
                self.created_parents += [parent for parent in directory.parents if not parent.exists()]
                self.locks.append((directory, lock_directory(directory, advice)))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for directory, descriptor in reversed(self.locks):
            unlock_directory(directory, descriptor)
        for parent in self.created_parents:  # each directory's parents, innermost first
            try:
                parent.rmdir()
            except OSError:
                pass
        self.locks, self.created_parents = [], []


def claim_run(run_dir: Path, log_dir: Path, resuming: bool, overwrite: bool) -> RunClaim:
    """Own a run's checkpoint and log directories, repair an interrupted checkpoint write, and refuse
    to mix a new run into an earlier run's files unless `overwrite` (then they are deleted). An earlier
    run that stopped before its first checkpoint holds nothing to resume: its logs are moved aside."""
    run_dir, log_dir = Path(run_dir), Path(log_dir)
    claim = RunClaim([run_dir, log_dir], f"wait for it to end, pick another name (--set run_name=NAME), "
                                         f"or later continue it with --resume {run_dir}")
    with released_on_error(claim):
        recover_interrupted_saves(run_dir)
        steps, events = sorted(run_dir.glob(STEP_GLOB)), sorted(log_dir.glob(EVENTS_GLOB))
        if steps and not resuming and not overwrite:
            raise RunDirectoryError(
                f"{steps[0]} is from an earlier run named {run_dir.name!r}; continue it with --resume {run_dir}, "
                f"pick another name (--set run_name=NAME), or delete its checkpoints and logs with --overwrite")
        if events and not steps and not overwrite:
            earlier = log_dir / f"earlier-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
            logger.warning("run %r stopped before its first checkpoint, so it holds nothing to resume: starting it "
                           "over (its logs are kept in %s)", run_dir.name, earlier)
            earlier.mkdir(exist_ok=True)
            for path in events:
                os.replace(path, earlier / path.name)
        elif overwrite:
            for path in steps + events:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    return claim


def mark_finished(run_dir: Path) -> None:
    """Record that the run ended normally, where it leaves checkpoints (a run that left none leaves no directory)."""
    if any(Path(run_dir).glob(STEP_GLOB)):
        (Path(run_dir) / FINISHED).touch()


def is_finished(run_dir: Path) -> bool:
    return (Path(run_dir) / FINISHED).is_file()


def holds_a_run(run_dir: Path, log_dir: Path) -> bool:
    """Whether an earlier run left checkpoints in `run_dir` or curves in `log_dir`."""
    return any(Path(run_dir).glob(STEP_GLOB)) or any(Path(log_dir).glob(EVENTS_GLOB))


@contextlib.contextmanager
def released_on_error(claim: RunClaim | None):
    """Release `claim` (if any) when the block raises: a run refused while it starts leaves no lock file and no
    directory it created."""
    try:
        yield
    except BaseException:
        if claim is not None:
            claim.release()
        raise


# ----------------------------------------------------------------------------- writing


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def save(out_dir, model, tokenizer_dir, *, run_config=None, trainer_state: dict | None = None,
         weights: bool = True) -> Path:
    """Write out_dir atomically: the model in the Hugging Face layout (its LoRA adapters merged; `weights` False:
    none), a model with adapters also those alone in out_dir/adapter/ (PEFT's layout, on the base model
    `tokenizer_dir` names), the tokenizer's files, and the run's config and trainer state when given."""
    import torch  # here, so entry points can validate their config before loading torch

    out_dir = Path(out_dir)
    staging = out_dir.with_name(f".{out_dir.name}.tmp.{os.getpid()}")  # unique per process
    shutil.rmtree(staging, ignore_errors=True)
    try:
        if weights:
            model.save_pretrained(staging)
        if model.adapter_settings:
            model.save_adapter(staging / ADAPTER_SUBDIR, base_model=same_place(str(tokenizer_dir)))
        for name in TOKENIZER_FILES:
            source = Path(tokenizer_dir) / name
            if source.is_file():
                shutil.copy(source, staging / name)
        if trainer_state is not None:
            torch.save(trainer_state, staging / TRAINER_STATE)
        if run_config is not None:
            config_lib.dump(run_config, staging / RUN_CONFIG)
        for file in [*staging.iterdir(), *staging.glob(f"{ADAPTER_SUBDIR}/*")]:  # on disk before the rename
            _fsync(file)
        _fsync(staging)
    except BaseException as error:  # a half-written copy would only fill the disk: remove it, whatever stopped us
        reason = write_failure(error, out_dir.parent)  # before the removal frees the space it took
        shutil.rmtree(staging, ignore_errors=True)
        if reason is None:
            raise
        raise CheckpointError(f"could not write {out_dir}: {reason}; the partial copy is removed and earlier "
                              "checkpoints are intact") from None
    old = out_dir.with_name(f".{out_dir.name}.old.{os.getpid()}")
    if out_dir.exists():  # overwriting: the old copy stays whole, under `old`, until the new one is in place
        os.replace(out_dir, old)
    os.replace(staging, out_dir)
    _fsync(out_dir.parent)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def write_failure(error: BaseException, directory: Path) -> str | None:
    """What stopped a checkpoint write, in words, when the disk or the directory is at fault; None for anything
    else. torch and safetensors report a full disk as errors of their own (`unexpected pos ...`) without its
    errno, so any error of a write that left its filesystem (nearly) full counts as a full disk too."""
    try:
        nearly_full = shutil.disk_usage(directory).free < LOW_DISK_BYTES
    except OSError:
        nearly_full = False
    if (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)) or (
            isinstance(error, Exception) and nearly_full):
        return f"disk full (no space left on the filesystem of {directory})"
    if isinstance(error, OSError):
        return f"{error.strerror or error} ({error.filename or directory})"
    return None


def recover_interrupted_saves(run_dir: Path) -> None:
    """Undo what a crash in `save` left: put back an old copy whose replacement never arrived, delete
    the rest (staging copies, old copies already replaced)."""
    for leftover in sorted(run_dir.glob(".*.old*")) + sorted(run_dir.glob(".*.tmp*")):
        original = run_dir / leftover.name[1:].split(".old")[0]
        if ".old" in leftover.name and not original.exists():
            os.replace(leftover, original)
        else:
            shutil.rmtree(leftover, ignore_errors=True)


DISK_MARGIN_BYTES = 64 * 2**20  # beside the checkpoint's own bytes: tokenizer files, config, the filesystem's slack


def make_room(run_dir: Path, new_step: str, needed_bytes: int, keep_last: int | None) -> list[Path]:
    """Before writing checkpoint `new_step` of about `needed_bytes`: if the disk lacks the room, delete first the
    checkpoints that pruning would delete after the write, never the newest one nor the newest resumable one (a
    write that then fails leaves them whole); if that is not enough, refuse before writing anything. Returns
    what was deleted."""
    run_dir = Path(run_dir)
    needed = needed_bytes + DISK_MARGIN_BYTES
    if shutil.disk_usage(run_dir).free >= needed:
        return []
    steps = sorted(path for path in run_dir.glob(STEP_GLOB) if path.name != new_step)
    # What retention deletes once the new step is there, but not the newest checkpoint before the new one is whole.
    deletable = [step for step in retired([*steps, run_dir / new_step], keep_last) if step not in steps[-1:]]
    deleted = []
    for step in deletable:
        if shutil.disk_usage(run_dir).free >= needed:
            break
        shutil.rmtree(step)
        deleted.append(step)
    free = shutil.disk_usage(run_dir).free
    if free < needed:
        after = f" after deleting {len(deleted)} old checkpoint(s)" if deleted else ""
        raise CheckpointError(
            f"not enough disk space for {run_dir / new_step}: it needs about {needed / 1e9:.2f} GB and the filesystem "
            f"of {run_dir} has {free / 1e9:.2f} GB free{after}; nothing was written. Free space, or keep fewer or "
            "smaller checkpoints (checkpoint.keep_last, checkpoint.optimizer_state: false)")
    if deleted:
        logger.warning("deleted %s before writing %s, to make room on the disk", ", ".join(p.name for p in deleted),
                       new_step)
    return deleted


def retired(steps: list[Path], keep_last: int | None) -> list[Path]:
    """Which of the run's checkpoints `steps` (oldest first) retention deletes: all but the newest `keep_last`,
    never the newest resumable one."""
    if keep_last is None or len(steps) <= keep_last:
        return []
    resumable = [step for step in steps if (step / TRAINER_STATE).is_file()]
    keep = set(steps[-keep_last:]) | set(resumable[-1:])
    return [step for step in steps if step not in keep]


def prune(run_dir: Path, keep_last: int | None) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints, always keeping the newest resumable one."""
    deleted = retired(sorted(Path(run_dir).glob(STEP_GLOB)), keep_last)
    for step in deleted:
        shutil.rmtree(step)
    return deleted


# ----------------------------------------------------------------------------- reading


def load_trainer_state(checkpoint_dir) -> dict:
    import torch

    path = Path(checkpoint_dir) / TRAINER_STATE
    try:
        # Mapped, not read: the optimizer copies each moment where it lives (the GPU, or CPU memory when
        # offloaded), so the host never holds the file's copy beside its own (25 GB of moments for Qwen2.5-3B).
        return torch.load(path, weights_only=False, mmap=True)
    except Exception as error:  # truncated or corrupt: say which file, and what to do
        raise CheckpointError(f"{path} cannot be read ({type(error).__name__}: {error}); the checkpoint is damaged: "
                              f"resume from another step (--resume {path.parent.parent}/step_...)") from None


# ----------------------------------------------------------------------------- whose state a checkpoint is

# The keys that make a run what it is: a checkpoint continues only a start that agrees on all of them.
IDENTITY_KEYS = {"grpo": ("model.dir", "model.lora", "task.name", "task.data_dir", "seed"),
                 "sft": ("model.dir", "model.lora", "task.name", "task.data_dir", "data.train_jsonl", "data.response",
                         "data.search_max_tries", "data.search_max_tokens", "seed")}
TRAINER_SCRIPTS = {"grpo": "train.py", "sft": "train_sft.py"}
HUB_SNAPSHOT = re.compile(r"(?:models|datasets)--([^/]+)--([^/]+)/snapshots/[^/]+/?$")


def trainer_of(values: dict) -> str:
    """Which trainer wrote a run config (as read from its YAML): SFT's alone has an output_dir."""
    return "sft" if "output_dir" in values else "grpo"


def run_identity(values: dict) -> dict:
    """What a run is made of, from its config's values (`config_lib.to_dict`, or a config.yaml as read)."""
    identity = {"trainer": trainer_of(values)}
    for key in IDENTITY_KEYS[identity["trainer"]]:
        section, _, name = key.partition(".")
        value = values.get(section, {}).get(name) if name else values.get(section)
        identity[key] = same_place(value) if key.endswith(("dir", "jsonl")) else value
    identity["model.lora"] = adapter_kind(identity["model.lora"])
    return identity


def adapter_kind(lora: dict | None) -> str:
    """What a run trains, in words: its LoRA settings, or the whole model (also a config.yaml from before LoRA)."""
    if not lora or lora.get("rank") is None:
        return "full fine-tuning (no LoRA)"
    return f"LoRA rank {lora['rank']}, alpha {lora['alpha']}, layers {','.join(lora['layers'])}"


def same_place(path: str | None) -> str | None:
    """One spelling per place: a Hub snapshot in the cache is its Hub id (the id a user typed became it), an
    existing path is its real absolute path, anything else stays as written."""
    if path is None:
        return None
    snapshot = HUB_SNAPSHOT.search(str(path))
    if snapshot:
        return "/".join(snapshot.groups())
    return os.path.realpath(path) if os.path.exists(path) else str(path)


def check_trainer(stored_config: Path, trainer: str, given: str) -> None:
    """--resume `given` names a run of `trainer`; read before its config is (the other trainer's keys would
    be refused as unknown, without saying why)."""
    if not stored_config.is_file():
        return
    made_by = trainer_of(config_lib.read_yaml(stored_config) or {})
    if made_by == trainer:
        return
    if made_by == "sft":
        other = "train GRPO from the model it wrote with --set model.dir=<its output_dir>, or from a checkpoint of it"
    else:
        other = "fine-tune one of its checkpoints with --set model.dir=<checkpoint.dir>/<run_name>/step_NNNNNN"
    raise CheckpointError(f"--resume {given} is a run of {TRAINER_SCRIPTS[made_by]}, not of "
                          f"{TRAINER_SCRIPTS[trainer]}: continue it with `uv run {TRAINER_SCRIPTS[made_by]} --resume "
                          f"{given}`, or {other}")


def check_own_state(checkpoint_dir: Path, config, given: str) -> None:
    """Refuse to continue the checkpoint (from --resume `given`) with a config that makes another run (the
    trainer included: the command line has named the right script already, by check_trainer)."""
    stored = checkpoint_dir / RUN_CONFIG
    if not stored.is_file():
        return
    made, planned = run_identity(config_lib.read_yaml(stored)), run_identity(config_lib.to_dict(config))
    changed = [f"{key} {planned[key]!r} (the run's: {made[key]!r})" for key in made if made[key] != planned[key]]
    if changed:
        raise RunDirectoryError(
            f"--resume {given}: {checkpoint_dir} was made by another run than this start asks for: {'; '.join(changed)}. "
            "A run continues only from its own state: drop the change to continue it, start a new run under another "
            "name (--set run_name=NAME), or start this one over with --overwrite instead of --resume")


def run_directory_advice(path: Path, flag: str) -> str | None:
    """What to pass instead when `flag` (--model, model.dir=) names a run directory rather than a model in it."""
    path = Path(path)
    if not path.is_dir() or path.name.startswith("step_") or (path / "config.json").is_file() or not any(
            (path / name).exists() for name in (RUN_CONFIG, LOCK_FILE)) and not any(path.glob(STEP_GLOB)):
        return None
    steps = sorted(path.glob(STEP_GLOB))
    stored = config_lib.read_yaml(path / RUN_CONFIG) if (path / RUN_CONFIG).is_file() else {}
    output = stored.get("output_dir") if trainer_of(stored) == "sft" else None
    written = f", or the model the warm-up wrote, {flag}{output}" if output and Path(output).is_dir() else ""
    if not steps:
        return (f"{flag}{path} is the directory of the run {path.name!r}, not a model, and it holds no checkpoint "
                f"yet{written or ' (pass a Hugging Face model directory)'}")
    return (f"{flag}{path} is the directory of the run {path.name!r}, not a model: pass one of its checkpoints, "
            f"e.g. its newest, {flag}{steps[-1]}{written}")


def run_directory_of(path) -> Path:
    """The run directory of a checkpoint or run directory given to --resume."""
    path = Path(path)
    return path.parent if path.name.startswith("step_") or (path / TRAINER_STATE).is_file() else path


def parse_run_arguments(description: str, default_config: str | None, argv: list[str] | None = None) -> argparse.Namespace:
    """A trainer's arguments: --config (repeatable), --set, and --resume or --overwrite. Without a default
    config, --config or --resume must be given."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = f"the resumed checkpoint's config.yaml, else {default_config}" if default_config else (
        "with --resume: the checkpoint's config.yaml")
    parser.add_argument("--config", action="append",
                        help=f"YAML config; repeat to merge several in order, later files winning (default: {default})")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    parser.add_argument("--resume", help="a checkpoint directory, or a run's checkpoint directory (latest step); "
                        "the run goes on writing into that run's directory")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in a run directory that holds an earlier run's checkpoints and logs (deletes them)")
    args = parser.parse_args(argv)
    args.resume = args.resume and config_lib.expand_path(args.resume)  # like every path key: ~ and $VARIABLES
    if not (args.config or args.resume or default_config):
        parser.error("pass --config FILE (or --resume a run's checkpoint)")
    if args.resume and args.overwrite:
        raise config_lib.ConfigError("--overwrite starts a run over, --resume continues one: pass only one")
    return args


def read_run_command_line(schema: type, trainer: str, description: str, default_config: str | None,
                          argv: list[str] | None = None) -> tuple[object, argparse.Namespace, Path | None]:
    """Both trainers' command line, read before torch loads: the config it names (with --resume and no
    --config, the checkpoint's own), the arguments, and the checkpoint --resume continues from."""
    args = parse_run_arguments(description, default_config, argv)
    checkpoint_dir = find(args.resume)
    # A run that stopped before its first checkpoint has only its run directory's config.yaml: it starts over.
    stored_config = args.resume and (checkpoint_dir or Path(args.resume)) / RUN_CONFIG
    if stored_config:
        check_trainer(stored_config, trainer, args.resume)
    config = config_lib.load(schema, args.config or [stored_config or default_config], args.set)
    return config, args, checkpoint_dir


def continue_in_resumed_run(config, resume: str | None) -> None:
    """A resumed run goes on in the directory it was resumed from (its name and parent), whatever its stored
    config says."""
    if resume:
        run_dir = run_directory_of(resume)
        config.run_name, config.checkpoint.dir = run_dir.name, str(run_dir.parent)


class RunPlan(NamedTuple):
    """What one start of train.py or train_sft.py does, decided once before torch loads (their plan_run) and
    then only read: nothing checks it again, and nothing edits the config after it."""

    config: object  # validated; in the resumed run's directory; Hub ids resolved to their snapshots; named
    resume: str | None  # --resume as given
    checkpoint_dir: Path | None  # what it continues from (None: a new run, or one stopped before its first)
    overwrite: bool
    lengths_checked: bool  # against the model's max_position_embeddings (False: the model is built first)


def plan_resume(config, resume: str | None, checkpoint_dir: Path | None, run_name_prefix: str = "") -> None:
    """The part of a plan both trainers share: a resumed run goes on in its directory and only from its own
    state; a new run without a run_name is named after the time (the ranks of torchrun agree on rank 0's)."""
    continue_in_resumed_run(config, resume)
    if checkpoint_dir:
        check_own_state(checkpoint_dir, config, resume)
    config.run_name = config.run_name or run_name_prefix + datetime.now().strftime("%Y%m%d-%H%M%S")


def latest_resumable(run_dir) -> Path | None:
    """The run directory's latest checkpoint that can be resumed (one with its trainer state); None if none."""
    candidates = sorted(Path(run_dir).glob(f"{STEP_GLOB}/{TRAINER_STATE}"))
    return candidates[-1].parent if candidates else None


def find(path) -> Path | None:
    """The checkpoint --resume `path` continues from: `path` itself, or the latest resumable checkpoint in
    the run directory `path`; None for a run that stopped before its first checkpoint (it starts over), and
    without --resume (`path` None)."""
    if path is None:
        return None
    path = Path(path)
    if (path / TRAINER_STATE).is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"--resume {path}: no such directory; pass a run directory (<checkpoint.dir>/<run_name>) "
                              f"or one of its {STEP_GLOB} checkpoints")
    latest = latest_resumable(path)
    if latest is not None:
        return latest
    if path.name.startswith("step_") or any(path.glob(STEP_GLOB)):
        raise CheckpointError(f"--resume {path}: no checkpoint with {TRAINER_STATE} there (weights only, saved with "
                              "checkpoint.optimizer_state: false, cannot be resumed); resume from a resumable step "
                              "or start over with --overwrite")
    if not (path / RUN_CONFIG).is_file():
        raise CheckpointError(f"--resume {path}: not a run directory (no {RUN_CONFIG}, no {STEP_GLOB}/{TRAINER_STATE}); "
                              "pass <checkpoint.dir>/<run_name>")
    return None
