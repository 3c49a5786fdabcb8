"""Per-token log-probabilities and entropies of answers, scored without [batch, seq, vocab] logits.

The model's forward, given `targets`, projects to the vocabulary chunk by chunk (qwen2_model's
ChunkLogProbs: with Qwen's 151,936-token vocabulary the fp32 logits of one 2 x 1280 micro-batch take
1.5 GB). Here: the layout that scores only answer tokens, each prompt run once.
"""

from typing import NamedTuple

import torch


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
    """Prompt + answer sequences laid out so that only answer tokens are scored and each prompt runs once.

    A prompt's tokens, all but the last (whose hidden state predicts the first answer token), form a prefix
    row that the sequences continuing it attend to: a group's G answers share one, and a chat template's fixed
    start is shared by every sequence. `tokens` holds what follows each sequence's prefix.
    """

    prefixes: torch.Tensor | None  # [P, L]: the distinct prefixes, right-padded (None: nothing shared)
    prefix_lengths: torch.Tensor | None  # [P]: each prefix's real length
    prefix_index: torch.Tensor | None  # [B]: the prefix each sequence continues
    tokens: torch.Tensor  # [B, S]: each sequence after its prefix, right-padded
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


def prefix_layout(sequences: list[list[int]], answer_starts: list[int]) -> tuple[list[list[int]], list[int]]:
    """(the distinct prefixes, which one each sequence continues), choosing the layout with fewer positions to
    run: one prefix per distinct prompt (a group's answers share theirs) or the start every sequence shares."""
    prompts = [tuple(sequence[: start - 1]) for sequence, start in zip(sequences, answer_starts)]
    distinct = list(dict.fromkeys(prompts))
    per_prompt = len(distinct) * max(map(len, distinct)) + len(sequences) * max(
        len(sequence) - len(prompt) for sequence, prompt in zip(sequences, prompts))
    shared = shared_prefix_length(sequences, min(answer_starts) - 1)
    common = shared + len(sequences) * (max(map(len, sequences)) - shared)
    if per_prompt < common:
        index = {prompt: number for number, prompt in enumerate(distinct)}
        return [list(prompt) for prompt in distinct], [index[prompt] for prompt in prompts]
    return [sequences[0][:shared]], [0] * len(sequences)


def answer_batch(sequences: list[list[int]], answer_starts: list[int], pad_token_id: int, device) -> AnswerBatch:
    """The AnswerBatch of sequences whose answers begin at answer_starts (every start >= 1)."""
    prefixes, prefix_index = prefix_layout(sequences, answer_starts)
    skipped = [len(prefixes[index]) for index in prefix_index]  # each sequence's tokens run in its prefix
    answer_lengths = [len(sequence) - start for sequence, start in zip(sequences, answer_starts)]
    tokens = torch.full((len(sequences), max(len(s) - k for s, k in zip(sequences, skipped))), pad_token_id)
    targets = torch.full((len(sequences), max(1, *answer_lengths)), pad_token_id)
    positions = torch.zeros_like(targets)
    for row, (sequence, start, length, skip) in enumerate(zip(sequences, answer_starts, answer_lengths, skipped)):
        tokens[row, : len(sequence) - skip] = torch.tensor(sequence[skip:])
        targets[row, :length] = torch.tensor(sequence[start:])
        positions[row, :length] = torch.arange(start - 1 - skip, start - 1 - skip + length)
    mask = torch.arange(targets.shape[1])[None, :] < torch.tensor(answer_lengths)[:, None]
    rows = tokens.to(device), targets.to(device), positions.to(device), mask.to(device)
    prefix_lengths = [len(prefix) for prefix in prefixes]
    if not max(prefix_lengths):
        return AnswerBatch(None, None, None, *rows)
    padded = torch.full((len(prefixes), max(prefix_lengths)), pad_token_id)
    for row, prefix in enumerate(prefixes):
        padded[row, : len(prefix)] = torch.tensor(prefix, dtype=torch.long)
    return AnswerBatch(padded.to(device), torch.tensor(prefix_lengths, device=device),
                       torch.tensor(prefix_index, device=device), *rows)


def answer_log_probs(model, batch: AnswerBatch, chunk_size: int, *,
                     with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(answer token), entropy or None), both [B, A] float32, aligned with batch.targets; log-probs are
    differentiable w.r.t. the model. The same values as token_log_probs over the whole sequences."""
    prefix = None if batch.prefixes is None else (batch.prefixes, batch.prefix_lengths, batch.prefix_index)
    return model(batch.tokens, prefix=prefix, targets=batch.targets, target_positions=batch.positions,
                 logprob_chunk_size=chunk_size, with_entropy=with_entropy)
