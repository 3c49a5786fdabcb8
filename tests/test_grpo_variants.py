"""The GRPO variants (DAPO, GSPO, Dr. GRPO, CISPO, SAPO, RLOO, REINFORCE++ whitening, top-entropy tokens, per-batch
std, KL to a reference, truncated importance sampling) against values computed by hand."""

import copy
import dataclasses
import json
import logging
import math
from pathlib import Path

import pytest
import torch

import ablate
import countdown_task
import train
import config as config_lib
from config import ConfigError
from data_types import Episode
from distributed import OptimizerStep
from grpo import (LossConfig, shape_rewards, compute_advantages, high_entropy_threshold, k3_kl, overlong_penalty,
                  sample_informative_groups, surrogate_token_losses, update_policy, whiten_advantages)
from qwen2_model import Transformer
from config import OptimConfig
from test_grpo import (TOKEN, assert_same_parameters, expected_sgd_update, per_token_log_probs, policy,  # noqa: F401
                       sample_episodes)
from test_train import countdown_dir, digit_reward, read_scalars, tiny_config  # noqa: F401 (fixtures)

REPO_ROOT = Path(__file__).resolve().parents[1]
VARIANTS = REPO_ROOT / "configs" / "variants"
BASES = ["config.yaml", "config_24GB.yaml", "configs/cpu_demo.yaml", "configs/gsm8k.yaml"]
# What defines an algorithm, so what every preset states: the whole loss section, dynamic sampling and
# overlong filtering.
ALGORITHM_KEYS = sorted({f"loss.{field.name}" for field in dataclasses.fields(LossConfig)}
                        | {"rollout.dynamic_sampling", "rollout.dynamic_sampling_max_rounds",
                           "rollout.dynamic_sampling_questions_per_round", "optim.skip_unfinished_episodes"})
# Plain GRPO as docs/variants.md states it (and every default is): GRPO:Zero's loss, one on-policy step.
PLAIN_GRPO = {
    "rollout.dynamic_sampling": False, "rollout.dynamic_sampling_max_rounds": 3,
    "rollout.dynamic_sampling_questions_per_round": None, "optim.skip_unfinished_episodes": False,
    "loss.baseline": "group_mean", "loss.std_normalization": True, "loss.std_estimator": "population",
    "loss.advantage_eps": 1e-4, "loss.aggregation": "token", "loss.aggregation_constant": None,
    "loss.epochs_per_rollout": 1, "loss.clip": "none", "loss.clip_range": 0.2, "loss.clip_range_high": None,
    "loss.importance_sampling": "token", "loss.std_scope": "group", "loss.overlong_buffer_fraction": 0.0,
    "loss.overlong_penalty_factor": 1.0, "loss.format_reward_weight": 1.0, "loss.try_reward_weight": 0.0,
    "loss.try_reward_distinct": False,
    "loss.kl_beta": 0.0, "loss.sapo_tau_positive": 1.0,
    "loss.sapo_tau_negative": 1.05, "loss.whiten_advantages": False, "loss.top_entropy_fraction": None,
    "loss.sampler_is_cap": None,
}
# docs/variants.md's table: each preset's changes to plain GRPO.
PRESETS = {
    "grpo": {},
    "batch_std": {"loss.std_scope": "batch"},
    "dapo": {"rollout.dynamic_sampling": True, "loss.epochs_per_rollout": 2, "loss.clip": "ppo",
             "loss.clip_range_high": 0.28, "loss.overlong_buffer_fraction": 0.2},
    "dr_grpo": {"loss.std_normalization": False, "loss.aggregation": "constant"},
    "grpo_kl": {"loss.kl_beta": 0.04},
    "gspo": {"loss.importance_sampling": "sequence", "loss.aggregation": "sequence", "loss.epochs_per_rollout": 2,
             "loss.clip": "ppo", "loss.clip_range": 3e-4, "loss.clip_range_high": 4e-4},
    "ppo_k2": {"loss.epochs_per_rollout": 2, "loss.clip": "ppo"},
    "cispo": {"loss.epochs_per_rollout": 2, "loss.clip": "cispo", "loss.clip_range_high": 4.0},
    "sapo": {"loss.aggregation": "sequence", "loss.epochs_per_rollout": 2, "loss.clip": "sapo"},
    "rloo": {"loss.baseline": "leave_one_out", "loss.std_normalization": False},
    "reinforce_pp": {"loss.std_normalization": False, "loss.whiten_advantages": True},
    "top_entropy": {"loss.top_entropy_fraction": 0.2},
}


def make_episode(question_index, reward, num_tokens=1, text=""):
    return Episode(question_index, "", [1], [2] * num_tokens, text, True, reward, {"format_reward": 0.1})


def log(values):
    return torch.log(torch.tensor(values, dtype=torch.float64))


# ----------------------------------------------------------------------------- every switch off


def test_defaults_are_the_plain_grpo_formulas_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    log_probs, old = -torch.rand(3, 5, generator=generator), -torch.rand(3, 5, generator=generator)
    advantages = torch.randn(3, 1, generator=generator)
    mask = torch.ones(3, 5, dtype=torch.bool)
    losses, ratio, clipped = surrogate_token_losses(log_probs, old, advantages, LossConfig(), mask=mask)
    assert torch.equal(losses, -(torch.exp(log_probs - old) * advantages)) and not clipped.any()
    losses, _, _ = surrogate_token_losses(log_probs, old, advantages, LossConfig(clip="ppo", clip_range=0.1), mask=mask)
    plain_ratio = torch.exp(log_probs - old)
    assert torch.equal(losses, -torch.minimum(plain_ratio * advantages, plain_ratio.clamp(0.9, 1.1) * advantages))

    rewards = [1.1, 0.1, 0.0, 0.3, 1.0, 1.1]
    episodes = [make_episode(i // 3, r) for i, r in enumerate(rewards)]
    expected = []
    for group in (rewards[:3], rewards[3:]):
        group = torch.tensor(group, dtype=torch.float64)
        expected += ((group - group.mean()) / (group.std(correction=0) + 1e-4)).tolist()
    assert compute_advantages(episodes, LossConfig()) == expected  # exact, not approximate


# ----------------------------------------------------------------------------- clip-higher (DAPO)


def test_clip_higher_moves_only_the_upper_boundary():
    ratios = [0.7, 0.81, 1.0, 1.19, 1.21, 1.27, 1.29]
    log_probs, old = log(ratios)[None], torch.zeros(1, len(ratios), dtype=torch.float64)
    positive, negative = torch.ones(1, 1, dtype=torch.float64), -torch.ones(1, 1, dtype=torch.float64)
    symmetric = LossConfig(clip="ppo", clip_range=0.2)
    higher = LossConfig(clip="ppo", clip_range=0.2, clip_range_high=0.28)

    # A > 0: only the upper bound binds: min(r, clip(r)) caps r at 1.2 (symmetric) or 1.28 (clip-higher).
    losses, _, clipped = surrogate_token_losses(log_probs, old, positive, symmetric)
    assert (-losses[0]).tolist() == pytest.approx([0.7, 0.81, 1.0, 1.19, 1.2, 1.2, 1.2])
    assert clipped[0].tolist() == [False, False, False, False, True, True, True]
    losses, _, clipped = surrogate_token_losses(log_probs, old, positive, higher)
    assert (-losses[0]).tolist() == pytest.approx([0.7, 0.81, 1.0, 1.19, 1.21, 1.27, 1.28])
    assert clipped[0].tolist() == [False, False, False, False, False, False, True]

    # A < 0: only the lower bound 0.8 binds, the same in both.
    for config in (symmetric, higher):
        losses, _, clipped = surrogate_token_losses(log_probs, old, negative, config)
        assert losses[0].tolist() == pytest.approx([0.8, 0.81, 1.0, 1.19, 1.21, 1.27, 1.29])
        assert clipped[0].tolist() == [True, False, False, False, False, False, False]


def test_clipped_tokens_get_no_gradient():
    log_probs = log([1.25, 1.29, 0.7])[None].requires_grad_()
    old = torch.zeros(1, 3, dtype=torch.float64)
    advantages = torch.tensor([[2.0]], dtype=torch.float64)
    losses, _, _ = surrogate_token_losses(log_probs, old, advantages, LossConfig(clip="ppo", clip_range_high=0.28))
    losses.sum().backward()
    # d(-r A)/d log p = -r A where not clipped; 1.29 is above 1 + 0.28.
    assert log_probs.grad[0].tolist() == pytest.approx([-2.5, 0.0, -1.4])


# ----------------------------------------------------------------------------- GSPO's sequence-level ratio


def test_sequence_ratio_is_the_geometric_mean_over_generated_tokens():
    # Row 0: token ratios 2, 0.5, 4 -> (2 x 0.5 x 4)^(1/3) = 4^(1/3). Row 1: 1.1, 1.0 and a padded position.
    log_probs = torch.stack([log([2.0, 0.5, 4.0]), log([1.1, 1.0, 100.0])])
    old = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    advantages = torch.tensor([[1.0], [-2.0]], dtype=torch.float64)
    config = LossConfig(importance_sampling="sequence")
    losses, ratio, clipped = surrogate_token_losses(log_probs, old, advantages, config, mask=mask)
    assert ratio[0].tolist() == pytest.approx([4 ** (1 / 3)] * 3)
    assert ratio[1, :2].tolist() == pytest.approx([math.sqrt(1.1)] * 2)
    assert losses[0].tolist() == pytest.approx([-(4 ** (1 / 3))] * 3)
    assert losses[1, :2].tolist() == pytest.approx([2 * math.sqrt(1.1)] * 2)
    assert not clipped.any()


def test_sequence_ratio_clip_and_gradient():
    log_probs = torch.stack([log([2.0, 0.5, 4.0]), log([1.1, 1.0, 100.0])]).requires_grad_()
    old = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    advantages = torch.tensor([[1.0], [1.0]], dtype=torch.float64)
    config = LossConfig(importance_sampling="sequence", clip="ppo", clip_range=0.2, clip_range_high=0.28)
    losses, _, clipped = surrogate_token_losses(log_probs, old, advantages, config, mask=mask)
    # Row 0: s = 1.587 > 1.28 with A > 0: every token clipped, objective 1.28, no gradient.
    assert clipped[0].tolist() == [True, True, True] and losses[0].tolist() == pytest.approx([-1.28] * 3)
    assert not clipped[1, :2].any()
    # Sequence aggregation: each answer's token losses averaged, so the answer's loss is -s A.
    per_answer = (losses * mask).sum(-1) / mask.sum(-1)
    per_answer.sum().backward()
    # d(-s A)/d log p_t = -s A / |y|: every token of an answer gets the same share; padding none.
    assert log_probs.grad[0].tolist() == [0.0, 0.0, 0.0]
    assert log_probs.grad[1].tolist() == pytest.approx([-math.sqrt(1.1) / 2, -math.sqrt(1.1) / 2, 0.0])


# ----------------------------------------------------------------------------- CISPO and SAPO


def test_cispo_truncates_the_detached_weight_and_keeps_every_tokens_gradient():
    # Ratios 1.5, 0.5, 6.0 against old log p = 0; clip_range_high 0.28: the weight is min(r, 1.28).
    log_probs = log([1.5, 0.5, 6.0])[None].requires_grad_()
    old = torch.zeros(1, 3, dtype=torch.float64)
    config = LossConfig(clip="cispo", clip_range_high=0.28)
    for advantage in (2.0, -1.0):
        log_probs.grad = None
        losses, ratio, clipped = surrogate_token_losses(log_probs, old, torch.tensor([[advantage]], dtype=torch.float64),
                                                        config)
        # MiniMax-M1: loss = -sg(min(r, 1 + eps_high)) x A x log p.
        weights = [1.28, 0.5, 1.28]
        assert losses[0].tolist() == pytest.approx([-w * advantage * math.log(r) for w, r in zip(weights, [1.5, 0.5, 6.0])])
        assert clipped[0].tolist() == [True, False, True]
        losses.sum().backward()
        # d loss / d log p = -w A: the truncated tokens keep a gradient (PPO's clip would give 0 for A > 0), and
        # with no lower bound the 0.5 ratio keeps its weight for A < 0 (PPO would clip it at 0.8 and give 0).
        assert log_probs.grad[0].tolist() == pytest.approx([-w * advantage for w in weights])


def test_cispo_cap_defaults_to_the_symmetric_range():
    log_probs, old = log([1.5, 1.1])[None], torch.zeros(1, 2, dtype=torch.float64)
    losses, _, clipped = surrogate_token_losses(log_probs, old, torch.ones(1, 1, dtype=torch.float64),
                                                LossConfig(clip="cispo", clip_range=0.2))
    assert losses[0].tolist() == pytest.approx([-1.2 * math.log(1.5), -1.1 * math.log(1.1)])
    assert clipped[0].tolist() == [True, False]


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


@pytest.mark.parametrize("advantage, tau", [(2.0, 2.0), (-1.0, 3.0), (0.0, 3.0)])
def test_sapo_gate_value_and_gradient_by_hand(advantage, tau):
    ratios = [0.5, 1.0, 1.5, 3.0]
    log_probs = log(ratios)[None].requires_grad_()
    old = torch.zeros(1, len(ratios), dtype=torch.float64)
    config = LossConfig(clip="sapo", sapo_tau_positive=2.0, sapo_tau_negative=3.0)  # tau: positive only for A > 0
    losses, ratio, clipped = surrogate_token_losses(log_probs, old, torch.tensor([[advantage]], dtype=torch.float64),
                                                    config)
    # SAPO: loss = -f(r) A with f(r) = sigmoid(tau (r - 1)) x 4 / tau.
    assert losses[0].tolist() == pytest.approx([-sigmoid(tau * (r - 1)) * 4 / tau * advantage for r in ratios])
    assert not clipped.any()
    losses.sum().backward()
    # d loss / d log p = -4 s (1 - s) r A with s = sigmoid(tau (r - 1)): -A at r = 1 (GRPO's), smaller away from it.
    expected = [-4 * sigmoid(tau * (r - 1)) * (1 - sigmoid(tau * (r - 1))) * r * advantage for r in ratios]
    assert log_probs.grad[0].tolist() == pytest.approx(expected, abs=1e-12)
    assert log_probs.grad[0, 1].item() == pytest.approx(-advantage)


# ----------------------------------------------------------------------------- RLOO and REINFORCE++ whitening


def test_leave_one_out_baseline_is_the_mean_of_the_other_answers():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.1, 0.1, 0.0, 0.5, 0.5]
    groups = [0, 0, 0, 0, 1, 1, 1, 2, 2]
    episodes = [make_episode(q, r) for q, r in zip(groups, rewards)]
    # Group 0: 1 - (0 + 0 + 1) / 3 = 2/3, 0 - (1 + 0 + 1) / 3 = -2/3. Group 1: 1.1 - 0.1 / 2, 0.1 - 1.1 / 2,
    # 0 - 1.2 / 2. Group 2: equal rewards, exactly 0.
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1.05, -0.45, -0.6, 0.0, 0.0]
    config = LossConfig(baseline="leave_one_out", std_normalization=False)
    assert compute_advantages(episodes, config) == pytest.approx(expected, abs=1e-12)
    assert compute_advantages(episodes, config)[7:] == [0.0, 0.0]
    std_0 = 0.5  # group 0's population std
    with_std = compute_advantages(episodes, LossConfig(baseline="leave_one_out"))
    assert with_std[:4] == pytest.approx([a / (std_0 + 1e-4) for a in expected[:4]], abs=1e-12)


def test_whitening_uses_the_batchs_token_weighted_mean_and_std():
    advantages, tokens = [1.0, -1.0, 0.5], [1, 3, 2]
    # Over 6 tokens: mean (1 - 3 + 1) / 6 = -1/6; variance (1 (7/6)^2 + 3 (5/6)^2 + 2 (4/6)^2) / 6 = 156 / 216.
    std = math.sqrt(156 / 216)
    expected = [(a + 1 / 6) / (std + 1e-4) for a in advantages]
    batch = list(zip(advantages, tokens))
    assert whiten_advantages(advantages, batch, 1e-4) == pytest.approx(expected, abs=1e-12)
    # Under data parallel a rank whitens its own answers with the whole batch's statistics.
    assert whiten_advantages(advantages[1:], batch, 1e-4) == pytest.approx(expected[1:], abs=1e-12)
    assert whiten_advantages([], [], 1e-4) == []


# ----------------------------------------------------------------------------- top-entropy tokens


@pytest.mark.parametrize("fraction, threshold", [(0.2, 0.8), (0.25, 0.8), (0.3, 0.7), (0.01, 0.9), (1.0, 0.0)])
def test_high_entropy_threshold_keeps_the_top_fraction(fraction, threshold):
    entropies = [0.1, 0.9, 0.5, 0.7, 0.3, 0.2, 0.8, 0.4, 0.6, 0.0]  # round(fraction x 10) highest, at least one
    assert high_entropy_threshold(entropies, fraction) == pytest.approx(threshold)


# ----------------------------------------------------------------------------- reward scaling (Dr. GRPO, per batch)


def test_advantage_scaling_per_group_per_batch_and_none():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]  # group means 1/3 and 2/3; group std sqrt(2)/3; batch std 1/2
    episodes = [make_episode(i // 3, r) for i, r in enumerate(rewards)]
    centered = [2 / 3, -1 / 3, -1 / 3, 1 / 3, 1 / 3, -2 / 3]
    group = compute_advantages(episodes, LossConfig())
    assert group == pytest.approx([c / (math.sqrt(2) / 3 + 1e-4) for c in centered], abs=1e-12)
    batch = compute_advantages(episodes, LossConfig(std_scope="batch"))
    assert batch == pytest.approx([c / (0.5 + 1e-4) for c in centered], abs=1e-12)
    none = compute_advantages(episodes, LossConfig(std_normalization=False, std_scope="batch"))
    assert none == pytest.approx(centered, abs=1e-12)


def test_batch_std_uses_the_configured_estimator():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]  # batch: 3 of 6 deviations of 1/2 each way; sample std sqrt(1.5 / 5)
    episodes = [make_episode(i // 3, r) for i, r in enumerate(rewards)]
    centered = [2 / 3, -1 / 3, -1 / 3, 1 / 3, 1 / 3, -2 / 3]
    sample = compute_advantages(episodes, LossConfig(std_scope="batch", std_estimator="sample"))
    assert sample == pytest.approx([c / (math.sqrt(0.3) + 1e-4) for c in centered], abs=1e-12)


def test_batch_std_keeps_all_equal_groups_at_zero():
    # Batch mean 0.5, deviations 0, 0, 0.5, -0.5: batch std sqrt(0.5 / 4). The first group's rewards are equal.
    episodes = [make_episode(i // 2, r) for i, r in enumerate([0.5, 0.5, 1.0, 0.0])]
    std = math.sqrt(0.125) + 1e-4
    assert compute_advantages(episodes, LossConfig(std_scope="batch")) == pytest.approx([0.0, 0.0, 0.5 / std, -0.5 / std])


# ----------------------------------------------------------------------------- overlong reward shaping (DAPO)


@pytest.mark.parametrize("num_tokens, penalty", [(20, 0.0), (48, 0.0), (49, 1 / 16), (56, 0.5), (63, 15 / 16), (64, 1.0)])
def test_overlong_penalty_ramps_linearly_over_the_last_tokens(num_tokens, penalty):
    config = LossConfig(overlong_buffer_fraction=0.25)  # L = 16 of max_gen_len 64: the ramp starts after token 48
    assert overlong_penalty(num_tokens, 64, config) == pytest.approx(penalty)
    half = LossConfig(overlong_buffer_fraction=0.25, overlong_penalty_factor=0.5)
    assert overlong_penalty(num_tokens, 64, half) == pytest.approx(penalty / 2)
    assert overlong_penalty(num_tokens, 64, LossConfig()) == 0.0


def test_overlong_penalty_comes_off_the_reward_and_is_recorded():
    episodes = [make_episode(0, 1.1, num_tokens=10), make_episode(0, 1.1, num_tokens=60)]
    shaped = shape_rewards(episodes, 64, LossConfig(overlong_buffer_fraction=0.25))
    assert [e.reward for e in shaped] == pytest.approx([1.1, 1.1 - 0.75])
    assert [e.reward_info for e in shaped] == [{"format_reward": 0.1, "overlong_penalty": 0.0},
                                               {"format_reward": 0.1, "overlong_penalty": 0.75}]
    assert episodes[1].reward == 1.1 and "overlong_penalty" not in episodes[1].reward_info  # inputs untouched
    # The same rewards but different lengths now have different advantages.
    assert compute_advantages(shaped, LossConfig(std_normalization=False)) == pytest.approx([0.375, -0.375])


# ----------------------------------------------------------------------------- KL to a reference (k3)


def test_k3_value_and_gradient_by_hand():
    log_probs = log([0.5, 0.2, 0.3]).requires_grad_()
    reference = log([0.25, 0.2, 0.6])
    kl = k3_kl(log_probs, reference)
    # r = p_ref / p = 0.5, 1, 2: k3 = r - log r - 1.
    assert kl.tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0, 1 - math.log(2)])
    kl.sum().backward()
    # d k3 / d log p = 1 - r: the policy is pulled up where the reference is likelier, down where it is not.
    assert log_probs.grad.tolist() == pytest.approx([0.5, 0.0, -1.0])


def test_k3_averaged_over_the_policy_is_the_exact_kl():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    exact = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()))
    assert (p * k3_kl(p.log(), q.log())).sum().item() == pytest.approx(exact, abs=1e-12)
    assert (k3_kl(p.log(), q.log()) >= 0).all()


# ----------------------------------------------------------------------------- the variants inside update_policy


def sgd_update(model, episodes, config, reference_model=None):
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    advantages = compute_advantages(episodes, config)
    update = update_policy(model, OptimizerStep(model, optimizer, max_grad_norm=1e9), episodes, advantages,
                           config=config, optim=OptimConfig(micro_batch_size=2, logprob_chunk_size=4), max_gen_len=16,
                           pad_token_id=0, reference_model=reference_model)
    return model, update


def perturbed(model, scale=0.05):
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in reference.parameters():
            param += scale * torch.randn(param.shape, generator=generator)
    return reference


def test_kl_penalty_in_the_update_equals_the_hand_gradient(policy):
    episodes = sample_episodes()
    reference = perturbed(policy)
    config = LossConfig(kl_beta=0.5)
    advantages = compute_advantages(episodes, config)
    with torch.no_grad():
        reference_log_probs = [per_token_log_probs(reference, e) for e in episodes]
        expected_kl = sum(k3_kl(per_token_log_probs(policy, e), r).sum() for e, r in zip(episodes, reference_log_probs))

    def hand_loss(model):  # token aggregation: every generated token weighs 1 / (all generated tokens)
        total = 0.0
        for index, episode in enumerate(episodes):
            log_probs = per_token_log_probs(model, episode)
            ratio = torch.exp(log_probs - log_probs.detach())
            kl = torch.exp(reference_log_probs[index] - log_probs) - (reference_log_probs[index] - log_probs) - 1
            total = total + TOKEN(episode, episodes) * (-(ratio * advantages[index]) + 0.5 * kl).sum()
        return total

    updated, metrics = sgd_update(policy, episodes, config, reference)
    expected, expected_loss = expected_sgd_update(policy, hand_loss)
    assert_same_parameters(updated, expected)
    assert metrics["loss"] == pytest.approx(expected_loss, abs=1e-6)
    assert metrics["kl"] == pytest.approx(expected_kl.item() / sum(e.num_generated_tokens for e in episodes), rel=1e-5)
    assert metrics["kl"] > 0
    with pytest.raises(ValueError, match="reference model"):
        sgd_update(policy, episodes, config)


def test_gspo_with_clip_higher_over_two_epochs_equals_the_hand_gradient(policy):
    episodes = sample_episodes()
    config = LossConfig(importance_sampling="sequence", aggregation="sequence", epochs_per_rollout=2, clip="ppo",
                        clip_range=0.3, clip_range_high=0.5)
    advantages = compute_advantages(episodes, config)
    with torch.no_grad():
        sampling_log_probs = [per_token_log_probs(policy, e) for e in episodes]

    # SGD at lr 0.1 moves the tiny policy far: after the first step the answers' ratios s are about 2.8, 0.78,
    # 0.27, 1.32, 0.68, 0.45, so the second step clips some answers, and 1.32 (A > 0) only with clip-higher.
    def hand_loss(model):  # GSPO: -(1/N) sum_i min(s_i A_i, clip(s_i, 1 - 0.3, 1 + 0.5) A_i)
        total = 0.0
        for index, episode in enumerate(episodes):
            s = torch.exp((per_token_log_probs(model, episode) - sampling_log_probs[index]).mean())
            objective = torch.minimum(s * advantages[index], s.clamp(0.7, 1.5) * advantages[index])
            total = total - objective / len(episodes)
        return total

    after_first, _ = expected_sgd_update(policy, hand_loss)
    expected, _ = expected_sgd_update(after_first, hand_loss)
    updated, metrics = sgd_update(policy, episodes, config)
    assert_same_parameters(updated, expected, atol=1e-5)
    assert metrics["ratio_max"] > 1.0


def with_sampler_values(episodes, model, offsets, entropies=None):
    """The episodes as grpo.rollout returns them: the sampler's log-probs are the policy's minus `offsets`
    (the engines' disagreement, set by hand), one per generated token in order."""
    offsets, entropies = iter(offsets), iter(entropies or [])
    with torch.no_grad():
        log_probs = [per_token_log_probs(model, e).tolist() for e in episodes]
    return [dataclasses.replace(e, sampler_log_probs=[lp - next(offsets) for lp in lps],
                                sampler_entropies=[next(entropies, 0.0) for _ in lps])
            for e, lps in zip(episodes, log_probs)]


def scaled_token_loss(episodes, advantages, factors):
    """Plain GRPO's token-level loss with token j of the batch (in episode order) weighted by factors[j]."""

    def loss(model):
        total, token = 0.0, 0
        for index, episode in enumerate(episodes):
            log_probs = per_token_log_probs(model, episode)
            factor = torch.tensor(factors[token : token + len(log_probs)], dtype=torch.float32)
            token += len(log_probs)
            total = total - TOKEN(episode, episodes) * (factor * torch.exp(log_probs - log_probs.detach())
                                                        * advantages[index]).sum()
        return total

    return loss


def test_truncated_importance_sampling_weights_each_token_by_the_capped_ratio(policy):
    generator = torch.Generator().manual_seed(2)
    episodes = sample_episodes()
    num_tokens = sum(e.num_generated_tokens for e in episodes)
    offsets = (torch.rand(num_tokens, generator=generator) * 1.6 - 0.6).tolist()  # log(p_train / p_sampler)
    episodes = with_sampler_values(episodes, policy, offsets)
    config = LossConfig(sampler_is_cap=1.5)
    advantages = compute_advantages(episodes, config)
    weights = [min(math.exp(offset), 1.5) for offset in offsets]  # min(p_train / p_sampler, C), by hand
    assert min(weights) < 1 and max(weights) == 1.5  # both sides of 1, and the cap acts

    updated, metrics = sgd_update(policy, episodes, config)
    expected, expected_loss = expected_sgd_update(policy, scaled_token_loss(episodes, advantages, weights))
    assert_same_parameters(updated, expected)
    assert metrics["loss"] == pytest.approx(expected_loss, abs=1e-6)
    # The engines' disagreement, as logged: mean and max |trainer - sampler log p| over generated tokens.
    assert metrics["sampler_logprob_diff_mean"] == pytest.approx(sum(map(abs, offsets)) / num_tokens, abs=1e-5)
    assert metrics["sampler_logprob_diff_max"] == pytest.approx(max(map(abs, offsets)), abs=1e-5)


def test_top_entropy_masking_trains_only_the_highest_entropy_tokens(policy):
    episodes = sample_episodes()
    num_tokens = sum(e.num_generated_tokens for e in episodes)
    entropies = torch.rand(num_tokens, generator=torch.Generator().manual_seed(3)).tolist()
    episodes = with_sampler_values(episodes, policy, [0.0] * num_tokens, entropies)
    config = LossConfig(top_entropy_fraction=0.2)
    advantages = compute_advantages(episodes, config)
    kept = sorted(entropies, reverse=True)[: round(0.2 * num_tokens)]  # by hand: the top 20% of the batch
    keep = [float(entropy in kept) for entropy in entropies]

    # The normaliser stays every generated token (Wang et al. 2025's token-level loss); the others weigh 0.
    updated, metrics = sgd_update(policy, episodes, config)
    expected, expected_loss = expected_sgd_update(policy, scaled_token_loss(episodes, advantages, keep))
    assert_same_parameters(updated, expected)
    assert metrics["loss"] == pytest.approx(expected_loss, abs=1e-6)
    with pytest.raises(ValueError, match="sampler's per-token"):
        sgd_update(policy, sample_episodes(), config)  # episodes without the sampler's values


def test_sampler_and_trainer_agree_to_float32_rounding_on_cpu(tmp_path, tiny_model_dir, countdown_dir, digit_reward):
    """The rollout's stored log-probs against the update's own, through train.py: KV cache, shrinking batch
    and chunked scoring are different computations of the same numbers, equal to ~1e-6 in float32."""
    config = tiny_config(tmp_path, tiny_model_dir, countdown_dir, "optim.num_steps=2", "eval.interval=0",
                         "checkpoint.interval=0", "rollout.max_gen_len=24", "rollout.episodes_per_step=12",
                         "loss.sampler_is_cap=2.0")
    train.train(config)
    scalars = read_scalars(tmp_path / "logs" / "tiny")
    means = [value for _, value in scalars["train/sampler_logprob_diff_mean"]]
    maxima = [value for _, value in scalars["train/sampler_logprob_diff_max"]]
    assert means and all(mean < 2e-6 for mean in means) and all(0 <= m < 2e-5 for m in maxima), (means, maxima)


# ----------------------------------------------------------------------------- dynamic sampling (DAPO)


def scripted_rounds(rounds_of_group_rewards):
    """A `sample_round` that plays back groups of rewards, and records which rounds were asked for."""
    calls = []

    def sample_round(round_index):
        calls.append(round_index)
        groups = rounds_of_group_rewards[round_index]
        return [make_episode(q, r, text=f"round {round_index} group {q}") for q, rewards in enumerate(groups)
                for r in rewards]

    return sample_round, calls


def test_dynamic_sampling_refills_with_informative_groups():
    sample_round, calls = scripted_rounds([[[1, 1], [0, 1], [0, 0]], [[1, 0], [0.5, 0.5], [1, 0.1]]])
    kept, sampled, rounds = sample_informative_groups(sample_round, num_groups=3, max_rounds=5)
    assert calls == [0, 1] and rounds == 2 and len(sampled) == 12
    assert [e.text for e in kept] == ["round 0 group 1"] * 2 + ["round 1 group 0"] * 2 + ["round 1 group 2"] * 2
    assert [e.question_index for e in kept] == [0, 0, 1, 1, 2, 2]  # one group per question index again
    assert [e.reward for e in kept] == [0, 1, 1, 0, 1, 0.1]


def test_dynamic_sampling_stops_when_full_and_keeps_exactly_the_configured_groups():
    sample_round, calls = scripted_rounds([[[0, 1], [1, 0], [0, 1]], [[0, 1]]])
    kept, sampled, rounds = sample_informative_groups(sample_round, num_groups=2, max_rounds=5)
    assert calls == [0] and rounds == 1 and len(sampled) == 6
    assert [e.text for e in kept] == ["round 0 group 0"] * 2 + ["round 0 group 1"] * 2


def test_dynamic_sampling_cap_trains_on_what_it_has(caplog):
    sample_round, calls = scripted_rounds([[[0, 0], [1, 0]], [[1, 1], [0, 0]], [[0, 1], [0, 1]]])
    with caplog.at_level(logging.WARNING):
        kept, sampled, rounds = sample_informative_groups(sample_round, num_groups=2, max_rounds=2)
    assert calls == [0, 1] and rounds == 2 and len(sampled) == 8
    assert [e.text for e in kept] == ["round 0 group 1"] * 2
    assert "1 of 2 groups" in caplog.text


@pytest.mark.parametrize("weight, rewards", [(1.0, [1.1, 0.1, 0.0, 0.1, 0.0]), (0.5, [1.05, 0.05, 0.0, 0.05, 0.0]),
                                             (0.0, [1.0, 0.0, 0.0, 0.0, 0.0])])
def test_format_reward_weight_scales_only_the_format_part(weight, rewards):
    # Group 0: correct and formatted, formatted but wrong, unformatted; group 1 differs only in format.
    parts = [(0, 0.1, 1.0), (0, 0.1, 0.0), (0, 0.0, 0.0), (1, 0.1, 0.0), (1, 0.0, 0.0)]
    episodes = [dataclasses.replace(make_episode(question, fmt + answer), reward_info={"format_reward": fmt,
                                                                                        "answer_reward": answer})
                for question, fmt, answer in parts]
    shaped = shape_rewards(episodes, 64, LossConfig(format_reward_weight=weight))
    assert [e.reward for e in shaped] == pytest.approx(rewards)
    assert [e.reward_info for e in shaped] == [e.reward_info for e in episodes]  # the task's parts, as logged
    if weight == 0.0:  # the format-only group teaches nothing; group 0's advantages come from the answer alone
        advantages = compute_advantages(shaped, LossConfig(std_normalization=False))
        assert advantages == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0])


def test_try_reward_weight_adds_the_weighted_share_of_exact_tries():
    # (format, answer, exact tries): a right answer after 1 exact try of 4, a wrong one after exact tries, none.
    parts = [(0.1, 1.0, 0.25), (0.1, 0.0, 1.0), (0.1, 0.0, 0.0)]
    episodes = [dataclasses.replace(make_episode(0, fmt + answer), reward_info={
        "format_reward": fmt, "answer_reward": answer, "try_reward": tries}) for fmt, answer, tries in parts]
    shaped = shape_rewards(episodes, 64, LossConfig(try_reward_weight=0.2))
    assert [e.reward for e in shaped] == pytest.approx([1.15, 0.3, 0.1])
    assert [e.reward_info for e in shaped] == [e.reward_info for e in episodes]
    assert [e.reward for e in shape_rewards(episodes, 64, LossConfig())] == pytest.approx([1.1, 0.1, 0.1])


def test_try_reward_distinct_adds_the_share_of_exact_tries_not_written_before():
    # (exact tries, exact tries written for the first time): the second answer wrote its one exact try 3 times.
    shares = [(1.0, 1.0), (1.0, 1 / 3)]
    episodes = [dataclasses.replace(make_episode(0, 0.1), reward_info={
        "format_reward": 0.1, "answer_reward": 0.0, "try_reward": tries, "distinct_try_reward": distinct})
        for tries, distinct in shares]
    shaped = shape_rewards(episodes, 64, LossConfig(try_reward_weight=0.3, try_reward_distinct=True))
    assert [e.reward for e in shaped] == pytest.approx([0.4, 0.2])


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("values, message", [
    ({"clip": "ppo", "clip_range_high": 0.0}, "loss.clip_range_high"),
    ({"clip": "ppo", "clip_range_high": 10.0}, "loss.clip_range_high"),
    ({"clip_range_high": 0.28}, "loss.clip: ppo"),
    ({"overlong_buffer_fraction": -0.1}, "loss.overlong_buffer_fraction"),
    ({"overlong_buffer_fraction": 1.0}, "loss.overlong_buffer_fraction"),
    ({"overlong_penalty_factor": 0.0}, "loss.overlong_penalty_factor"),
    ({"format_reward_weight": -0.1}, "loss.format_reward_weight"),
    ({"format_reward_weight": 1.5}, "loss.format_reward_weight"),
    ({"try_reward_weight": -0.1}, "loss.try_reward_weight"),
    ({"try_reward_weight": 1.5}, "loss.try_reward_weight"),
    ({"kl_beta": -0.01}, "loss.kl_beta"),
    ({"epochs_per_rollout": 0}, "loss.epochs_per_rollout"),
    ({"clip": "sapo", "clip_range_high": 0.28}, "loss.clip: ppo or cispo"),
    ({"sapo_tau_positive": 0.0}, "loss.sapo_tau_positive"),
    ({"sapo_tau_negative": 101.0}, "loss.sapo_tau_negative"),
    ({"top_entropy_fraction": 0.0}, "loss.top_entropy_fraction"),
    ({"top_entropy_fraction": 1.5}, "loss.top_entropy_fraction"),
    ({"sampler_is_cap": 0.9}, r"loss.sampler_is_cap: must be in \[1, 100\]"),
    ({"sampler_is_cap": 101.0}, r"loss.sampler_is_cap: must be in \[1, 100\]"),
    ({"baseline": "leave_one_in"}, "loss.baseline"),
    ({"try_reward_distinct": True}, "loss.try_reward_distinct: needs loss.try_reward_weight > 0"),
])
def test_bad_values_are_config_errors(values, message):
    with pytest.raises(ConfigError, match=message):
        config_lib.build(LossConfig, values, prefix="loss")


def test_bad_variant_value_stops_train_py_with_a_config_error(capsys):
    for assignment, message in (("loss.kl_beta=-1", "config error: loss.kl_beta: must be in [0, 10]"),
                                ("rollout.num_answers_per_question=1", "must be >= 2 for the group_mean baseline"),
                                ("rollout.dynamic_sampling_max_rounds=0",
                                 "config error: rollout.dynamic_sampling_max_rounds: must be >= 1"),
                                ("rollout.dynamic_sampling_questions_per_round=0",
                                 "config error: rollout.dynamic_sampling_questions_per_round: must be >= 1")):
        with pytest.raises(SystemExit) as stopped:
            train.main(["--config", "configs/cpu_demo.yaml", "--set", assignment])
        assert stopped.value.code == 2
        assert message in capsys.readouterr().err


# ----------------------------------------------------------------------------- presets and train.py end to end


def algorithm(config: train.TrainConfig) -> dict:
    return {key: getattr(getattr(config, key.split(".")[0]), key.split(".")[1]) for key in ALGORITHM_KEYS}


def test_plain_grpo_is_every_default():
    assert algorithm(train.TrainConfig()) == PLAIN_GRPO


@pytest.mark.parametrize("base", BASES)
def test_every_preset_states_its_whole_algorithm_and_means_it_over_any_base(base, tmp_path):
    """A base config's own algorithm (the CPU demo's KL, try reward, clip-higher, 6 sampling rounds, 2 epochs) must
    not leak into a preset: merged over any base, each resolves to exactly its document row."""
    experiments = {e.name: e for e in ablate.load_experiments(VARIANTS, REPO_ROOT / base, [], tmp_path)}
    assert sorted(experiments) == sorted(PRESETS)
    for name, experiment in experiments.items():
        assert sorted(experiment.changes) == ALGORITHM_KEYS, f"{name} does not state every algorithm key"
        assert algorithm(experiment.config) == {**PLAIN_GRPO, **PRESETS[name]}, name
    resolved = {name: algorithm(experiment.config) for name, experiment in experiments.items()}
    assert resolved["ppo_k2"] != resolved["grpo"]
    assert resolved["ppo_k2"]["loss.clip_range_high"] is None  # the symmetric clip, whatever the base's
    assert resolved["dapo"]["loss.kl_beta"] == 0 and resolved["dapo"]["rollout.dynamic_sampling_max_rounds"] == 3
    for name in ("gspo", "dr_grpo", "grpo"):
        assert not resolved[name]["rollout.dynamic_sampling"] and resolved[name]["loss.kl_beta"] == 0
    if base == "configs/cpu_demo.yaml":  # the suite's table lists what a preset changes in this base: the demo's recipe undone
        assert experiments["grpo"].differences == {
            "rollout.dynamic_sampling": False, "rollout.dynamic_sampling_max_rounds": 3,
            "rollout.dynamic_sampling_questions_per_round": None, "loss.epochs_per_rollout": 1,
            "loss.clip": "none", "loss.clip_range_high": None, "loss.kl_beta": 0.0, "loss.try_reward_weight": 0.0}


def changed_weights(before, after) -> list[str]:
    """The names of the weights that differ between two model directories."""
    first, second = (Transformer.from_pretrained(path, dtype=torch.float32).state_dict() for path in (before, after))
    return [name.removesuffix(".weight") for name in first if not torch.equal(first[name], second[name])]


def preset_overrides(name: str) -> list[str]:
    return [f"{key}={json.dumps(value)}" for key, value in ablate.flatten(config_lib.read_yaml(VARIANTS / f"{name}.yaml")).items()]


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_trains_two_steps_through_train_py(name, lora, tmp_path, tiny_model_dir, countdown_dir,
                                                       digit_reward):
    adapters = ["model.lora.rank=2", "optim.learning_rate=0.05"] if lora else []
    config = tiny_config(tmp_path, tiny_model_dir, countdown_dir, *preset_overrides(name), "optim.num_steps=2",
                         "eval.interval=0", "checkpoint.interval=0", *adapters)
    train.train(config)
    if lora:  # only the adapters trained: the merged model differs from the base in the adapted weights only
        changed = changed_weights(tiny_model_dir, tmp_path / "checkpoints" / "tiny" / "step_000002")
        assert changed and all(name.endswith(config_lib.LORA_LAYERS) for name in changed)
    scalars = read_scalars(tmp_path / "logs" / "tiny")
    assert [step for step, _ in scalars["train/loss"]] == [1, 2]
    assert all(math.isfinite(value) for _, value in scalars["train/loss"] + scalars["train/grad_norm"])
    assert "train/sampler_logprob_diff_max" in scalars
    if name == "dapo":
        rounds = [value for _, value in scalars["train/dynamic_sampling_rounds"]]
        assert all(1 <= r <= 3 for r in rounds)  # each round asks the step's 2 questions
        assert [value for _, value in scalars["train/questions_sampled"]] == [2 * r for r in rounds]
        assert "reward/overlong_penalty" in scalars
    if name == "grpo_kl":  # step 1 starts from the reference itself: KL exactly 0; after an update it is not
        kl = [value for _, value in scalars["train/kl"]]
        assert kl[0] == 0.0 and kl[1] > 0
    else:
        assert "train/kl" not in scalars


@pytest.mark.slow
@pytest.mark.parametrize("questions_per_round", [None, 2, 5])
def test_dynamic_sampling_draws_new_questions_until_the_cap(tmp_path, tiny_model_dir, countdown_dir, monkeypatch,
                                                            questions_per_round):
    """Only questions with an even target can give rewards that differ within a group: the others are replaced,
    in rounds of rollout.dynamic_sampling_questions_per_round questions (null: a step's 4)."""
    scored = []  # (target, reward) of every answer, in sampling order

    def reward(response, item, end_token):
        digits = sum(character.isdigit() for character in response) / max(len(response), 1)
        scored.append((item["target"], digits if item["target"] % 2 == 0 else 0.0))
        return {"reward": scored[-1][1], "reward_info": {"format_reward": 0.0, "answer_reward": 0.0}}

    monkeypatch.setattr(countdown_task, "reward", reward)
    config = tiny_config(tmp_path, tiny_model_dir, countdown_dir, "rollout.dynamic_sampling=true",
                         "rollout.dynamic_sampling_max_rounds=4", "rollout.episodes_per_step=12", "optim.num_steps=1",
                         f"rollout.dynamic_sampling_questions_per_round={json.dumps(questions_per_round)}",
                         "eval.interval=0", "checkpoint.interval=0")
    train.train(config)
    scalars = read_scalars(tmp_path / "logs" / "tiny")
    per_round = questions_per_round or 4
    groups = [scored[i : i + 3] for i in range(0, len(scored), 3)]  # 3 answers per question
    informative = [len({reward for _, reward in group}) > 1 for group in groups]
    # Rounds go on while fewer than 4 groups had different rewards, at most 4 rounds.
    expected_rounds = next((r for r in range(1, 5) if sum(informative[: per_round * r]) >= 4), 4)
    assert len(groups) == per_round * expected_rounds
    assert scalars["train/dynamic_sampling_rounds"] == [(1, expected_rounds)]
    assert scalars["train/questions_sampled"] == [(1, per_round * expected_rounds)]
    assert expected_rounds > 1  # this seed needs a refill, so the test checks one
    round_questions = {tuple(group[0][0] for group in groups[r : r + per_round])
                       for r in range(0, len(groups), per_round)}
    assert len(round_questions) == expected_rounds  # every round asked different questions


@pytest.mark.slow
def test_resume_with_dynamic_sampling_and_kl_equals_uninterrupted_run(tmp_path, tiny_model_dir, countdown_dir,
                                                                       digit_reward):
    """Extra rounds' questions are a function of (step, round), and the reference is model.dir, not the checkpoint."""
    variants = ("rollout.dynamic_sampling=true", "loss.kl_beta=0.5", "eval.interval=0")
    train.train(tiny_config(tmp_path / "full", tiny_model_dir, countdown_dir, *variants, "optim.num_steps=4"))
    train.train(tiny_config(tmp_path / "cut", tiny_model_dir, countdown_dir, *variants, "optim.num_steps=2"))
    resumed_config = tiny_config(tmp_path / "cut", tiny_model_dir, countdown_dir, *variants, "optim.num_steps=4")
    train.train(resumed_config, resume=str(tmp_path / "cut" / "checkpoints" / "tiny"))
    full = Transformer.from_pretrained(tmp_path / "full" / "checkpoints" / "tiny" / "step_000004", dtype=torch.float32)
    resumed = Transformer.from_pretrained(tmp_path / "cut" / "checkpoints" / "tiny" / "step_000004", dtype=torch.float32)
    for (name, a), b in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    full_scalars = read_scalars(tmp_path / "full" / "logs" / "tiny")
    assert max(value for _, value in full_scalars["train/dynamic_sampling_rounds"]) > 1  # a refill happened
    assert all(value > 0 for step, value in full_scalars["train/kl"] if step > 1)
