"""The variants that need every rank's data under data parallel (torchrun, 2 CPU processes, gloo).

Per-batch reward std (all ranks' rewards), the KL term (its sum over ranks) and dynamic sampling (rounds
per rank, counts over ranks): a 2-rank update equals the single-process one, and a 2-rank train.py run
with all of them finishes and logs them. This file is also the ranks' program (one launch).
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import countdown_task  # noqa: E402
import distributed  # noqa: E402
import train  # noqa: E402
from config import OptimConfig  # noqa: E402
from grpo import LossConfig, compute_advantages, update_policy  # noqa: E402
from qwen2_model import Transformer  # noqa: E402
from test_distributed import countdown_dir, digit_reward, group_episodes, grpo_config  # noqa: E402, F401

LOSS = LossConfig(std_scope="batch", kl_beta=0.5, epochs_per_rollout=2, clip="ppo", clip_range_high=0.28)
VARIANT_RUN = ["--set", "rollout.dynamic_sampling=true", "--set", "loss.kl_beta=0.04", "--set", "loss.std_scope=batch",
               "--set", "loss.overlong_buffer_fraction=0.5"]


def perturbed_copy(model_dir: str) -> Transformer:
    """A fixed perturbation of the initial model, the same on every rank: a reference the KL is not 0 to."""
    reference = Transformer.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in reference.parameters():
            param += 0.05 * torch.randn(param.shape, generator=generator)
    return reference.requires_grad_(False)


def sgd_update(model_dir: str, episodes) -> tuple[Transformer, dict]:
    model = Transformer.from_pretrained(model_dir, dtype=torch.float32)
    policy = distributed.training_model(model, torch.device("cpu"), fsdp=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    advantages = compute_advantages(episodes, LOSS)
    update = update_policy(policy, distributed.OptimizerStep(policy, optimizer, 1e9), episodes, advantages, config=LOSS,
                           optim=OptimConfig(micro_batch_size=2, logprob_chunk_size=4), max_gen_len=16, pad_token_id=0,
                           reference_model=perturbed_copy(model_dir))
    return model, update


def rank_main(model_dir: str, out_dir: str) -> None:
    groups = group_episodes()
    share = [groups[:3], groups[3:]][distributed.rank()]  # uneven shares: the batch std must still be global
    model, metrics = sgd_update(model_dir, [episode for group in share for episode in group])
    if distributed.is_main_process():
        torch.save(({name: p.detach().clone() for name, p in model.named_parameters()}, metrics),
                   Path(out_dir) / "update.pt")
    countdown_task.reward = digit_reward
    for line in (Path(out_dir) / "runs.txt").read_text().splitlines():
        train.main(shlex.split(line))


if __name__ == "__main__":
    torch.set_num_threads(1)
    distributed.init_from_env()
    try:
        rank_main(*sys.argv[1:])
    finally:
        distributed.shutdown()


@pytest.fixture(scope="module")
def ranks_output(tmp_path_factory, tiny_model_dir, countdown_dir) -> Path:
    out = tmp_path_factory.mktemp("variant-ranks")
    config = grpo_config(out, "variants", tiny_model_dir, countdown_dir, fsdp=False)
    (out / "runs.txt").write_text(shlex.join(["--config", str(config), *VARIANT_RUN]) + "\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(Path(__file__)), str(tiny_model_dir), str(out)]
    result = subprocess.run(command, cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return out


@pytest.mark.slow
def test_two_rank_update_with_batch_std_and_kl_equals_single_process(ranks_output, tiny_model_dir):
    expected, expected_metrics = sgd_update(str(tiny_model_dir), [e for group in group_episodes() for e in group])
    parameters, metrics = torch.load(ranks_output / "update.pt")
    for name, param in expected.named_parameters():
        assert torch.allclose(parameters[name], param, rtol=0, atol=1e-6), name
    for key in ("loss", "grad_norm", "kl", "advantage_abs_mean"):
        assert metrics[key] == pytest.approx(expected_metrics[key], rel=1e-5, abs=1e-7), key
    assert expected_metrics["kl"] > 0


@pytest.mark.slow
def test_two_rank_run_with_dynamic_sampling_kl_and_batch_std_logs_them(ranks_output):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    event_files = list((ranks_output / "variants" / "logs").rglob("events.out.tfevents.*"))
    assert len(event_files) == 1, event_files
    events = EventAccumulator(str(event_files[0].parent), size_guidance={"scalars": 0}).Reload()
    rounds = [event.value for event in events.Scalars("train/dynamic_sampling_rounds")]
    assert len(rounds) == 2 and all(1 <= r <= 3 for r in rounds)
    # Each rank asks its 2 of the 4 questions per round; the count is over both ranks.
    questions = [event.value for event in events.Scalars("train/questions_sampled")]
    assert all(q % 2 == 0 and 4 <= q <= 12 for q in questions)
    assert [event.step for event in events.Scalars("train/kl")] == [1, 2]
    assert "reward/overlong_penalty" in events.Tags()["scalars"]
