"""Per-token log-probabilities and entropies without materialising [batch, seq, vocab] logits.

With Qwen's 151,936-token vocabulary the fp32 logits of one 2 x 1280 micro-batch take 1.5 GB, and
autograd would keep several tensors that size. Here the vocabulary projection runs chunk by chunk
under activation checkpointing: forward keeps only [batch, chunk] results, and backward recomputes
one chunk's logits at a time. The model runs this in its forward when given `targets`.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def chunk_log_probs(hidden: torch.Tensor, targets: torch.Tensor, lm_head_weight: torch.Tensor):
    """(log p(target) [batch, chunk], entropy [batch, chunk]) for hidden [batch, chunk, hidden_size]."""
    # One expression so the model-dtype logits are freed as soon as their fp32 log-softmax exists.
    log_probs = F.linear(hidden, lm_head_weight).float().log_softmax(dim=-1)
    target_log_probs = log_probs.gather(-1, targets[..., None]).squeeze(-1)
    with torch.no_grad():
        # -sum p log p as a batched dot product, avoiding a second vocabulary-sized temporary.
        entropy = -(log_probs.exp()[..., None, :] @ log_probs[..., :, None]).squeeze(-1).squeeze(-1)
    return target_log_probs, entropy


def chunked_token_log_probs(hidden: torch.Tensor, targets: torch.Tensor, lm_head_weight: torch.Tensor,
                            chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(targets), entropy), both [batch, seq], from final hidden states [batch, seq, hidden_size]."""
    pieces = [
        checkpoint(
            chunk_log_probs,
            hidden[:, start : start + chunk_size],
            targets[:, start : start + chunk_size],
            lm_head_weight,
            use_reentrant=False,
        )
        for start in range(0, targets.shape[1], chunk_size)
    ]
    log_probs, entropy = zip(*pieces)
    return torch.cat(log_probs, dim=1), torch.cat(entropy, dim=1)


def token_log_probs(model, tokens: torch.Tensor, chunk_size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, T] -> (log_probs [B, T-1], entropy [B, T-1]), float32.

    log_probs[:, t] = log p(tokens[:, t+1] | tokens[:, :t+1]) and is differentiable w.r.t. the model.
    entropy is the next-token distribution's entropy at the same positions; it is detached (a metric).
    `model` may be wrapped (DDP, FSDP): only its forward is called.
    """
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be [batch, seq] with seq >= 2 to score any next token; got {tuple(tokens.shape)}.")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1 (positions per vocabulary projection).")
    # The last position predicts nothing inside the sequence, so it is never run.
    return model(tokens[:, :-1], targets=tokens[:, 1:], logprob_chunk_size=chunk_size)


class AnswerBatch(NamedTuple):
    """Prompt + answer sequences laid out so that only answer tokens are scored and a prompt shared by
    every sequence (a group's G answers, or the fixed start of a chat template) is run once."""

    prefix: torch.Tensor | None  # [1, L]: the tokens every sequence starts with (None: nothing shared)
    tokens: torch.Tensor  # [B, S]: each sequence after the prefix, right-padded
    targets: torch.Tensor  # [B, A]: the answer tokens, right-padded
    positions: torch.Tensor  # [B, A]: where in `tokens` each answer token is predicted
    mask: torch.Tensor  # [B, A]: True at real answer tokens


def shared_prefix_length(sequences: list[list[int]], limit: int) -> int:
    """How many leading tokens (at most `limit`) all sequences have in common."""
    first = sequences[0]
    for index in range(limit):
        if any(sequence[index] != first[index] for sequence in sequences):
            return index
    return limit


def answer_batch(sequences: list[list[int]], answer_starts: list[int], pad_token_id: int, device) -> AnswerBatch:
    """The AnswerBatch of sequences whose answers begin at answer_starts (every start >= 1)."""
    # The last prompt token stays out of the prefix: its hidden state predicts the first answer token.
    shared = shared_prefix_length(sequences, min(answer_starts) - 1)
    answer_lengths = [len(sequence) - start for sequence, start in zip(sequences, answer_starts)]
    tokens = torch.full((len(sequences), max(len(sequence) for sequence in sequences) - shared), pad_token_id)
    targets = torch.full((len(sequences), max(1, *answer_lengths)), pad_token_id)
    positions = torch.zeros_like(targets)
    for row, (sequence, start, length) in enumerate(zip(sequences, answer_starts, answer_lengths)):
        tokens[row, : len(sequence) - shared] = torch.tensor(sequence[shared:])
        targets[row, :length] = torch.tensor(sequence[start:])
        positions[row, :length] = torch.arange(start - 1 - shared, start - 1 - shared + length)
    mask = torch.arange(targets.shape[1])[None, :] < torch.tensor(answer_lengths)[:, None]
    prefix = torch.tensor([sequences[0][:shared]], device=device) if shared else None
    return AnswerBatch(prefix, tokens.to(device), targets.to(device), positions.to(device), mask.to(device))


def answer_log_probs(model, batch: AnswerBatch, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(answer token), entropy), both [B, A] float32, aligned with batch.targets; log-probs are
    differentiable w.r.t. the model. The same values as token_log_probs over the whole sequences."""
    return model(batch.tokens, prefix=batch.prefix, targets=batch.targets, target_positions=batch.positions,
                 logprob_chunk_size=chunk_size)
