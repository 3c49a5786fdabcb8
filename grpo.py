"""GRPO: sample a group of answers per question, score them, and push up the better-than-group ones.

Default behaviour is GRPO:Zero's: group-mean baseline, std normalisation, a token-level loss (every
generated token in the batch weighs the same), no KL term and no reference model. The variants of
the second design document (no baseline, no std, sequence or constant length normalisation,
K epochs per rollout with or without PPO clipping) are switches in `LossConfig`, and so are the ones
that followed DeepSeek-R1 (DAPO, Dr. GRPO, GSPO, CISPO, SAPO, RLOO, REINFORCE++ whitening, top-entropy
tokens, a KL penalty to a frozen reference, truncated importance sampling against the sampler; docs/variants.md).

Each function reads as the single-process algorithm. Under data parallel, what needs the whole batch (counts,
batch-wide reward statistics, the entropy threshold, the logged metrics) is summed or gathered over the ranks
inside these functions, through distributed.py's helpers, which are identities in a single process.
"""

import dataclasses
import logging
import time
from collections import defaultdict
from typing import Callable, NamedTuple

import torch

import distributed
from config import LossConfig, OptimConfig, RolloutConfig
from data_types import Episode, QuestionBatch
from generation import generate
from logprobs import AnswerBatch, answer_batch, answer_log_probs
from run_logging import progress_bar

logger = logging.getLogger(__name__)
Reward = Callable[[str, dict, str | None], dict]


def rollout(
    model,
    tokenizer,
    batch: QuestionBatch,
    reward: Reward,
    *,
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
        max_rows=config.max_decode_rows,
    )
    episodes = []
    for index, completion in enumerate(completions):
        question_index = index // config.num_answers_per_question
        text = tokenizer.decode(completion.token_ids)
        score = reward(text, batch.items[question_index], tokenizer.eos_token)
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
                sampler_log_probs=completion.log_probs,
                sampler_entropies=completion.entropies,
            )
        )
    return episodes


def compute_advantages(episodes: list[Episode], config: LossConfig) -> list[float]:
    """Per-episode advantages: from each answer's group (group_advantages), then for loss.whiten_advantages
    whitened over the batch. Under data parallel the batch-wide statistics (std_scope "batch", whitening) are
    over every rank's episodes, so each rank's advantages are those of a single-process run."""
    batch_rewards = None
    if config.std_normalization and config.std_scope == "batch":
        batch_rewards = distributed.all_ranks([e.reward for e in episodes])
    advantages = group_advantages(episodes, config, batch_rewards)
    if config.whiten_advantages:  # REINFORCE++
        answers = distributed.all_ranks(list(zip(advantages, (e.num_generated_tokens for e in episodes))))
        advantages = whiten_advantages(advantages, answers, config.advantage_eps)
    return advantages


def group_advantages(episodes: list[Episode], config: LossConfig,
                     batch_rewards: list[float] | None = None) -> list[float]:
    """Per-episode advantage from its group (the answers to the same question).

    std_scope "batch" divides by the std of `batch_rewards` (default: these episodes' rewards).
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
        if config.baseline != "none":
            # Equal rewards can leave 1e-17 residues after subtracting a baseline; they must give exactly 0.
            centered = (rewards - group_baseline(rewards, config.baseline) if rewards.max() > rewards.min()
                        else torch.zeros_like(rewards))
        if config.std_normalization:
            std = reward_std(rewards, config.std_estimator) if config.std_scope == "group" else batch_std
            centered = centered / (std + config.advantage_eps)
        for i, value in zip(members, centered.tolist()):
            advantages[i] = value
    return advantages


def group_baseline(rewards: torch.Tensor, baseline: str) -> torch.Tensor:
    """What each answer's reward is compared with: the group's mean (GRPO), or for leave_one_out the mean of
    the other G - 1 answers' rewards (RLOO, Ahmadian et al. 2024, arXiv:2402.14740), an estimate that does
    not depend on the answer itself. r_i - that mean is G / (G - 1) x (r_i - the group's mean)."""
    if baseline == "group_mean":
        return rewards.mean()
    return (rewards.sum() - rewards) / (len(rewards) - 1)


def reward_std(rewards: torch.Tensor, estimator: str) -> torch.Tensor:
    """Population (divide by n) or sample (n - 1) std. One reward has no sample std; it gets the
    population std, 0, like any zero-spread group."""
    return rewards.std(correction=1 if estimator == "sample" and len(rewards) > 1 else 0)


class BatchCounts(NamedTuple):
    """Counts over the whole batch (under data parallel: every rank's episodes)."""

    sequences: int
    tokens: int  # generated tokens
    with_advantage: int  # episodes whose advantage is not 0: none means nothing to learn


def whiten_advantages(advantages: list[float], batch: list[tuple[float, int]], eps: float) -> list[float]:
    """REINFORCE++'s normalisation (Hu 2025, arXiv:2501.03262): (A - mean) / (std + eps), with the mean and
    (population) std over every generated token of the batch, since each token carries its answer's advantage.

    batch: (advantage, generated tokens) of every answer of the batch (under data parallel: every rank's),
    these `advantages` among them.
    """
    if not batch:
        return list(advantages)
    values, tokens = torch.tensor(batch, dtype=torch.float64).T
    mean = (tokens * values).sum() / tokens.sum()
    std = ((tokens * (values - mean) ** 2).sum() / tokens.sum()).sqrt()
    return ((torch.tensor(advantages, dtype=torch.float64) - mean) / (std + eps)).tolist()


def high_entropy_threshold(entropies: list[float], fraction: float) -> float:
    """The entropy at or above which a token is among the batch's `fraction` highest-entropy tokens (its
    round(fraction x N)-th highest, at least the highest; ties can let a few more in).

    Wang et al. 2025 (arXiv:2506.01939, "Beyond the 80/20 Rule") train only on these "forking" tokens
    (fraction 0.2), where the answer's reasoning branches; the low-entropy rest is left out of the loss.
    """
    values = torch.tensor(entropies, dtype=torch.float32)
    return values.topk(max(1, round(fraction * len(values)))).values[-1].item()


def batch_counts(episodes: list[Episode], advantages: list[float]) -> BatchCounts:
    """The counts over every rank's episodes (these episodes' in a single process)."""
    counts = BatchCounts(len(episodes), sum(e.num_generated_tokens for e in episodes), sum(a != 0 for a in advantages))
    return BatchCounts(*(int(count) for count in distributed.global_sums(counts._asdict()).values()))


def episode_loss_weights(episodes: list[Episode], config: LossConfig, *, num_sequences: int, num_tokens: int,
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


def surrogate_token_losses(log_probs, old_log_probs, advantages, config: LossConfig, *, mask=None):
    """-ratio x advantage per token, or a bounded version of it (loss.clip); also which tokens were clipped.

    On-policy (old_log_probs = log_probs.detach()) the ratio is 1 and every version's gradient is
    advantage x grad log p. GSPO (importance_sampling "sequence") gives every token of an answer the same
    ratio, the geometric mean of its token ratios over `mask` (the generated positions).
    """
    log_ratio = log_probs - old_log_probs
    if config.importance_sampling == "sequence":
        mean_log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = mean_log_ratio.expand_as(log_ratio)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    not_clipped = torch.zeros_like(ratio, dtype=torch.bool)
    if config.clip == "none":
        return -unclipped, ratio, not_clipped
    if config.clip == "sapo":
        # SAPO (Qwen, arXiv:2511.20347; the form TRL and ms-swift document): a smooth gate instead of the hard
        # clip, f(r) = sigmoid(tau (r - 1)) x 4 / tau, tau = sapo_tau_positive where A > 0, else sapo_tau_negative.
        # Its gradient 4 sigmoid (1 - sigmoid) r A grad log p is GRPO's at r = 1 and fades as r leaves 1.
        tau = torch.full_like(advantages, config.sapo_tau_negative).masked_fill(advantages > 0, config.sapo_tau_positive)
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages, ratio, not_clipped
    cap = 1 + (config.clip_range if config.clip_range_high is None else config.clip_range_high)
    if config.clip == "cispo":
        # CISPO (MiniMax-M1, arXiv:2506.13585): -sg(min(r, 1 + eps_high)) x A x log p. The weight is truncated and
        # detached, so a token past the cap keeps a bounded gradient where PPO's clip would zero it; no lower bound.
        return -ratio.clamp(max=cap).detach() * advantages * log_probs, ratio, ratio > cap
    clipped = ratio.clamp(1 - config.clip_range, cap) * advantages
    return -torch.minimum(unclipped, clipped), ratio, clipped < unclipped


def micro_batches(episodes: list[Episode], micro_batch_size: int) -> list[list[int]]:
    """Episode indices in micro-batches that keep a group's answers together (their shared prompt runs
    once: logprobs.AnswerBatch), prompts of similar length side by side, so padding is small."""
    order = sorted(range(len(episodes)), key=lambda i: (len(episodes[i].prompt_token_ids), episodes[i].question_index,
                                                        episodes[i].num_generated_tokens))
    return [order[start : start + micro_batch_size] for start in range(0, len(order), micro_batch_size)]


def episode_batch(episodes: list[Episode], pad_token_id: int, device) -> AnswerBatch:
    """The episodes' prompt + answer tokens, laid out to score the answer tokens (see logprobs.AnswerBatch)."""
    return answer_batch([e.prompt_token_ids + e.generated_token_ids for e in episodes],
                        [len(e.prompt_token_ids) for e in episodes], pad_token_id, device)


def per_token_values(values: list[list[float]], mask: torch.Tensor) -> torch.Tensor:
    """One value per generated token of each episode (e.g. its sampler_log_probs) laid out as an AnswerBatch's
    mask: row i holds episode i's values from column 0, and 0 after them."""
    laid_out = torch.zeros(mask.shape, dtype=torch.float32)
    for row, row_values in enumerate(values):
        laid_out[row, : len(row_values)] = torch.tensor(row_values)
    return laid_out.to(mask.device)


def token_loss_scales(batch: list[Episode], *, log_probs: torch.Tensor, sampler_log_probs: torch.Tensor | None,
                      mask: torch.Tensor, config: LossConfig, entropy_threshold: float | None) -> torch.Tensor | None:
    """Detached factors of each token's policy loss, or None: truncated importance sampling's
    min(p_train / p_sampler, C) (loss.sampler_is_cap) times top-entropy masking's 0 or 1 (loss.top_entropy_fraction).

    Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy
    RL Training"): the sampler's numbers are not the trainer's (bfloat16, KV cache, other kernels), so the
    answers come from a slightly different policy; weighting each token by the ratio corrects that, and the
    cap C bounds the variance. log_probs: the trainer's, of the policy that sampled (the first epoch's), and
    sampler_log_probs the sampler's, both laid out as `mask`.
    """
    scale = None
    if config.sampler_is_cap:
        scale = torch.exp(log_probs.detach() - sampler_log_probs).clamp(max=config.sampler_is_cap)
    if config.top_entropy_fraction:
        entropies = per_token_values([e.sampler_entropies for e in batch], mask)
        keep = (entropies >= entropy_threshold).float()
        scale = keep if scale is None else scale * keep
    return scale


def update_policy(
    model,
    optimizer_step,
    episodes: list[Episode],
    advantages: list[float],
    *,
    config: LossConfig,
    optim: OptimConfig,
    max_gen_len: int,
    pad_token_id: int,
    reference_model=None,
    progress: bool = False,
) -> dict[str, float]:
    """`config.epochs_per_rollout` optimizer steps on these episodes; returns UpdateStats.metrics of the whole
    batch (empty when the update is skipped).

    The loss is averaged over the whole batch's sequences or tokens: under data parallel `episodes` are this
    rank's and the counts every rank's, so the ranks' losses add up to one loss, and the metrics are every rank's.
    optimizer_step (distributed.OptimizerStep): each micro-batch's forward and backward run inside
    `optimizer_step.micro_batch(last)` (`last`: an epoch's last micro-batch); `optimizer_step()`
    then applies the accumulated gradients and returns their norm.
    With config.kl_beta > 0, `reference_model` (the frozen initial policy) adds beta x k3 KL per token.
    """
    counts = batch_counts(episodes, advantages)
    if not counts.with_advantage and not (config.kl_beta and counts.sequences):
        # Every advantage is 0 (no group has any reward spread) and no KL term: the gradient would be exactly
        # 0, so skip the forward and backward, and the optimizer step, which would still move AdamW's moments.
        if not counts.sequences:
            logger.warning("no episodes to train on this step (all were filtered out); skipping the update")
        return {}
    sampled = check_update_inputs(episodes, config, reference_model)
    entropy_threshold = batch_entropy_threshold(episodes, config)
    weights = episode_loss_weights(episodes, config, num_sequences=counts.sequences, num_tokens=counts.tokens,
                                   max_gen_len=max_gen_len)
    episode_sums = {"advantage_abs_sum": sum(abs(a) for a in advantages), "episodes": len(episodes)}
    episodes, advantages, weights = episodes_with_gradient(episodes, advantages, weights, config)
    stats = UpdateStats(next(model.parameters()).device, config)
    batches = micro_batches(episodes, optim.micro_batch_size)
    anchors = {}  # per micro-batch, fixed by the first epoch
    model.train()
    for epoch in range(config.epochs_per_rollout):
        bar = progress_bar(batches, desc=f"update {epoch + 1}/{config.epochs_per_rollout}", unit="micro-batch",
                           enabled=progress, leave=False)
        for batch_number, indices in enumerate(bar):
            batch = [episodes[i] for i in indices]
            scored = episode_batch(batch, pad_token_id, stats.device)
            with optimizer_step.micro_batch(batch_number == len(batches) - 1):
                log_probs, entropy = answer_log_probs(model, scored, optim.logprob_chunk_size)
                if epoch == 0:
                    anchors[batch_number] = anchor_micro_batch(
                        batch, scored, log_probs, sampled=sampled, reference_model=reference_model, config=config,
                        logprob_chunk_size=optim.logprob_chunk_size, entropy_threshold=entropy_threshold)
                    stats.add_sampler_diff(batch, log_probs, anchors[batch_number].sampler_log_probs, scored.mask)
                result = micro_batch_loss(log_probs, anchors[batch_number], [advantages[i] for i in indices],
                                          [weights[i] for i in indices], scored.mask, config)
                result.loss.backward()
            stats.add(result, batch, entropy, scored.mask)
            bar.set_postfix(tok_per_s=f"{stats.tokens_per_second():.0f}")
        stats.grad_norm = optimizer_step()
    return stats.metrics(episode_sums)


def check_update_inputs(episodes: list[Episode], config: LossConfig, reference_model) -> bool:
    """Whether the episodes carry the sampler's per-token log-probs and entropies (grpo.rollout's do); raises
    when the loss needs something the caller did not pass."""
    if config.kl_beta and reference_model is None:
        raise ValueError("loss.kl_beta > 0 needs the frozen reference model (reference_model=...)")
    sampled = all(len(e.sampler_log_probs) == e.num_generated_tokens for e in episodes)
    if (config.sampler_is_cap or config.top_entropy_fraction) and not sampled:
        raise ValueError("loss.sampler_is_cap and loss.top_entropy_fraction need the sampler's per-token log-probs "
                         "and entropies (episodes from grpo.rollout)")
    return sampled


def batch_entropy_threshold(episodes: list[Episode], config: LossConfig) -> float | None:
    """With loss.top_entropy_fraction, the sampler entropy at or above which a token trains, over every rank's
    tokens (high_entropy_threshold); None otherwise."""
    if not config.top_entropy_fraction:
        return None
    entropies = distributed.all_ranks([entropy for episode in episodes for entropy in episode.sampler_entropies])
    return high_entropy_threshold(entropies, config.top_entropy_fraction) if entropies else None


def episodes_with_gradient(episodes: list[Episode], advantages: list[float], weights: list[float],
                           config: LossConfig) -> tuple[list[Episode], list[float], list[float]]:
    """The episodes whose loss is not exactly 0, with their advantages and weights.

    An answer with advantage 0 (its group's rewards were all equal) adds exactly 0 to the loss and its gradient,
    in every epoch: leave it out of the forward and backward. The weights, from the whole batch's counts, are
    unchanged, so the update is too. Early in training that is most answers. Kept with a KL term (it has a
    gradient there) and under torchrun (ranks left with different numbers of micro-batches would desynchronise
    FSDP).
    """
    if config.kl_beta or distributed.is_initialized():
        return episodes, advantages, weights
    trained = [index for index, advantage in enumerate(advantages) if advantage != 0]
    return tuple([values[i] for i in trained] for values in (episodes, advantages, weights))


class MicroBatchAnchor(NamedTuple):
    """What a micro-batch's first epoch fixes for every epoch (each laid out as its AnswerBatch's mask)."""

    old_log_probs: torch.Tensor  # of the policy that sampled the episodes: the ratio's denominator
    reference_log_probs: torch.Tensor | None  # the frozen reference's (kl_beta > 0)
    sampler_log_probs: torch.Tensor | None  # the sampler's own (episodes from grpo.rollout)
    loss_scale: torch.Tensor | None  # token_loss_scales (None: every token weighs fully)


def anchor_micro_batch(batch: list[Episode], scored: AnswerBatch, log_probs: torch.Tensor, *, sampled: bool,
                       reference_model, config: LossConfig, logprob_chunk_size: int,
                       entropy_threshold: float | None) -> MicroBatchAnchor:
    """The micro-batch's MicroBatchAnchor, from the first epoch's log-probs (before any optimizer step)."""
    mask = scored.mask
    sampler_log_probs = per_token_values([e.sampler_log_probs for e in batch], mask) if sampled else None
    loss_scale = token_loss_scales(batch, log_probs=log_probs, sampler_log_probs=sampler_log_probs, mask=mask,
                                   config=config, entropy_threshold=entropy_threshold)
    reference_log_probs = None
    if config.kl_beta:
        with torch.no_grad():
            reference, _ = answer_log_probs(reference_model, scored, logprob_chunk_size, with_entropy=False)
        # Padding positions get the policy's own value (KL 0), so a far-off reference
        # there cannot overflow exp() into inf x 0 = NaN.
        reference_log_probs = torch.where(mask, reference, log_probs.detach())
    return MicroBatchAnchor(log_probs.detach(), reference_log_probs, sampler_log_probs, loss_scale)


class MicroBatchLoss(NamedTuple):
    loss: torch.Tensor  # the micro-batch's share of the batch loss
    ratio: torch.Tensor  # per token, detached
    clipped: torch.Tensor  # per token: the clip bound acted
    kl: torch.Tensor | None  # per token k3 KL to the reference, detached (kl_beta > 0)


def micro_batch_loss(log_probs: torch.Tensor, anchor: MicroBatchAnchor, advantages: list[float],
                     weights: list[float], mask: torch.Tensor, config: LossConfig) -> MicroBatchLoss:
    """The micro-batch's episodes' surrogate loss (x its token scales, + beta x KL), each token weighted by
    its episode's loss weight."""
    per_token_advantage = torch.tensor(advantages, device=mask.device)[:, None]
    per_token_weight = torch.tensor(weights, device=mask.device)[:, None] * mask
    token_losses, ratio, clipped = surrogate_token_losses(log_probs, anchor.old_log_probs, per_token_advantage,
                                                          config, mask=mask)
    if anchor.loss_scale is not None:
        token_losses = token_losses * anchor.loss_scale
    kl = None
    if config.kl_beta:
        kl = k3_kl(log_probs, anchor.reference_log_probs)
        token_losses = token_losses + config.kl_beta * kl
        kl = kl.detach()
    return MicroBatchLoss((token_losses * per_token_weight).sum(), ratio.detach(), clipped, kl)


# What UpdateStats sums over micro-batches on the device, and then what it sums over ranks.
TOKEN_SUMS = ("loss", "tokens", "entropy", "clipped", "ratio_sum")
UPDATE_SUMS = (*TOKEN_SUMS, "advantage_abs_sum", "episodes", "kl_sum", "sampler_diff_sum", "sampler_diff_tokens")


class UpdateStats:
    """A step's statistics, summed on the device over micro-batches and read once, by `metrics`: a host read
    per micro-batch would stall the device queue. float64, so sums of float32 values equal Python's float sums.

    sampler_logprob_diff_mean and _max: how far the trainer's first-epoch log-probs are from the sampler's,
    when the episodes carry them.
    """

    def __init__(self, device, config: LossConfig):
        self.device, self.config = device, config
        self.token_sums = torch.zeros(len(TOKEN_SUMS), dtype=torch.float64, device=device)
        self.ratio_max = torch.zeros((), device=device)
        self.kl_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.sampler_diff_sum = torch.zeros((), dtype=torch.float64, device=device)  # |trainer - sampler log p|
        self.sampler_diff_max = torch.zeros((), device=device)
        self.sampler_diff_tokens = 0
        self.num_tokens = 0  # generated tokens scored, every epoch (the progress bar's speed)
        self.grad_norm = 0.0
        self.start = time.perf_counter()

    def add_sampler_diff(self, batch: list[Episode], log_probs: torch.Tensor, sampler_log_probs: torch.Tensor | None,
                         mask: torch.Tensor) -> None:
        if sampler_log_probs is None:
            return
        diff = (log_probs.detach() - sampler_log_probs).abs() * mask
        self.sampler_diff_sum += diff.sum().double()
        self.sampler_diff_max = torch.maximum(self.sampler_diff_max, diff.max())
        self.sampler_diff_tokens += sum(episode.num_generated_tokens for episode in batch)

    def add(self, result: MicroBatchLoss, batch: list[Episode], entropy: torch.Tensor, mask: torch.Tensor) -> None:
        self.token_sums += torch.stack([
            result.loss.detach().double() / self.config.epochs_per_rollout, mask.sum().double(),
            (entropy * mask).sum().double(), (result.clipped & mask).sum().double(),
            (result.ratio * mask).sum().double()])
        self.ratio_max = torch.maximum(self.ratio_max, (result.ratio * mask).max())
        if result.kl is not None:
            self.kl_sum += (result.kl * mask).sum().double()
        self.num_tokens += sum(episode.num_generated_tokens for episode in batch)

    def tokens_per_second(self) -> float:
        return self.num_tokens / (time.perf_counter() - self.start)

    def metrics(self, episode_sums: dict[str, float]) -> dict[str, float]:
        """Means over the whole batch, every rank's sums added up (and, for the maxima, the largest)."""
        totals = dict(zip(TOKEN_SUMS, self.token_sums.tolist())) | episode_sums
        # Always the same keys, so ranks sum them alike (kl_sum: with KL only); tokens 0 leaves the diff out.
        if self.config.kl_beta:
            totals["kl_sum"] = self.kl_sum.item()
        totals |= {"sampler_diff_sum": self.sampler_diff_sum.item(),
                   "sampler_diff_tokens": float(self.sampler_diff_tokens)}
        seconds = time.perf_counter() - self.start
        totals = distributed.global_sums({key: totals[key] for key in UPDATE_SUMS if key in totals})
        ratio_max, sampler_diff_max = (distributed.global_max(value.item())
                                       for value in (self.ratio_max, self.sampler_diff_max))
        tokens = max(totals["tokens"], 1)
        sampler = {}
        if totals["sampler_diff_tokens"]:
            sampler = {"sampler_logprob_diff_mean": totals["sampler_diff_sum"] / totals["sampler_diff_tokens"],
                       "sampler_logprob_diff_max": sampler_diff_max}
        return {
            **({"kl": totals["kl_sum"] / tokens} if "kl_sum" in totals else {}),
            **sampler,
            "loss": totals["loss"],
            "grad_norm": self.grad_norm,
            "entropy": totals["entropy"] / tokens,
            "clip_fraction": totals["clipped"] / tokens,
            "ratio_mean": totals["ratio_sum"] / tokens,
            "ratio_max": ratio_max,
            "advantage_abs_mean": totals["advantage_abs_sum"] / max(totals["episodes"], 1),
            "update_seconds": seconds,
            "update_tokens_per_second": totals["tokens"] / seconds,
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


def shape_rewards(episodes: list[Episode], max_gen_len: int, config: LossConfig) -> list[Episode]:
    """The rewards the update sees: the task's, with its format reward weighted by config.format_reward_weight,
    its share of exact tries (CountDown's try_reward, or distinct_try_reward) by config.try_reward_weight added,
    and DAPO's overlong penalty taken off (kept in reward_info). The inputs are left as they are."""
    shaped = []
    for episode in episodes:
        format_discount = (1 - config.format_reward_weight) * episode.reward_info["format_reward"]
        try_share = episode.reward_info.get("distinct_try_reward" if config.try_reward_distinct else "try_reward", 0.0)
        try_bonus = config.try_reward_weight * try_share
        penalty = overlong_penalty(episode.num_generated_tokens, max_gen_len, config)
        info = dict(episode.reward_info)
        if config.overlong_buffer_fraction:
            info["overlong_penalty"] = penalty
        reward = episode.reward - format_discount + try_bonus - penalty
        shaped.append(dataclasses.replace(episode, reward=reward, reward_info=info))
    return shaped


def sample_step(model, sample_round: Callable[[int], list[Episode]],
                config: RolloutConfig) -> tuple[list[Episode], list[Episode], dict[str, float]]:
    """This rank's episodes of a step: (every sampled one, the ones to train on, sampling metrics).

    `sample_round(r)` samples and scores round r's questions (this rank's share); one round, or with
    rollout.dynamic_sampling as many as it takes to find a step's number of groups whose rewards differ.
    """
    num_questions = config.questions_per_step // distributed.world_size()
    start = time.perf_counter()
    model.eval()
    with distributed.full_parameters(model):
        if config.dynamic_sampling:
            kept, episodes, rounds = sample_informative_groups(sample_round, num_questions,
                                                               config.dynamic_sampling_max_rounds)
        else:
            kept = episodes = sample_round(0)
    metrics = {"time/rollout_seconds": time.perf_counter() - start}
    if config.dynamic_sampling:
        metrics |= {"train/dynamic_sampling_rounds": distributed.global_max(rounds),
                    "train/questions_sampled": distributed.global_sum(len(episodes)) / config.num_answers_per_question}
    return episodes, kept, metrics


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
