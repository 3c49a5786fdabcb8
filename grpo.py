"""GRPO: sample a group of answers per question, score them, and push up the better-than-group ones.

Default behaviour is GRPO:Zero's: group-mean baseline, std normalisation, a token-level loss (every
generated token in the batch weighs the same), no KL term and no reference model. The variants of
the second design document (no baseline, no std, sequence or constant length normalisation,
K epochs per rollout with or without PPO clipping) are switches in `LossConfig`, and so are the ones
that followed DeepSeek-R1 (DAPO, Dr. GRPO, GSPO, a KL penalty to a frozen reference; docs/variants.md).
"""

import dataclasses
import logging
import time
from collections import defaultdict
from typing import Callable, NamedTuple

import torch

from config import LossConfig, OptimConfig, RolloutConfig
from data_types import Episode, QuestionBatch
from generation import generate
from logprobs import pad_sequences, token_log_probs
from run_logging import progress_bar

logger = logging.getLogger(__name__)
RewardForItem = Callable[[str, dict, str | None], dict]


def rollout(
    model,
    tokenizer,
    batch: QuestionBatch,
    reward_for_item: RewardForItem,
    config: RolloutConfig,
    generator: torch.Generator | None = None,
    progress: bool = False,
) -> list[Episode]:
    """Sample `config.num_answers_per_question` completions per question and score each one."""
    completions = generate(
        model,
        batch.prompt_token_ids,
        num_samples_per_prompt=config.num_answers_per_question,
        max_gen_len=config.max_gen_len,
        eos_token_id=tokenizer.eos_token_id,
        temperature=config.temperature,
        top_p=config.top_p,
        generator=generator,
        compile_decode=config.compile_decode,
        progress=progress,
    )
    episodes = []
    for index, completion in enumerate(completions):
        question_index = index // config.num_answers_per_question
        text = tokenizer.decode(completion.token_ids)
        score = reward_for_item(text, batch.items[question_index], tokenizer.eos_token)
        episodes.append(
            Episode(
                question_index=question_index,
                prompt=batch.prompts[question_index],
                prompt_token_ids=batch.prompt_token_ids[question_index],
                generated_token_ids=completion.token_ids,
                text=text,
                is_finished=completion.finished,
                reward=score["reward"],
                reward_info=score["reward_info"],
            )
        )
    return episodes


def compute_advantages(episodes: list[Episode], config: LossConfig,
                       batch_rewards: list[float] | None = None) -> list[float]:
    """Per-episode advantage from its group (the answers to the same question).

    std_scope "batch" divides by the std of `batch_rewards` (default: these episodes' rewards; under
    data parallel the caller passes every rank's).
    """
    groups = defaultdict(list)
    for index, episode in enumerate(episodes):
        groups[episode.question_index].append(index)
    advantages = [0.0] * len(episodes)
    if config.std_normalization and config.std_scope == "batch":
        batch_rewards = [e.reward for e in episodes] if batch_rewards is None else batch_rewards
        batch_std = reward_std(torch.tensor(batch_rewards, dtype=torch.float64), config.std_estimator)
    for members in groups.values():
        rewards = torch.tensor([episodes[i].reward for i in members], dtype=torch.float64)
        centered = rewards
        if config.baseline == "group_mean":
            # Equal rewards can leave 1e-17 residues after subtracting their mean; they must give exactly 0.
            centered = rewards - rewards.mean() if rewards.max() > rewards.min() else torch.zeros_like(rewards)
        if config.std_normalization:
            std = reward_std(rewards, config.std_estimator) if config.std_scope == "group" else batch_std
            centered = centered / (std + config.advantage_eps)
        for i, value in zip(members, centered.tolist()):
            advantages[i] = value
    return advantages


def reward_std(rewards: torch.Tensor, estimator: str) -> torch.Tensor:
    """Population (divide by n) or sample (n - 1) std. One reward has no sample std; it gets the
    population std, 0, like any zero-spread group."""
    return rewards.std(correction=1 if estimator == "sample" and len(rewards) > 1 else 0)


class BatchCounts(NamedTuple):
    """Counts over the whole batch (under data parallel: every rank's episodes)."""

    sequences: int
    tokens: int  # generated tokens
    with_advantage: int  # episodes whose advantage is not 0: none means nothing to learn


def batch_counts(episodes: list[Episode], advantages: list[float]) -> BatchCounts:
    """This rank's counts; a data-parallel caller sums them over ranks."""
    return BatchCounts(len(episodes), sum(e.num_generated_tokens for e in episodes), sum(a != 0 for a in advantages))


def episode_loss_weights(episodes: list[Episode], config: LossConfig, num_sequences: int, num_tokens: int,
                         max_gen_len: int) -> list[float]:
    """The weight of each of an episode's token losses, so the batch loss is the chosen average.

    token: 1 / num_tokens (generated tokens in the whole batch); sequence: 1 / (num_sequences x this
    length); constant: 1 / (num_sequences x a fixed length). The counts are the whole batch's: under
    data parallel the caller passes the sums over all ranks, so the ranks' losses add up to one loss.
    """
    if config.aggregation == "token":
        return [1.0 / num_tokens] * len(episodes)
    if config.aggregation == "sequence":
        return [1.0 / (num_sequences * max(e.num_generated_tokens, 1)) for e in episodes]
    constant = config.aggregation_constant or max_gen_len
    return [1.0 / (num_sequences * constant)] * len(episodes)


def surrogate_token_losses(log_probs, old_log_probs, advantages, config: LossConfig, mask=None):
    """-ratio x advantage per token, or PPO's pessimistic clipped version; also which tokens were clipped.

    On-policy (old_log_probs = log_probs.detach()) the ratio is 1 and the gradient is advantage x grad log p.
    GSPO (importance_sampling "sequence") gives every token of an answer the same ratio, the geometric
    mean of its token ratios over `mask` (the generated positions).
    """
    log_ratio = log_probs - old_log_probs
    if config.importance_sampling == "sequence":
        mean_log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = mean_log_ratio.expand_as(log_ratio)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    if config.clip == "none":
        return -unclipped, ratio, torch.zeros_like(ratio, dtype=torch.bool)
    clip_range_high = config.clip_range if config.clip_range_high is None else config.clip_range_high
    clipped = ratio.clamp(1 - config.clip_range, 1 + clip_range_high) * advantages
    return -torch.minimum(unclipped, clipped), ratio, clipped < unclipped


def micro_batches(episodes: list[Episode], micro_batch_size: int) -> list[list[int]]:
    """Episode indices grouped by similar total length, so padding is small."""
    order = sorted(range(len(episodes)), key=lambda i: len(episodes[i].prompt_token_ids) + episodes[i].num_generated_tokens)
    return [order[start : start + micro_batch_size] for start in range(0, len(order), micro_batch_size)]


def pad_micro_batch(episodes: list[Episode], pad_token_id: int, device):
    """Right-padded prompt + answer tokens [B, T] and a mask [B, T-1] of the positions predicting answer tokens."""
    return pad_sequences([e.prompt_token_ids + e.generated_token_ids for e in episodes],
                         [len(e.prompt_token_ids) for e in episodes], pad_token_id, device)


def update_policy(
    model,
    optimizer_step,
    episodes: list[Episode],
    advantages: list[float],
    counts: "BatchCounts",
    config: LossConfig,
    optim: OptimConfig,
    max_gen_len: int,
    pad_token_id: int,
    progress: bool = False,
    reference_model=None,
) -> dict[str, float]:
    """`config.epochs_per_rollout` optimizer steps on these episodes; returns sums for `update_metrics`.

    counts: the whole batch's; the loss is averaged over its sequences or tokens. Under data parallel
    `episodes` are this rank's and the counts all ranks', so the ranks' losses add up to one loss.
    optimizer_step (distributed.OptimizerStep): each micro-batch's forward and backward run inside
    `optimizer_step.micro_batch(last)` (`last`: an epoch's last micro-batch); `optimizer_step()`
    then applies the accumulated gradients and returns their norm.
    With config.kl_beta > 0, `reference_model` (the frozen initial policy) adds beta x k3 KL per token.
    """
    if not counts.with_advantage and not (config.kl_beta and counts.sequences):
        # Every advantage is 0 (no group has any reward spread) and no KL term: the gradient would be exactly
        # 0, so skip the forward and backward, and the optimizer step, which would still move AdamW's moments.
        if not counts.sequences:
            logger.warning("no episodes to train on this step (all were filtered out); skipping the update")
        return {}
    if config.kl_beta and reference_model is None:
        raise ValueError("loss.kl_beta > 0 needs the frozen reference model (reference_model=...)")
    weights = episode_loss_weights(episodes, config, counts.sequences, counts.tokens, max_gen_len)
    start = time.perf_counter()
    device = next(model.parameters()).device
    batches = micro_batches(episodes, optim.micro_batch_size)
    old_log_probs = {}  # per micro-batch, from the first epoch: the policy that sampled the episodes
    reference_log_probs = {}  # per micro-batch, from the frozen reference (kl_beta > 0 only)
    # Accumulated on the device and read once at the end: a host read per micro-batch would stall
    # the device queue. float64, so sums of float32 values are the same as Python's float sums.
    sums = torch.zeros(len(TOKEN_SUMS), dtype=torch.float64, device=device)
    ratio_max = torch.zeros((), device=device)
    kl_sum = torch.zeros((), dtype=torch.float64, device=device)
    grad_norm, num_tokens = 0.0, 0
    model.train()
    for epoch in range(config.epochs_per_rollout):
        bar = progress_bar(batches, desc=f"update {epoch + 1}/{config.epochs_per_rollout}", unit="micro-batch",
                           enabled=progress, leave=False)
        for batch_number, indices in enumerate(bar):
            batch = [episodes[i] for i in indices]
            tokens, mask = pad_micro_batch(batch, pad_token_id, device)
            with optimizer_step.micro_batch(batch_number == len(batches) - 1):
                log_probs, entropy = token_log_probs(model, tokens, optim.logprob_chunk_size)
                if epoch == 0:
                    old_log_probs[batch_number] = log_probs.detach()
                    if config.kl_beta:
                        with torch.no_grad():
                            reference = token_log_probs(reference_model, tokens, optim.logprob_chunk_size)[0]
                        # Prompt and padding positions get the policy's own value (KL 0), so a far-off
                        # reference there cannot overflow exp() into inf x 0 = NaN.
                        reference_log_probs[batch_number] = torch.where(mask, reference, log_probs.detach())
                per_token_advantage = torch.tensor([advantages[i] for i in indices], device=device)[:, None]
                per_token_weight = torch.tensor([weights[i] for i in indices], device=device)[:, None] * mask
                token_losses, ratio, clipped = surrogate_token_losses(
                    log_probs, old_log_probs[batch_number], per_token_advantage, config, mask
                )
                if config.kl_beta:
                    kl = k3_kl(log_probs, reference_log_probs[batch_number])
                    token_losses = token_losses + config.kl_beta * kl
                    kl_sum += (kl.detach() * mask).sum().double()
                loss = (token_losses * per_token_weight).sum()
                loss.backward()
            ratio = ratio.detach()
            sums += torch.stack([loss.detach().double() / config.epochs_per_rollout, mask.sum().double(),
                                 (entropy * mask).sum().double(), (clipped & mask).sum().double(),
                                 (ratio * mask).sum().double()])
            ratio_max = torch.maximum(ratio_max, (ratio * mask).max())
            num_tokens += sum(episode.num_generated_tokens for episode in batch)
            bar.set_postfix(tok_per_s=f"{num_tokens / (time.perf_counter() - start):.0f}")
        grad_norm = optimizer_step()
    totals = dict(zip(TOKEN_SUMS, sums.tolist()))
    if config.kl_beta:
        totals["kl_sum"] = kl_sum.item()
    return {**totals, "advantage_abs_sum": sum(abs(a) for a in advantages), "episodes": len(episodes),
            "ratio_max": ratio_max.item(), "grad_norm": grad_norm, "update_seconds": time.perf_counter() - start}


# What update_policy sums over micro-batches, and then what a caller sums over ranks before update_metrics.
TOKEN_SUMS = ("loss", "tokens", "entropy", "clipped", "ratio_sum")
UPDATE_SUMS = (*TOKEN_SUMS, "advantage_abs_sum", "episodes", "kl_sum")  # kl_sum: only with kl_beta > 0


def update_metrics(totals: dict[str, float]) -> dict[str, float]:
    """Means of update_policy's sums (a single rank's, or every rank's added up)."""
    tokens = max(totals["tokens"], 1)
    return {
        **({"kl": totals["kl_sum"] / tokens} if "kl_sum" in totals else {}),
        "loss": totals["loss"],
        "grad_norm": totals["grad_norm"],
        "entropy": totals["entropy"] / tokens,
        "clip_fraction": totals["clipped"] / tokens,
        "ratio_mean": totals["ratio_sum"] / tokens,
        "ratio_max": totals["ratio_max"],
        "advantage_abs_mean": totals["advantage_abs_sum"] / max(totals["episodes"], 1),
        "update_seconds": totals["update_seconds"],
        "update_tokens_per_second": totals["tokens"] / totals["update_seconds"],
    }


# ----------------------------------------------------------------------------- variants (docs/variants.md)


def k3_kl(log_probs: torch.Tensor, reference_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference), Schulman's k3 estimator: r - log r - 1 with r = p_ref / p.

    Never negative, zero where the two agree, and unbiased for the KL when tokens are sampled from the policy.
    """
    log_ratio = reference_log_probs - log_probs
    return torch.exp(log_ratio) - log_ratio - 1


def overlong_penalty(num_tokens: int, max_gen_len: int, config: LossConfig) -> float:
    """DAPO's soft overlong punishment: 0 up to the last L = fraction x max_gen_len tokens, then a
    linear ramp that reaches config.overlong_penalty_factor at max_gen_len."""
    buffer = round(config.overlong_buffer_fraction * max_gen_len)
    if buffer == 0:
        return 0.0
    return config.overlong_penalty_factor * min(max(num_tokens - (max_gen_len - buffer), 0) / buffer, 1.0)


def apply_overlong_penalty(episodes: list[Episode], max_gen_len: int, config: LossConfig) -> list[Episode]:
    """The episodes with their length penalty taken off the reward (and kept in reward_info)."""
    shaped = []
    for episode in episodes:
        penalty = overlong_penalty(episode.num_generated_tokens, max_gen_len, config)
        shaped.append(dataclasses.replace(episode, reward=episode.reward - penalty,
                                          reward_info={**episode.reward_info, "overlong_penalty": penalty}))
    return shaped


def sample_informative_groups(
    sample_round: Callable[[int], list[Episode]], num_groups: int, max_rounds: int
) -> tuple[list[Episode], list[Episode], int]:
    """DAPO's dynamic sampling: drop groups whose rewards are all equal (their advantages are 0) and
    sample more questions until `num_groups` groups are left, for at most `max_rounds` rounds.

    `sample_round(r)` returns round r's scored episodes (whole groups, numbered by question_index).
    Returns the kept groups' episodes (renumbered 0.., at most `num_groups` groups), every sampled
    episode (for logging what the policy produced), and the number of rounds it took.
    """
    kept, sampled = [], []
    rounds = 0
    while len(kept) < num_groups and rounds < max_rounds:
        episodes = sample_round(rounds)
        rounds += 1
        sampled += episodes
        groups = defaultdict(list)
        for episode in episodes:
            groups[episode.question_index].append(episode)
        kept += [group for group in groups.values() if len({e.reward for e in group}) > 1]
    if len(kept) < num_groups:
        logger.warning("dynamic sampling: %d of %d groups with different rewards after %d rounds; training on those",
                       len(kept), num_groups, rounds)
    renumbered = [dataclasses.replace(episode, question_index=index)
                  for index, group in enumerate(kept[:num_groups]) for episode in group]
    return renumbered, sampled, rounds
