"""Hub ids in model.dir and task.data_dir (hub.py), through the real huggingface_hub code without a network.

There is no Hub here, and huggingface_hub cannot write its cache offline, so `hub_cache` lays a cache out
by hand the way huggingface_hub's own downloads leave it (its documented cache layout):

    <HF_HUB_CACHE>/models--owner--name/blobs/<etag>                 the file contents (sha256 for LFS files,
                                                                     the git blob sha1 for the others)
                                      /snapshots/<commit>/<path>   relative symlinks into blobs/
                                      /refs/main                   the commit that `main` resolved to
                                      /trees/<commit>.json         the repository's listing at that commit
    (datasets--owner--name for datasets)

The listing names files that were never fetched (a README, other weight formats): what a download
restricted by allow_patterns leaves. huggingface_hub's own cache scanner checks the layout, and with
HF_HUB_OFFLINE=1 the unmodified snapshot_download resolves the ids from it.
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from huggingface_hub.utils import filter_repo_objects

import config as config_lib
import gsm8k_task
import hub
import inputs
import train
import train_sft
from test_train import countdown_dir, tiny_config  # noqa: F401 (fixture)
from test_train_sft import sft_config

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_ID = "tiny-org/tiny-qwen2"
COUNTDOWN_ID = "Jiayi-Pan/Countdown-Tasks-3to4"
GSM8K_ID = "openai/gsm8k"
NOT_FETCHED = ["README.md", ".gitattributes", "onnx/model.onnx", "pytorch_model.bin"]  # on the Hub, not needed


def add_to_hub_cache(cache: Path, repo_id: str, repo_type: str, files: dict[str, Path], listed_only=()) -> Path:
    """Cache `files` (repository path -> local file) as huggingface_hub stores a download of `repo_id`;
    `listed_only` are in the repository's listing but were not downloaded. Returns the snapshot directory."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    listing = {}
    for path, source in files.items():
        content = source.read_bytes()
        lfs = path.endswith((".safetensors", ".parquet"))  # large files live in Git LFS: their etag is the sha256
        etag = hashlib.sha256(content).hexdigest() if lfs else hashlib.sha1(
            b"blob %d\0" % len(content) + content).hexdigest()
        (repo / "blobs").mkdir(parents=True, exist_ok=True)
        (repo / "blobs" / etag).write_bytes(content)
        link = repo / "snapshots" / commit / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(repo / "blobs" / etag, link.parent))
        listing[path] = {"size": len(content), "blob_id": hashlib.sha1(content).hexdigest(),
                         **({"lfs_sha256": etag, "lfs_size": len(content)} if lfs else {})}
    for path in listed_only:
        listing[path] = {"size": 1, "blob_id": hashlib.sha1(path.encode()).hexdigest()}
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "trees").mkdir(exist_ok=True)
    (repo / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": listing}))
    return repo / "snapshots" / commit


def gsm8k_hub_layout(out: Path, jsonl_dir: Path) -> dict[str, Path]:
    """The committed GSM8K sample as the Hub stores openai/gsm8k: main/<split>-00000-of-00001.parquet."""
    files = {}
    for split in ("train", "test"):
        rows = [json.loads(line) for line in (jsonl_dir / f"{split}.jsonl").read_text().splitlines()]
        files[f"main/{split}-00000-of-00001.parquet"] = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), out / f"{split}.parquet")
    return files


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_model_dir, countdown_dir, gsm8k_sample_dir) -> Path:  # noqa: F811
    """An offline Hub cache holding the tiny model, a CountDown dataset and the GSM8K sample under their ids.

    HF_HUB_CACHE and HF_HUB_OFFLINE=1 are set for subprocesses; this process's huggingface_hub read them
    when it was imported, so its constants are set as those variables would have set them.
    """
    cache = tmp_path / "hf-cache"
    model_files = {path.name: path for path in tiny_model_dir.iterdir()}
    add_to_hub_cache(cache, MODEL_ID, "model", model_files, listed_only=NOT_FETCHED)
    add_to_hub_cache(cache, COUNTDOWN_ID, "dataset", {
        f"data/{path.name}": path for path in (countdown_dir / "data").glob("*.parquet")}, listed_only=["README.md"])
    (tmp_path / "gsm8k-parquet").mkdir()
    add_to_hub_cache(cache, GSM8K_ID, "dataset", gsm8k_hub_layout(tmp_path / "gsm8k-parquet", gsm8k_sample_dir),
                     listed_only=["README.md", "socratic/train-00000-of-00001.parquet"])
    for name, value in (("HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # no local directory named like an id, and outputs stay in tmp_path
    return cache


def cache_contents(cache: Path) -> list[str]:
    return sorted(str(path.relative_to(cache)) for path in cache.rglob("*"))


def test_the_hand_made_cache_is_what_huggingface_hubs_scanner_reads(hub_cache):
    info = huggingface_hub.scan_cache_dir(hub_cache)
    assert not info.warnings
    repos = {(repo.repo_type, repo.repo_id): repo for repo in info.repos}
    assert sorted(repos) == [("dataset", COUNTDOWN_ID), ("dataset", GSM8K_ID), ("model", MODEL_ID)]
    (revision,) = repos["model", MODEL_ID].revisions
    assert revision.refs == {"main"}
    assert sorted(file.file_name for file in revision.files) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.mark.parametrize("name, is_id", [
    ("Qwen/Qwen2.5-3B-Instruct", True), ("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("openai/gsm8k", True),
    ("checkpoints/countdown-sft", True),  # not here: a Hub id (the error names both readings)
    ("Qwen2.5-3B-Instruct", False), ("artifacts/cpu-demo/countdown", False), ("./Qwen/x", False),
    ("/data/Qwen/x", False), ("owner/a--b", False), ("owner/name.", False),
])
def test_what_reads_as_a_hub_id(name, is_id, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.is_hub_id(name) is is_id


def test_a_local_directory_wins_over_the_id_of_the_same_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen" / "Qwen2.5-3B-Instruct").mkdir(parents=True)
    assert not hub.is_hub_id("Qwen/Qwen2.5-3B-Instruct")
    assert hub.local_dir("Qwen/Qwen2.5-3B-Instruct", repo_type="model", files=hub.MODEL_FILES,
                         key="model.dir") == "Qwen/Qwen2.5-3B-Instruct"


def test_a_fetch_asks_only_for_the_files_the_loaders_read():
    """The patterns against real repositories' listings (Qwen2.5-3B-Instruct, SmolLM2, the two datasets)."""
    qwen = [".gitattributes", "LICENSE", "README.md", "config.json", "generation_config.json", "merges.txt",
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
            "tokenizer.json", "tokenizer_config.json", "vocab.json"]
    assert sorted(filter_repo_objects(qwen, allow_patterns=hub.MODEL_FILES)) == [
        "config.json", "generation_config.json", "merges.txt", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
        "tokenizer_config.json", "vocab.json"]
    smollm2 = ["README.md", "config.json", "generation_config.json", "merges.txt", "model.safetensors",
               "onnx/model.onnx", "onnx/model_fp16.onnx", "runs/events.out.tfevents.1", "special_tokens_map.json",
               "tokenizer.json", "tokenizer_config.json", "vocab.json", "pytorch_model.bin"]
    assert sorted(filter_repo_objects(smollm2, allow_patterns=hub.MODEL_FILES)) == [
        "config.json", "generation_config.json", "merges.txt", "model.safetensors", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json", "vocab.json"]
    gsm8k = ["README.md", "main/test-00000-of-00001.parquet", "main/train-00000-of-00001.parquet",
             "socratic/test-00000-of-00001.parquet", "socratic/train-00000-of-00001.parquet"]
    assert sorted(filter_repo_objects(gsm8k, allow_patterns=[inputs.GSM8K_HUB_FILES])) == [
        "main/test-00000-of-00001.parquet", "main/train-00000-of-00001.parquet"]
    countdown = [".gitattributes", "README.md", "data/train-00000-of-00001.parquet"]
    assert list(filter_repo_objects(countdown, allow_patterns=[inputs.COUNTDOWN_HUB_FILES])) == [
        "data/train-00000-of-00001.parquet"]


@pytest.mark.slow
def test_evaluate_loads_a_model_and_dataset_by_hub_id_offline(hub_cache, tmp_path):
    """The real command line, HF_HUB_OFFLINE=1 in its environment; the cache is only read."""
    before = cache_contents(hub_cache)
    result = subprocess.run([sys.executable, str(REPO_ROOT / "evaluate.py"), "--model", MODEL_ID, "--data",
                             COUNTDOWN_ID, "--max-questions", "2", "--threads", "1", "--set", "eval.max_gen_len=4",
                             "--set", "task.test_size=4"], capture_output=True, text=True, timeout=300, check=True)
    assert '"num_questions": 2' in result.stdout
    out = tmp_path / "tiny-org--tiny-qwen2_eval_test.jsonl"  # in the working directory, not in the cache
    assert len(out.read_text().splitlines()) == 2
    assert cache_contents(hub_cache) == before


def test_train_resolves_ids_to_snapshots_before_the_run_starts(hub_cache, tmp_path):
    config = tiny_config(tmp_path, MODEL_ID, COUNTDOWN_ID, "optim.num_steps=1", "eval.interval=0")
    train.train(config)
    model_snapshot = next((hub_cache / "models--tiny-org--tiny-qwen2" / "snapshots").iterdir())
    data_snapshot = next((hub_cache / "datasets--Jiayi-Pan--Countdown-Tasks-3to4" / "snapshots").iterdir())
    saved = config_lib.read_yaml(tmp_path / "checkpoints" / "tiny" / "step_000001" / "config.yaml")
    assert (saved["model"]["dir"], saved["task"]["data_dir"]) == (str(model_snapshot), str(data_snapshot))
    assert (tmp_path / "checkpoints" / "tiny" / "step_000001" / "tokenizer.json").is_file()


def test_train_sft_fetches_gsm8k_in_the_hubs_layout(hub_cache, tmp_path):
    config_path = tmp_path / "sft.yaml"
    config_lib.dump(sft_config(tmp_path, MODEL_ID, GSM8K_ID, "task.name=gsm8k", "optim.num_steps=1",
                               "eval.interval=0", "data.eval_size=4", "data.max_seq_len=1024"), config_path)
    train_sft.main(["--config", str(config_path)])
    assert (tmp_path / "sft-out" / "model.safetensors").is_file()


def test_gsm8k_sft_data_reads_the_hub_id_as_the_jsonl_it_was_made_from(hub_cache, tmp_path, gsm8k_sample_dir):
    gsm8k_task.main(["sft-data", "--data", GSM8K_ID, "--out", str(tmp_path / "hub.jsonl")])
    gsm8k_task.main(["sft-data", "--data", str(gsm8k_sample_dir), "--out", str(tmp_path / "local.jsonl")])
    assert (tmp_path / "hub.jsonl").read_text() == (tmp_path / "local.jsonl").read_text()


@pytest.mark.parametrize("model_id, data_id, message", [
    ("tiny-org/not-cached", COUNTDOWN_ID,
     "missing input: model.dir: 'tiny-org/not-cached' is not a local directory, and the Hub model of that id could "
     "not be fetched: the Hub cannot be reached and its cache {cache} does not hold all of it. On a machine with a "
     "network run `hf download tiny-org/not-cached --local-dir DIR` (or `git lfs install && git clone "
     "https://huggingface.co/tiny-org/not-cached DIR`), copy DIR here and set model.dir=DIR\n"),
    (MODEL_ID, "someone/countdown",
     "missing input: task.data_dir: 'someone/countdown' is not a local directory, and the Hub dataset of that id "
     "could not be fetched: the Hub cannot be reached and its cache {cache} does not hold all of it. On a machine "
     "with a network run `hf download someone/countdown --repo-type dataset --local-dir DIR` (or `git lfs install && "
     "git clone https://huggingface.co/datasets/someone/countdown DIR`), copy DIR here and set task.data_dir=DIR\n"),
])
def test_offline_with_nothing_cached_is_one_line_naming_the_id(model_id, data_id, message, hub_cache, tmp_path,
                                                               capsys):
    config_lib.dump(tiny_config(tmp_path, model_id, data_id), tmp_path / "run.yaml")
    before = sorted(tmp_path.iterdir())
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--config", str(tmp_path / "run.yaml")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == message.format(cache=hub_cache)
    assert sorted(tmp_path.iterdir()) == before  # no run directory, no logs


def test_a_cached_snapshot_missing_a_needed_file_is_refused_offline(hub_cache, tmp_path, capsys):
    (next((hub_cache / "models--tiny-org--tiny-qwen2" / "snapshots").iterdir()) / "tokenizer.json").unlink()
    config_lib.dump(tiny_config(tmp_path, MODEL_ID, COUNTDOWN_ID), tmp_path / "run.yaml")
    with pytest.raises(SystemExit):
        train.main(["--config", str(tmp_path / "run.yaml")])
    assert capsys.readouterr().err.startswith(f"missing input: model.dir: '{MODEL_ID}' is not a local directory, and "
                                              "the Hub model of that id could not be fetched: the Hub cannot be reached")
