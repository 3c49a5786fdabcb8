"""Models and datasets named by their Hugging Face Hub id, fetched at start-up into the Hub's cache.

`model.dir` and `task.data_dir` take a local directory or a Hub id. The rule, in this order:
1. a path that exists locally is that local directory, used as it is;
2. a missing path of the form `owner/name` (the Hub's id grammar: letters, digits, '-', '_', '.';
   one '/') is a Hub id: huggingface_hub downloads the files our loaders read, with its progress
   bar, into its standard cache ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub),
   and the key becomes that snapshot directory;
3. anything else is a missing local directory, reported as such (inputs.check_model_and_data).
So `Qwen/Qwen2.5-3B-Instruct` is fetched unless ./Qwen/Qwen2.5-3B-Instruct exists, while `./x/y`,
absolute paths and paths with two or more '/' are always local. With HF_HUB_OFFLINE=1 (or no network)
only the cache is read; offline users can also point the key at a local copy of the repository.
"""

import logging
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id

import checkpoint
from config import InputError

logger = logging.getLogger("hub")

# What qwen2_model.py (config.json, the weights and their index) and tokenizer.py read, plus the tokenizer
# files a checkpoint copies beside its weights; nothing else of a repository (other formats, READMEs).
MODEL_FILES = ["config.json", "model.safetensors", "model.safetensors.index.json", "model-*.safetensors",
               *checkpoint.TOKENIZER_FILES]


class HubError(InputError):
    label = "missing input"


def is_hub_id(name: str) -> bool:
    """Whether `name` names a Hub repository rather than a local path (the rule above)."""
    if Path(name).exists() or name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def local_dir(name: str, *, repo_type: str, files: list[str], key: str) -> str:
    """`name` itself, or for a Hub id its snapshot in the Hub cache, holding `files` (glob patterns),
    downloaded where missing; `key` (e.g. "model.dir") names the setting in an error."""
    if not is_hub_id(name):
        return name
    try:
        path = snapshot_download(name, repo_type=repo_type, allow_patterns=files)
    except OSError as error:  # huggingface_hub's errors: not cached offline, no such repository, HTTP, disk
        raise HubError(f"{key}: '{name}' is not a local directory, and the Hub {repo_type} of that id could not be "
                       f"fetched: {reason(error)}. {how_to_get(name, repo_type, key)}") from None
    logger.info("%s: the Hub %s %s is %s", key, repo_type, name, path)
    return path


def reason(error: OSError) -> str:
    if isinstance(error, LocalEntryNotFoundError):  # offline (HF_HUB_OFFLINE=1 or no network), not cached in full
        return f"the Hub cannot be reached and its cache {constants.HF_HUB_CACHE} does not hold all of it"
    if isinstance(error, RepositoryNotFoundError):  # also a gated or private one without a token
        return ("the Hub has no such repository, or it is private or gated (accept its terms on huggingface.co, "
                "then `hf auth login`)")
    first_line = str(error).strip().partition("\n")[0]  # huggingface_hub's messages run over several lines
    return f"{type(error).__name__}: {first_line}"


def how_to_get(repo_id: str, repo_type: str, key: str) -> str:
    """The one-line fix for a machine without the Hub: fetch the repository elsewhere, point `key` at the copy."""
    flag, url_type = (" --repo-type dataset", "datasets/") if repo_type == "dataset" else ("", "")
    return (f"On a machine with a network run `hf download {repo_id}{flag} --local-dir DIR` (or `git lfs "
            f"install && git clone https://huggingface.co/{url_type}{repo_id} DIR`), copy DIR here and set {key}=DIR")
