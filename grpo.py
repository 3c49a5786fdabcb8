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
from typing import Callable, Literal

import torch
from tqdm import tqdm

import config as config_lib
import distributed
from data_types import Episode, QuestionBatch
from generation import generate
from logprobs import token_log_probs

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
        config_lib.above(self, "advantage_eps", 0)  # < 0 can flip advantage signs; 0 gives 0/0 in equal groups
        config_lib.at_least(self, "aggregation_constant", 1)
        config_lib.at_least(self, "epochs_per_rollout", 1)
        config_lib.within(self, "clip_range", 0, 1, "()")


def rollout(
    model,
    tokenizer,
    batch: QuestionBatch,
    reward_for_item: RewardForItem,
    num_answers_per_question: int,
    max_gen_len: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    compile_decode: bool = False,
    progress: bool = False,
) -> list[Episode]:
    """Sample `num_answers_per_question` completions per question and score each one."""
    with distributed.full_parameters(model):
        completions = generate(
            model,
            batch.prompt_token_ids,
            num_samples_per_prompt=num_answers_per_question,
            max_gen_len=max_gen_len,
            eos_token_id=tokenizer.eos_token_id,
            temperature=temperature,
            top_p=top_p,
            generator=generator,
            compile_decode=compile_decode,
            progress=progress,
        )
    episodes = []
    for index, completion in enumerate(completions):
        question_index = index // num_answers_per_question
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


def episode_loss_weights(episodes: list[Episode], config: LossConfig, max_gen_len: int) -> list[float]:
    """The weight of each of an episode's token losses, so the batch loss is the chosen average.

    token: 1 / (generated tokens in the whole batch); sequence: 1 / (sequences x this length);
    constant: 1 / (sequences x a fixed length). Counts are global across data-parallel ranks.
    """
    num_sequences = distributed.global_sum(len(episodes))
    if config.aggregation == "token":
        total_tokens = distributed.global_sum(sum(e.num_generated_tokens for e in episodes))
        return [1.0 / total_tokens] * len(episodes)
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
    """Right-padded tokens [B, T] and a mask [B, T-1] marking positions that predict generated tokens."""
    lengths = [len(e.prompt_token_ids) + e.num_generated_tokens for e in episodes]
    tokens = torch.full((len(episodes), max(lengths)), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(episodes), max(lengths) - 1), dtype=torch.bool)
    for row, episode in enumerate(episodes):
        sequence = episode.prompt_token_ids + episode.generated_token_ids
        tokens[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, len(episode.prompt_token_ids) - 1 : len(sequence) - 1] = True
    return tokens.to(device), mask.to(device)


def update_policy(
    model,
    optimizer,
    episodes: list[Episode],
    config: LossConfig,
    micro_batch_size: int,
    max_grad_norm: float,
    pad_token_id: int,
    max_gen_len: int,
    logprob_chunk_size: int = 256,
    progress: bool = False,
) -> dict[str, float]:
    """`epochs_per_rollout` optimizer steps on these episodes; returns the update's metrics.

    Data-parallel: `episodes` are this rank's (whole groups); losses are divided by global counts,
    and the metrics are over all ranks' episodes.
    """
    # A rank whose episodes were all filtered out still joins the other ranks' gradient sum.
    if not distributed.global_sum(len(episodes)):
        logger.warning("no episodes to train on this step (all were filtered out); skipping the update")
        return {}
    start = time.perf_counter()
    device = next(model.parameters()).device
    advantages = compute_advantages(episodes, config)
    weights = episode_loss_weights(episodes, config, max_gen_len)
    batches = micro_batches(episodes, micro_batch_size)
    old_log_probs = {}  # per micro-batch, from the first epoch: the policy that sampled the episodes
    # Summed over ranks at the end, so every rank needs the same keys, even one without episodes.
    totals = dict.fromkeys(["loss", "tokens", "entropy", "clipped", "ratio_sum"], 0.0)
    ratio_max = torch.zeros((), device=device)
    model.train()
    for epoch in range(config.epochs_per_rollout):
        bar = tqdm(batches, desc=f"update {epoch + 1}/{config.epochs_per_rollout}", disable=not progress, leave=False)
        for batch_number, indices in enumerate(bar):
            batch = [episodes[i] for i in indices]
            tokens, mask = pad_micro_batch(batch, pad_token_id, device)
            log_probs, entropy = token_log_probs(model, tokens, logprob_chunk_size)
            if epoch == 0:
                old_log_probs[batch_number] = log_probs.detach()
            per_token_advantage = torch.tensor([advantages[i] for i in indices], device=device)[:, None]
            per_token_weight = torch.tensor([weights[i] for i in indices], device=device)[:, None] * mask
            token_losses, ratio, clipped = surrogate_token_losses(
                log_probs, old_log_probs[batch_number], per_token_advantage, config
            )
            loss = (token_losses * per_token_weight).sum()
            loss.backward()
            totals["loss"] += loss.item() / config.epochs_per_rollout
            totals["tokens"] += mask.sum().item()
            totals["entropy"] += (entropy * mask).sum().item()
            totals["clipped"] += (clipped & mask).sum().item()
            totals["ratio_sum"] += (ratio.detach() * mask).sum().item()
            ratio_max = torch.maximum(ratio_max, (ratio.detach() * mask).max())
            bar.set_postfix(tok_per_s=f"{totals['tokens'] / (time.perf_counter() - start):.0f}")
        distributed.all_reduce_gradients(model)
        grad_norm = distributed.clip_grad_norm_(model, max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    totals["advantage_abs_sum"] = sum(abs(a) for a in advantages)
    totals["episodes"] = len(episodes)
    totals = distributed.global_sums(totals)
    seconds = time.perf_counter() - start
    return {
        "loss": totals["loss"],
        "grad_norm": grad_norm,
        "entropy": totals["entropy"] / max(totals["tokens"], 1),
        "clip_fraction": totals["clipped"] / max(totals["tokens"], 1),
        "ratio_mean": totals["ratio_sum"] / max(totals["tokens"], 1),
        "ratio_max": distributed.global_max(ratio_max.item()),
        "advantage_abs_mean": totals["advantage_abs_sum"] / totals["episodes"],
        "update_seconds": seconds,
        "update_tokens_per_second": totals["tokens"] / seconds,
    }
