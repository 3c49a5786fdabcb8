"""Per-token log-probabilities and entropies without materialising [batch, seq, vocab] logits.

With Qwen's 151,936-token vocabulary the fp32 logits of one 2 x 1280 micro-batch take 1.5 GB, and
autograd would keep several tensors that size. Here the vocabulary projection runs chunk by chunk
under activation checkpointing: forward keeps only [batch, chunk] results, and backward recomputes
one chunk's logits at a time. The model runs this in its forward when given `targets`.
"""

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


def pad_sequences(sequences: list[list[int]], scored_from: list[int], pad_token_id: int, device):
    """Right-padded tokens [B, T] and a mask [B, T-1] of the positions whose next token is scored:
    those predicting sequence[scored_from:] (a response after its prompt), as token_log_probs aligns them."""
    length = max(len(sequence) for sequence in sequences)
    tokens = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length - 1), dtype=torch.bool)
    for row, (sequence, start) in enumerate(zip(sequences, scored_from)):
        tokens[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, start - 1 : len(sequence) - 1] = True
    return tokens.to(device), mask.to(device)
