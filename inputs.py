"""The files a run reads and the directories it writes, checked before torch loads, and the command that
fixes each: a model directory (config.json, weights, tokenizer), a task's data files, output directories.

The entry points run these checks on their command line, before they import torch (see
check_command_line in config.py): a wrong path, a model directory without its config.json, an empty
data directory or a read-only log directory is answered in about a second, with one line, and before
any file is created. Loading (runtime.load_model, tokenizer, the task modules) calls the same functions, so a
file is judged the same way before and after torch loads. Nothing here imports more than the standard
library, checkpoint.py (what a run directory holds) and hub.py (which fetches a Hub id; pyarrow only inside read_parquet, which reads the rows).
"""

import contextlib
import json
import os
from pathlib import Path

import checkpoint
import hub
from config import BootstrapConfig, ConfigError, DataError, InputError, MissingInputError, ModelSetup, TaskConfig

# ----------------------------------------------------------------------------- model directory

REQUIRED_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def model_download_hint(model_dir: Path) -> str:
    # A directory named like a Hub model (Qwen2.5-Math-1.5B, ...) gets that model's id and clone command.
    name = model_dir.name if model_dir.name.startswith("Qwen") else "Qwen2.5-3B-Instruct"
    return (f"Give a Hub id to download it at start-up (e.g. model.dir=Qwen/{name}), or clone it first: "
            f"git lfs install && git clone https://huggingface.co/Qwen/{name} {model_dir}")


# A LoRA adapter in PEFT's layout (qwen2_model.save_adapter): a directory of its own, or a LoRA run's checkpoint's
# adapter/ (checkpoint.save), beside its merged weights after the last step and alone before.
ADAPTER_CONFIG = "adapter_config.json"


def adapter_dir(model_dir: Path) -> Path | None:
    """The LoRA adapter that `model_dir` stands for when it holds no weights of its own (no config.json): itself,
    a PEFT adapter directory, or its adapter/, a LoRA run's checkpoint; None for a model directory."""
    if (model_dir / "config.json").is_file():
        return None
    return next((candidate for candidate in (model_dir, model_dir / checkpoint.ADAPTER_SUBDIR)
                 if (candidate / ADAPTER_CONFIG).is_file()), None)


def adapter_base(adapter: Path) -> Path:
    """The model directory the adapter goes on: its base_model_name_or_path (a Hub id is fetched)."""
    config = read_json(adapter / ADAPTER_CONFIG)
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not base:
        raise DataError(f"{adapter / ADAPTER_CONFIG} names no base_model_name_or_path: the model the adapter goes on")
    base = Path(hub.local_dir(base, repo_type="model", key=f"{adapter / ADAPTER_CONFIG}: base_model_name_or_path",
                              files=hub.MODEL_FILES))
    if adapter_dir(base) is not None:
        raise DataError(f"{adapter / ADAPTER_CONFIG}: its base model {base} is itself an adapter; name the model "
                        "directory it goes on")
    return base


def weights_dir(model_dir: Path) -> Path:
    """Where the model's config.json and weights are: model_dir, or for an adapter its base model's directory."""
    adapter = adapter_dir(model_dir)
    return adapter_base(adapter) if adapter else model_dir


def tokenizer_dir(model_dir: Path) -> Path:
    """Where the model's tokenizer is: model_dir's own files (a LoRA run's checkpoint keeps a copy), else for an
    adapter its base model's."""
    own = all((model_dir / name).is_file() for name in REQUIRED_TOKENIZER_FILES)
    return model_dir if own or adapter_dir(model_dir) is None else weights_dir(model_dir)


def read_hf_config(model_dir: Path) -> dict:
    """A model directory's config.json (an adapter's: its base model's)."""
    model_dir = weights_dir(model_dir) if model_dir.is_dir() else model_dir
    if model_dir.exists() and not model_dir.is_dir():
        raise MissingInputError(f"model directory '{model_dir}' is a file, not a directory: pass the directory that "
                                f"holds config.json and the weights, or a Hub id")
    if not model_dir.is_dir():
        raise MissingInputError(f"model directory '{model_dir}' does not exist. {model_download_hint(model_dir)}")
    config_path = model_dir / "config.json"
    advice = checkpoint.run_directory_advice(model_dir, "")
    if advice:
        raise MissingInputError(advice)
    if not config_path.is_file():
        raise MissingInputError(f"'{model_dir}' has no config.json, so it is not a Hugging Face model directory. "
                                f"{model_download_hint(model_dir)}")
    hf_config = read_json(config_path)
    if not isinstance(hf_config, dict):
        raise DataError(f"{config_path}: expected a JSON object of model settings")
    return hf_config


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory (one, or the shards its index lists), each present and
    not a Git LFS pointer."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = read_json(index_path)
        if not isinstance(weight_map, dict) or not isinstance(weight_map.get("weight_map"), dict):
            raise DataError(f"{index_path}: expected a JSON object with a \"weight_map\"; download it again")
        files = [model_dir / name for name in sorted(set(weight_map["weight_map"].values()))]
    else:
        files = [model_dir / "model.safetensors"]
    for file in files:
        if not file.is_file():
            raise MissingInputError(f"Weight file '{file}' is missing. {model_download_hint(model_dir)}")
        with open(file, "rb") as handle:
            if handle.read(7) == b"version":
                raise DataError(f"'{file}' is a git-lfs pointer, not the weights: run `git lfs install && "
                                f"git lfs pull` inside {model_dir}.")
    return files


def check_tokenizer_files(model_dir: Path) -> None:
    for name in REQUIRED_TOKENIZER_FILES:
        if not (model_dir / name).is_file():
            raise MissingInputError(f"'{model_dir / name}' is missing: the model directory must hold the Hugging Face "
                                    f"tokenizer files ({', '.join(REQUIRED_TOKENIZER_FILES)}), as a clone of e.g. "
                                    "https://huggingface.co/Qwen/Qwen2.5-3B-Instruct does.")


def check_model_dir(model_dir: Path, key: str = "model.dir") -> dict:
    """Everything loading a model directory (or an adapter and its base model) reads is there: returns its
    config.json."""
    with named(key):
        if (adapter := adapter_dir(model_dir)) and not (adapter / "adapter_model.safetensors").is_file():
            raise MissingInputError(f"{adapter} has {ADAPTER_CONFIG} but no adapter_model.safetensors: copy the "
                                    "whole adapter directory")
        hf_config = read_hf_config(model_dir)
        weight_files(weights_dir(model_dir))
        check_tokenizer_files(tokenizer_dir(model_dir))
    return hf_config


def read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{path} is not JSON ({error}); copy or download it again") from None


# ----------------------------------------------------------------------------- task data

COUNTDOWN_HUB_ID = "Jiayi-Pan/Countdown-Tasks-3to4"
# What a Hub id of a dataset fetches: the files the loaders read (CountDown: data/*.parquet; GSM8K: both splits
# of the "main" config).
COUNTDOWN_HUB_FILES = "data/*.parquet"
GSM8K_HUB_FILES = "main/*.parquet"
GSM8K_DOWNLOAD_HINT = ("set task.data_dir to the Hub id openai/gsm8k to download GSM8K at start-up, or clone it with "
                       "`git lfs install && git clone https://huggingface.co/datasets/openai/gsm8k` and pass the clone's "
                       "directory")
PARQUET_MAGIC = b"PAR1"  # the first and the last four bytes of every parquet file


def countdown_data_hint(data_dir: Path, with_solutions: bool = False) -> str:
    generate = f"uv run countdown_task.py generate --out {data_dir} --size 100000 --seed 0"
    if with_solutions:  # the Hub dataset has none
        return f"SFT learns from reference solutions: generate data with them, `{generate} --with-solutions`"
    return (f"Set task.data_dir to the Hub id {COUNTDOWN_HUB_ID} to download the Hub dataset at start-up (or clone "
            f"it: `git lfs install && git clone https://huggingface.co/datasets/{COUNTDOWN_HUB_ID} {data_dir}`), "
            f"or generate one with `{generate}`")


def countdown_files(data_dir: Path, with_solutions: bool = False) -> list[Path]:
    """data_dir/data/*.parquet in name order, each a whole parquet file."""
    files = sorted((data_dir / "data").glob("*.parquet"))
    if not files:
        raise MissingInputError(f"No CountDown data in {data_dir}: expected parquet files at {data_dir / 'data'}/"
                                f"*.parquet. {countdown_data_hint(data_dir, with_solutions)}.")
    for file in files:
        check_parquet(file, f"run `git lfs install && git lfs pull` in {data_dir}")
    return files


def gsm8k_files(data_dir: Path, split: str) -> list[Path]:
    """The files of one GSM8K split: <split>.jsonl, else the Hub's main/<split>-*.parquet."""
    expected = f"{split}.jsonl or main/{split}-00000-of-00001.parquet"
    if not data_dir.is_dir():
        raise MissingInputError(f"GSM8K directory {data_dir} does not exist (expected {expected} in it); "
                                f"{GSM8K_DOWNLOAD_HINT}")
    if (data_dir / f"{split}.jsonl").is_file():
        return [data_dir / f"{split}.jsonl"]
    files = sorted((data_dir / "main").glob(f"{split}-*.parquet"))
    if not files:
        raise MissingInputError(f"GSM8K directory {data_dir} has neither {expected}; {GSM8K_DOWNLOAD_HINT}")
    for file in files:
        check_parquet(file, "run `git lfs pull` in the GSM8K clone")
    return files


def check_data(task: TaskConfig, splits: tuple[str, ...] = ("train", "test"), with_solutions: bool = False) -> None:
    """The task's data files for `splits` are there and whole (CountDown keeps both splits in the same files)."""
    with named("task.data_dir"):
        if task.name == "countdown":
            countdown_files(Path(task.data_dir), with_solutions)
        elif task.name == "gsm8k":
            for split in splits:
                gsm8k_files(Path(task.data_dir), split)


def check_parquet(path: Path, lfs_hint: str) -> None:
    """A parquet file begins and ends with PAR1: a Git LFS pointer does not begin so, a truncated file does not
    end so. (Damage in between shows only when the rows are read: read_parquet.)"""
    with path.open("rb") as file:
        if file.read(4) != PARQUET_MAGIC:
            raise DataError(f"{path} is not a parquet file (a Git LFS pointer?); {lfs_hint}")
        size = file.seek(0, os.SEEK_END)
        file.seek(max(size - 4, 0))
        if size < 12 or file.read(4) != PARQUET_MAGIC:
            raise DataError(f"{path} is truncated (it does not end as a parquet file does); download, copy or "
                            "generate it again")


def read_parquet(path: Path):
    """The table in a parquet file; a damaged one is a DataError naming the file (pyarrow's own message does not)."""
    import pyarrow as pa  # here, so the checks above need nothing but the standard library
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path)
    except (OSError, pa.ArrowException) as error:
        raise DataError(f"{path} cannot be read ({error}): the file is damaged; download, copy or generate it "
                        "again") from None


# ----------------------------------------------------------------------------- what a run reads


def check_model_and_data(task: TaskConfig | None, model: ModelSetup | None, *, bootstrap: BootstrapConfig | None = None,
                         splits: tuple[str, ...] = ("train", "test"), with_solutions: bool = False) -> None:
    """Replace a Hub id in task.data_dir or model.dir by its snapshot in the Hub cache, fetched if need be, then
    check the data (`splits` of `task`) and the model directory a run reads, before torch loads (None: that input
    is not needed); a missing one that `bootstrap` does not build stops with the command that makes it."""
    bootstrap = bootstrap or BootstrapConfig()
    if task is not None and task.is_builtin and not bootstrap.builds_data(task):  # a module of yours reads its own
        task.data_dir = hub.local_dir(task.data_dir, repo_type="dataset", key="task.data_dir", files=[
            COUNTDOWN_HUB_FILES if task.name == "countdown" else GSM8K_HUB_FILES])
    if task is not None and (Path(task.data_dir).exists() or not bootstrap.builds_data(task)):
        check_data(task, splits, with_solutions)
    if model is not None and not bootstrap.builds_model(model.dir):
        model.dir = hub.local_dir(model.dir, repo_type="model", key="model.dir", files=hub.MODEL_FILES)
    if model is not None and (Path(model.dir).exists() or not bootstrap.builds_model(model.dir)):
        check_model_dir(Path(model.dir))


# ----------------------------------------------------------------------------- what a run writes


def check_writable(key: str, directory) -> None:
    """`directory` exists or can be created, and can be written: its nearest existing ancestor is a writable
    directory. Checked without creating anything."""
    path = Path(directory).absolute()
    existing = next(parent for parent in (path, *path.parents) if parent.exists())
    if not existing.is_dir():
        raise ConfigError(f"{key}: cannot create {directory}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: cannot write into {existing} (read-only or no permission); choose a directory "
                          "you can write to")


@contextlib.contextmanager
def named(key: str):
    """Put the config key in front of the message of an input error raised in the block (same error class)."""
    try:
        yield
    except InputError as error:
        raise type(error)(f"{key}: {error}") from None
