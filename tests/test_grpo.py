"""GRPO advantages and losses against values and gradients computed by hand in the test."""

import ast
import copy
import logging
import math
from pathlib import Path

import pytest
import torch

from data_types import Episode
from distributed import OptimizerStep
from grpo import LossConfig, compute_advantages, surrogate_token_losses, update_policy
from qwen2_model import Transformer
from config import OptimConfig

PAD = 0
LEARNING_RATE = 0.1


def make_episode(question_index, prompt, generated, reward):
    return Episode(question_index, "", prompt, generated, "", True, reward, {"format_reward": 0.0, "answer_reward": 0.0})


def test_advantages_group_mean_and_population_std():
    rewards = [1.1, 0.1, 0.0, 0.5, 0.5, 0.5]
    episodes = [make_episode(i // 3, [1], [2], r) for i, r in enumerate(rewards)]
    std = math.sqrt((0.7**2 + 0.3**2 + 0.4**2) / 3)
    expected = [0.7 / (std + 1e-4), -0.3 / (std + 1e-4), -0.4 / (std + 1e-4), 0.0, 0.0, 0.0]
    assert compute_advantages(episodes, LossConfig()) == pytest.approx(expected, abs=1e-12)
    assert compute_advantages(episodes, LossConfig(std_normalization=False)) == pytest.approx(
        [0.7, -0.3, -0.4, 0, 0, 0], abs=1e-12
    )
    assert compute_advantages(episodes, LossConfig(baseline="none", std_normalization=False)) == pytest.approx(rewards)
    no_baseline = compute_advantages(episodes, LossConfig(baseline="none"))
    assert no_baseline[:3] == pytest.approx([1.1 / (std + 1e-4), 0.1 / (std + 1e-4), 0.0])
    assert no_baseline[3:] == pytest.approx([0.5 / 1e-4] * 3)  # std 0: only eps divides


def test_advantages_with_the_sample_std():
    rewards = [1.1, 0.1, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 7.0]  # groups of 3 and 5, and a group of one
    episodes = [make_episode(q, [1], [2], r) for q, r in zip([0, 0, 0, 1, 1, 1, 1, 1, 2], rewards)]
    std_3 = math.sqrt((0.7**2 + 0.3**2 + 0.4**2) / 2)  # divide by G - 1, as torch.std does
    std_5 = math.sqrt((0.8**2 + 4 * 0.2**2) / 4)
    expected = [0.7 / (std_3 + 1e-4), -0.3 / (std_3 + 1e-4), -0.4 / (std_3 + 1e-4), 0.8 / (std_5 + 1e-4)]
    expected += [-0.2 / (std_5 + 1e-4)] * 4 + [0.0]  # a lone answer: no spread, no advantage (not NaN)
    assert compute_advantages(episodes, LossConfig(std_estimator="sample")) == pytest.approx(expected, abs=1e-12)
    population = compute_advantages(episodes, LossConfig(std_estimator="population"))
    assert population == compute_advantages(episodes, LossConfig())  # the default
    assert population[3] == pytest.approx(0.8 / (math.sqrt((0.8**2 + 4 * 0.2**2) / 5) + 1e-4), abs=1e-12)
    lone = compute_advantages(episodes[-1:], LossConfig(baseline="none", std_estimator="sample"))
    assert lone == pytest.approx([7.0 / 1e-4])  # as with the population std: only eps divides


def test_surrogate_values_by_hand():
    log_probs = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))  # ratios 1.5, 0.5, 1.0 against old log p = 0
    old = torch.zeros(1, 3)
    advantages = torch.tensor([[2.0, 2.0, -1.0]])
    losses, ratio, clipped = surrogate_token_losses(log_probs, old, advantages, LossConfig(clip="none"))
    assert losses[0].tolist() == pytest.approx([-3.0, -1.0, 1.0])
    losses, ratio, clipped = surrogate_token_losses(log_probs, old, advantages, LossConfig(clip="ppo", clip_range=0.2))
    # A > 0: min(1.5*2, 1.2*2) = 2.4 (clipped); min(0.5*2, 0.8*2) = 1.0 (not clipped); r = 1: -(-1)
    assert losses[0].tolist() == pytest.approx([-2.4, -1.0, 1.0])
    assert clipped[0].tolist() == [True, False, False]
    negative = torch.tensor([[-1.0, -1.0, -1.0]])
    losses, _, clipped = surrogate_token_losses(log_probs, old, negative, LossConfig(clip="ppo", clip_range=0.2))
    # A < 0: min(-1.5, -1.2) = -1.5 (not clipped); min(-0.5, -0.8) = -0.8 (clipped)
    assert losses[0].tolist() == pytest.approx([1.5, 0.8, 1.0])
    assert clipped[0].tolist() == [False, True, False]


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32)


def sample_episodes():
    """Two groups with prompts and answers of different lengths, so micro-batches differ in size."""
    generator = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(1, 400, (n,), generator=generator).tolist()
    shapes = [(5, 3, 1.1), (7, 9, 0.0), (4, 1, 0.1), (6, 14, 1.0), (3, 6, 0.0), (8, 2, 0.1)]
    return [make_episode(i // 3, ids(p), ids(g), r) for i, (p, g, r) in enumerate(shapes)]


def per_token_log_probs(model, episode):
    """log p of each generated token, from one plain full forward (independent of logprobs.py)."""
    sequence = torch.tensor([episode.prompt_token_ids + episode.generated_token_ids])
    log_probs = torch.log_softmax(model(sequence).float(), dim=-1)[0, :-1]
    targets = sequence[0, 1:]
    picked = log_probs.gather(-1, targets[:, None])[:, 0]
    return picked[len(episode.prompt_token_ids) - 1 :]


def hand_loss(model, episodes, advantages, weight_of, old_log_probs=None, clip_range=None):
    total = 0.0
    for index, episode in enumerate(episodes):
        log_probs = per_token_log_probs(model, episode)
        old = log_probs.detach() if old_log_probs is None else old_log_probs[index]
        ratio = torch.exp(log_probs - old)
        objective = ratio * advantages[index]
        if clip_range is not None:
            objective = torch.minimum(objective, ratio.clamp(1 - clip_range, 1 + clip_range) * advantages[index])
        total = total - weight_of(episode, episodes) * objective.sum()
    return total


def sgd_update(model, episodes, config, micro_batch_size, max_gen_len=16):
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    advantages = compute_advantages(episodes, config)
    update = update_policy(model, OptimizerStep(model, optimizer, max_grad_norm=1e9), episodes, advantages,
                           config=config, optim=OptimConfig(micro_batch_size=micro_batch_size, logprob_chunk_size=4),
                           max_gen_len=max_gen_len, pad_token_id=PAD)
    return model, update


def expected_sgd_update(model, loss_fn):
    model = copy.deepcopy(model)
    model.zero_grad()
    loss = loss_fn(model)
    loss.backward()
    with torch.no_grad():
        for param in model.parameters():
            param -= LEARNING_RATE * param.grad
    return model, loss.item()


def assert_same_parameters(model_a, model_b, atol=1e-6):
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.allclose(a, b, atol=atol), name


TOKEN = lambda episode, episodes: 1.0 / sum(e.num_generated_tokens for e in episodes)
SEQUENCE = lambda episode, episodes: 1.0 / (len(episodes) * episode.num_generated_tokens)
CONSTANT = lambda episode, episodes: 1.0 / (len(episodes) * 16)


@pytest.mark.parametrize(
    "aggregation, weight_of", [("token", TOKEN), ("sequence", SEQUENCE), ("constant", CONSTANT)]
)
@pytest.mark.parametrize("micro_batch_size", [1, 4])
def test_update_equals_hand_gradient(policy, aggregation, weight_of, micro_batch_size):
    episodes = sample_episodes()
    config = LossConfig(aggregation=aggregation)
    advantages = compute_advantages(episodes, config)
    updated, metrics = sgd_update(policy, episodes, config, micro_batch_size)
    expected, expected_loss = expected_sgd_update(policy, lambda m: hand_loss(m, episodes, advantages, weight_of))
    assert_same_parameters(updated, expected)
    assert metrics["loss"] == pytest.approx(expected_loss, abs=1e-6)
    assert metrics["ratio_mean"] == pytest.approx(1.0) and metrics["clip_fraction"] == 0.0


@pytest.mark.parametrize("clip", ["ppo", "none"])
def test_two_epochs_reuse_the_sampling_policy_log_probs(policy, clip):
    """K = 2: the second step's ratio is against the policy that sampled, not the once-updated one."""
    episodes = sample_episodes()
    config = LossConfig(epochs_per_rollout=2, clip=clip, clip_range=0.001)
    advantages = compute_advantages(episodes, config)
    with torch.no_grad():
        sampling_log_probs = [per_token_log_probs(policy, e) for e in episodes]
    clip_range = 0.001 if clip == "ppo" else None
    loss_fn = lambda m: hand_loss(m, episodes, advantages, TOKEN, sampling_log_probs, clip_range)
    after_first, _ = expected_sgd_update(policy, loss_fn)
    expected, _ = expected_sgd_update(after_first, loss_fn)
    updated, metrics = sgd_update(policy, episodes, config, micro_batch_size=2)
    assert_same_parameters(updated, expected, atol=1e-5)
    if clip == "ppo":  # the first epoch is on-policy (ratio 1, nothing clipped); a 0.1% range is left after a step
        assert 0 < metrics["clip_fraction"] <= 0.5
    assert metrics["ratio_max"] > 1.0


def test_all_equal_rewards_give_zero_gradient_so_the_update_is_skipped(policy, caplog):
    episodes = [make_episode(e.question_index, e.prompt_token_ids, e.generated_token_ids, 0.1) for e in sample_episodes()]
    config = LossConfig()
    assert compute_advantages(episodes, config) == [0.0] * len(episodes)  # exactly 0, so the gradient is 0
    with torch.no_grad():  # the loss the update would backpropagate is identically 0
        log_probs = per_token_log_probs(policy, episodes[0])
        losses, _, _ = surrogate_token_losses(log_probs, log_probs, torch.zeros(()), config)
    assert torch.all(losses == 0)
    with caplog.at_level(logging.WARNING):
        updated, metrics = sgd_update(policy, episodes, config, micro_batch_size=2)
    assert metrics == {} and not caplog.text  # skipped without a forward, and not an "empty batch"
    assert_same_parameters(updated, policy, atol=0.0)


def test_one_group_with_spread_is_enough_to_update(policy):
    flat_second_group = lambda e: 0.1 if e.question_index else e.reward
    episodes = [make_episode(e.question_index, e.prompt_token_ids, e.generated_token_ids, flat_second_group(e))
                for e in sample_episodes()]
    updated, metrics = sgd_update(policy, episodes, LossConfig(), micro_batch_size=2)
    assert metrics["grad_norm"] > 0 and not math.isnan(metrics["loss"])
    assert max((a - b).abs().max().item() for a, b in zip(updated.parameters(), policy.parameters())) > 0


@pytest.mark.parametrize("aggregation, weight_of", [("token", TOKEN), ("sequence", SEQUENCE)])
def test_a_flat_group_is_left_out_of_the_update_but_counted_in_its_average(policy, aggregation, weight_of):
    """Its answers have advantage 0: the update skips their forward and backward, yet its result is the
    hand gradient over the whole batch, whose average still counts their tokens (or sequences)."""
    flat_second_group = lambda e: 0.1 if e.question_index else e.reward
    episodes = [make_episode(e.question_index, e.prompt_token_ids, e.generated_token_ids, flat_second_group(e))
                for e in sample_episodes()]
    config = LossConfig(aggregation=aggregation)
    advantages = compute_advantages(episodes, config)
    assert advantages[3:] == [0.0] * 3
    updated, metrics = sgd_update(policy, episodes, config, micro_batch_size=2)
    expected, expected_loss = expected_sgd_update(policy, lambda m: hand_loss(m, episodes, advantages, weight_of))
    assert_same_parameters(updated, expected)
    assert metrics["loss"] == pytest.approx(expected_loss, abs=1e-6)
    assert metrics["advantage_abs_mean"] == pytest.approx(sum(map(abs, advantages)) / 6)


def test_empty_batch_skips_the_update_with_a_warning(policy, caplog):
    with caplog.at_level(logging.WARNING):
        updated, metrics = sgd_update(policy, [], LossConfig(), micro_batch_size=2)
    assert metrics == {} and "no episodes" in caplog.text
    assert_same_parameters(updated, policy, atol=0.0)


@pytest.mark.parametrize("module", ["grpo.py", "logprobs.py"])
def test_algorithm_code_reaches_ranks_only_through_distributed_py(module):
    """Whole-batch sums and gathers go through distributed.py's helpers (identities in a single process, so the
    algorithm reads the same there); torch.distributed itself stays in distributed.py."""
    source = (Path(__file__).resolve().parents[1] / module).read_text()
    tree = ast.parse(source)
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert names and not [name for name in names if name.startswith("torch.distributed")]
    assert "torch.distributed" not in source and "dist." not in source
