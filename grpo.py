"""GRPO: sample a group of answers per question, score them, and push up the better-than-group ones.

Default behaviour is GRPO:Zero's: group-mean baseline, std normalisation, a token-level loss (every
generated token in the batch weighs the same), no KL term and no reference model. The variants of
the second design document (no baseline, no std, sequence or constant length normalisation,
K epochs per rollout with or without PPO clipping) are switches in `LossConfig`.
"""

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal, NamedTuple

import torch
from tqdm import tqdm

from data_types import Episode, QuestionBatch
from generation import generate
from logprobs import pad_sequences, token_log_probs

if TYPE_CHECKING:  # the config sections live with the entry point that reads them
    from train import OptimConfig, RolloutConfig

logger = logging.getLogger(__name__)
RewardForItem = Callable[[str, dict, str | None], dict]


@dataclass
class LossConfig:
    baseline: Literal["group_mean", "none"] = "group_mean"  # "none": REINFORCE on raw rewards
    std_normalization: bool = True  # divide by the group's reward std (population std)
    advantage_eps: float = 1e-4  # added to the std so all-equal groups give 0, never NaN
    aggregation: Literal["token", "sequence", "constant"] = "token"
    aggregation_constant: int | None = None  # tokens per sequence for "constant"; null = max_gen_len
    epochs_per_rollout: int = 1  # K optimizer steps on each rollout batch
    clip: Literal["none", "ppo"] = "none"
    clip_range: float = 0.2

    def validate(self) -> None:
        if self.epochs_per_rollout < 1:
            raise ValueError(f"loss.epochs_per_rollout must be >= 1, got {self.epochs_per_rollout}")
        if not 0 < self.clip_range < 1:
            raise ValueError(f"loss.clip_range must be in (0, 1), got {self.clip_range}")


def rollout(
    model,
    tokenizer,
    batch: QuestionBatch,
    reward_for_item: RewardForItem,
    config: "RolloutConfig",
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


def compute_advantages(episodes: list[Episode], config: LossConfig) -> list[float]:
    """Per-episode advantage from its group (the answers to the same question)."""
    groups = defaultdict(list)
    for index, episode in enumerate(episodes):
        groups[episode.question_index].append(index)
    advantages = [0.0] * len(episodes)
    for members in groups.values():
        rewards = torch.tensor([episodes[i].reward for i in members], dtype=torch.float64)
        centered = rewards
        if config.baseline == "group_mean":
            # Equal rewards can leave 1e-17 residues after subtracting their mean; they must give exactly 0.
            centered = rewards - rewards.mean() if rewards.max() > rewards.min() else torch.zeros_like(rewards)
        if config.std_normalization:
            centered = centered / (rewards.std(correction=0) + config.advantage_eps)
        for i, value in zip(members, centered.tolist()):
            advantages[i] = value
    return advantages


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


def surrogate_token_losses(log_probs, old_log_probs, advantages, config: LossConfig):
    """-ratio x advantage per token, or PPO's pessimistic clipped version; also which tokens were clipped.

    On-policy (old_log_probs = log_probs.detach()) the ratio is 1 and the gradient is advantage x grad log p.
    """
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = ratio * advantages
    if config.clip == "none":
        return -unclipped, ratio, torch.zeros_like(ratio, dtype=torch.bool)
    clipped = ratio.clamp(1 - config.clip_range, 1 + config.clip_range) * advantages
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
    optim: "OptimConfig",
    max_gen_len: int,
    pad_token_id: int,
    progress: bool = False,
) -> dict[str, float]:
    """`config.epochs_per_rollout` optimizer steps on these episodes; returns sums for `update_metrics`.

    counts: the whole batch's; the loss is averaged over its sequences or tokens. Under data parallel
    `episodes` are this rank's and the counts all ranks', so the ranks' losses add up to one loss.
    optimizer_step (distributed.OptimizerStep): each micro-batch's forward and backward run inside
    `optimizer_step.micro_batch(last)` (`last`: an epoch's last micro-batch); `optimizer_step()`
    then applies the accumulated gradients and returns their norm.
    """
    if not counts.with_advantage:
        # Every advantage is 0 (no group has any reward spread), so the gradient would be exactly 0:
        # skip the forward and backward, and the optimizer step, which would still move AdamW's moments.
        if not counts.sequences:
            logger.warning("no episodes to train on this step (all were filtered out); skipping the update")
        return {}
    weights = episode_loss_weights(episodes, config, counts.sequences, counts.tokens, max_gen_len)
    start = time.perf_counter()
    device = next(model.parameters()).device
    batches = micro_batches(episodes, optim.micro_batch_size)
    old_log_probs = {}  # per micro-batch, from the first epoch: the policy that sampled the episodes
    # Accumulated on the device and read once at the end: a host read per micro-batch would stall
    # the device queue. float64, so sums of float32 values are the same as Python's float sums.
    sums = torch.zeros(len(TOKEN_SUMS), dtype=torch.float64, device=device)
    ratio_max = torch.zeros((), device=device)
    grad_norm, num_tokens = 0.0, 0
    model.train()
    for epoch in range(config.epochs_per_rollout):
        bar = tqdm(batches, desc=f"update {epoch + 1}/{config.epochs_per_rollout}", disable=not progress, leave=False)
        for batch_number, indices in enumerate(bar):
            batch = [episodes[i] for i in indices]
            tokens, mask = pad_micro_batch(batch, pad_token_id, device)
            with optimizer_step.micro_batch(batch_number == len(batches) - 1):
                log_probs, entropy = token_log_probs(model, tokens, optim.logprob_chunk_size)
                if epoch == 0:
                    old_log_probs[batch_number] = log_probs.detach()
                per_token_advantage = torch.tensor([advantages[i] for i in indices], device=device)[:, None]
                per_token_weight = torch.tensor([weights[i] for i in indices], device=device)[:, None] * mask
                token_losses, ratio, clipped = surrogate_token_losses(
                    log_probs, old_log_probs[batch_number], per_token_advantage, config
                )
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
    return {**totals, "advantage_abs_sum": sum(abs(a) for a in advantages), "episodes": len(episodes),
            "ratio_max": ratio_max.item(), "grad_norm": grad_norm, "update_seconds": time.perf_counter() - start}


# What update_policy sums over micro-batches, and then what a caller sums over ranks before update_metrics.
TOKEN_SUMS = ("loss", "tokens", "entropy", "clipped", "ratio_sum")
UPDATE_SUMS = (*TOKEN_SUMS, "advantage_abs_sum", "episodes")


def update_metrics(totals: dict[str, float]) -> dict[str, float]:
    """Means of update_policy's sums (a single rank's, or every rank's added up)."""
    tokens = max(totals["tokens"], 1)
    return {
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
