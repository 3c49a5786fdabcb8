"""bfloat16, the GPU recipes' dtype, on a CPU: a few SFT and GRPO steps run and give finite losses.

The tiny fixture checks the code path in CI; where a SmolLM2-135M-Instruct directory is found ($SMOLLM2_DIR,
made by ../shared/tools/make_smollm2.sh or downloaded from the Hub), the real-model recipe's configs run a
step of each stage in bfloat16 too.
"""

import math
import os
from pathlib import Path

import pytest

import config as config_lib
import countdown_task
import train
import train_sft
from test_train import digit_reward, read_scalars, tiny_config  # noqa: F401 (a fixture)
from test_train_sft import sft_config

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def countdown_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("countdown-bf16")
    countdown_task.main(["generate", "--out", str(out), "--size", "80", "--seed", "2", "--max-number", "20",
                         "--with-solutions"])
    return out


def assert_finite_losses(log_dir: Path, tag: str, at_least: int) -> None:
    values = [value for _, value in read_scalars(log_dir).get(tag, [])]
    assert len(values) >= at_least and all(math.isfinite(value) for value in values), values


@pytest.mark.parametrize("checkpointing", [False, True])
def test_sft_and_grpo_steps_in_bfloat16(tmp_path, tiny_model_dir, countdown_dir, digit_reward, checkpointing):
    common = ["model.dtype=bfloat16", f"model.gradient_checkpointing={checkpointing}",
              "task.question_last=true"]
    train_sft.train_sft(sft_config(tmp_path, tiny_model_dir, countdown_dir, *common, "optim.num_steps=3",
                                   "eval.interval=0"))
    assert_finite_losses(tmp_path / "logs" / "sft", "train/loss", 3)
    train.train(tiny_config(tmp_path, tmp_path / "sft-out", countdown_dir, *common, "eval.interval=0"))
    assert_finite_losses(tmp_path / "logs" / "tiny", "train/loss", 1)  # a step whose groups are all flat has none


@pytest.mark.slow
def test_real_model_recipe_steps_in_bfloat16(tmp_path):
    model_dir = os.environ.get("SMOLLM2_DIR")
    if not model_dir or not (Path(model_dir) / "model.safetensors").is_file():
        pytest.skip("no SmolLM2-135M-Instruct directory: set SMOLLM2_DIR (../shared/tools/make_smollm2.sh OUT .)")
    data_dir = tmp_path / "countdown"
    countdown_task.main(["generate", "--out", str(data_dir), "--size", "300", "--seed", "0", "--max-number", "99",
                         "--max-numbers", "3", "--min-numbers", "2", "--with-solutions"])
    shared = ["model.dtype=bfloat16", f"task.data_dir={data_dir}", f"logging.log_dir={tmp_path / 'logs'}",
              "progress=false", "task.test_size=16"]
    sft = config_lib.load(train_sft.SFTConfig, [str(REPO_ROOT / "configs" / "smollm2_cpu_sft.yaml")],
                          [*shared, f"model.dir={model_dir}", f"output_dir={tmp_path / 'sft'}", "optim.num_steps=2",
                           "optim.batch_size=4", "optim.micro_batch_size=4", "run_name=sft"])
    train_sft.train_sft(sft)
    assert_finite_losses(tmp_path / "logs" / "sft", "train/loss", 2)
    grpo = config_lib.load(train.TrainConfig, [str(REPO_ROOT / "configs" / "smollm2_cpu.yaml")],
                           [*shared, f"model.dir={tmp_path / 'sft'}", "optim.num_steps=2", "rollout.episodes_per_step=8",
                            "rollout.max_gen_len=24", "eval.interval=0", "run_name=grpo",
                            f"checkpoint.dir={tmp_path / 'checkpoints'}", "rollout.temperature=2.0",
                            "loss.kl_beta=0.01"])  # a loss (the KL term) even when every group is flat
    train.train(grpo)
    assert_finite_losses(tmp_path / "logs" / "grpo", "train/loss", 1)


@pytest.mark.slow
def test_bfloat16_run_with_master_weights_resumes_exactly(tmp_path, tiny_model_dir, countdown_dir, digit_reward):
    """The float32 master weights (optim.master_weights, offloaded with the moments) are part of the trainer state:
    a run cut after 2 steps and resumed ends with the uninterrupted run's weights and masters, bit for bit."""
    import torch

    common = ["model.dtype=bfloat16", "optim.memory_efficient_adamw=true", "optim.learning_rate=1e-2",
              "eval.interval=0", "checkpoint.interval=2"]
    train.train(tiny_config(tmp_path / "full", tiny_model_dir, countdown_dir, *common, "optim.num_steps=4"))
    train.train(tiny_config(tmp_path / "cut", tiny_model_dir, countdown_dir, *common, "optim.num_steps=2"))
    train.train(tiny_config(tmp_path / "cut", tiny_model_dir, countdown_dir, *common, "optim.num_steps=4"),
                resume=str(tmp_path / "cut" / "checkpoints" / "tiny"))
    full, cut = (torch.load(tmp_path / run / "checkpoints/tiny/step_000004/trainer_state.pt", weights_only=False)
                 for run in ("full", "cut"))
    masters = [state["master"] for state in full["optimizer"]["state"].values()]
    assert masters and all(master.dtype == torch.float32 for master in masters)
    for key, state in full["optimizer"]["state"].items():
        assert torch.equal(state["master"], cut["optimizer"]["state"][key]["master"])
    for name in ("model.safetensors",):
        assert (tmp_path / "full/checkpoints/tiny/step_000004" / name).read_bytes() == (
            tmp_path / "cut/checkpoints/tiny/step_000004" / name).read_bytes()


@pytest.mark.parametrize("flags, device, expected", [
    ("fpu avx2 avx512f avx512_bf16", "cpu", "bfloat16"),  # AMD Zen 4, Intel Cooper Lake
    ("fpu avx2 avx512f amx_bf16 amx_tile", "cpu", "bfloat16"),  # Intel Sapphire Rapids
    ("fpu avx2 avx512f", "cpu", "float32"),  # bf16 emulated: no faster than float32
    ("", "cpu", "float32"),  # no /proc/cpuinfo (macOS, Windows)
    ("fpu avx2", "cuda", "bfloat16"),
    ("fpu avx2 avx512_bf16", "mps", "float32"),
])
def test_auto_dtype_is_bfloat16_where_bf16_matmuls_are_native(tmp_path, monkeypatch, flags, device, expected):
    import torch

    import runtime

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n" if flags else "")
    real_path = runtime.Path
    monkeypatch.setattr(runtime, "Path", lambda name: cpuinfo if name == "/proc/cpuinfo" else real_path(name))
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    runtime.cpu_has_bf16_matmul.cache_clear()
    try:
        assert runtime.model_dtype("auto", torch.device(device)) == getattr(torch, expected)
        assert runtime.model_dtype("float32", torch.device(device)) == torch.float32  # a named dtype is kept
    finally:
        runtime.cpu_has_bf16_matmul.cache_clear()


@pytest.mark.parametrize("native_bf16", [True, False])
def test_a_grpo_run_in_auto_dtype_loads_the_model_in_the_machines_dtype(tmp_path, tiny_model_dir, countdown_dir,
                                                                        digit_reward, monkeypatch, native_bf16):
    import torch

    import runtime

    loaded = []
    real_from_pretrained = runtime.Transformer.from_pretrained
    monkeypatch.setattr(runtime.Transformer, "from_pretrained",
                        lambda *args, **kwargs: loaded.append(kwargs["dtype"]) or real_from_pretrained(*args, **kwargs))
    monkeypatch.setattr(runtime, "cpu_has_bf16_matmul", lambda: native_bf16)
    config = tiny_config(tmp_path, tiny_model_dir, countdown_dir, "model.dtype=auto", "optim.num_steps=1",
                         "eval.interval=0", "checkpoint.interval=0", "device=cpu")
    train.train(config)
    assert loaded and set(loaded) == {torch.bfloat16 if native_bf16 else torch.float32}
