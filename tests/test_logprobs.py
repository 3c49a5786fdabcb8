"""Chunked, checkpointed log-probs against the plain full-logits computation."""

import pytest
import torch

from logprobs import answer_batch, answer_log_probs, token_log_probs
from qwen2_model import Transformer


def full_logits_log_probs(model, tokens):
    log_probs = model(tokens)[:, :-1].float().log_softmax(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, tokens[:, 1:, None]).squeeze(-1), entropy


def loss_and_gradients(model, compute, tokens, weights):
    model.zero_grad()
    log_probs, entropy = compute(model, tokens)
    (log_probs * weights).sum().backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    return log_probs.detach(), entropy.detach(), grads


# 13 tokens score 12 positions: chunks that divide 12, that leave a remainder, one, and one wider than all.
@pytest.mark.parametrize("chunk_size", [4, 5, 1, 512])
def test_values_and_gradients_match_full_logits(tiny_model_dir, chunk_size):
    model = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (3, 13), generator=generator)
    weights = torch.randn(3, 12, generator=generator)  # a token-level loss with mixed-sign advantages
    chunked = lambda m, t: token_log_probs(m, t, chunk_size=chunk_size)
    log_probs, entropy, grads = loss_and_gradients(model, chunked, tokens, weights)
    expected_log_probs, expected_entropy, expected_grads = loss_and_gradients(model, full_logits_log_probs, tokens, weights)
    assert log_probs.dtype == entropy.dtype == torch.float32 and log_probs.shape == (3, 12)
    assert torch.allclose(log_probs, expected_log_probs, atol=1e-5)
    assert torch.allclose(entropy, expected_entropy, atol=1e-5)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, expected_grads[name], atol=1e-5, rtol=1e-4), name
    assert expected_grads["embed_tokens.weight"].abs().max() > 0  # the tied head gets gradient


def test_log_probs_are_normalised_over_the_vocabulary(tiny_model_dir):
    """Scoring every possible next token at one position must give probabilities summing to one."""
    model = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    vocab_size = model.config.vocab_size
    tokens = torch.stack([torch.tensor([7, 3, 9, next_token]) for next_token in range(vocab_size)])
    with torch.no_grad():
        log_probs, _ = token_log_probs(model, tokens, chunk_size=2)
    assert abs(log_probs[:, -1].exp().sum().item() - 1) < 1e-4


def saved_vocabulary_sized_tensors(model, compute, tokens) -> list[tuple[int, ...]]:
    """Shapes of tensors autograd keeps for backward whose last dimension is the vocabulary."""
    shapes = []

    def pack(tensor):
        if tensor.shape[-1:] == (model.config.vocab_size,):
            shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        compute(model, tokens)
    return shapes


def test_backward_keeps_no_logits(tiny_model_dir):
    model = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
    tokens = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    chunked = lambda m, t: token_log_probs(m, t, chunk_size=8)
    assert saved_vocabulary_sized_tensors(model, chunked, tokens) == []
    # The hook does see logits when they are kept: the full computation saves [2, 19, vocab] ones.
    assert (2, 19, model.config.vocab_size) in saved_vocabulary_sized_tensors(model, full_logits_log_probs, tokens)


def test_entropy_is_detached(tiny_model_dir):
    model = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32)
    log_probs, entropy = token_log_probs(model, torch.tensor([[1, 2, 3]]))
    assert log_probs.requires_grad and not entropy.requires_grad


def test_without_entropy_the_log_probs_and_gradients_are_the_same(tiny_model_dir):
    model = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
    tokens = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    weights = torch.randn(2, 8, generator=torch.Generator().manual_seed(3))
    without = lambda m, t: (m(t[:, :-1], targets=t[:, 1:], logprob_chunk_size=3, with_entropy=False)[0], torch.zeros(()))
    log_probs, _, grads = loss_and_gradients(model, without, tokens, weights)
    expected_log_probs, _, expected_grads = loss_and_gradients(model, full_logits_log_probs, tokens, weights)
    assert model(tokens[:, :-1], targets=tokens[:, 1:], with_entropy=False)[1] is None
    assert torch.allclose(log_probs, expected_log_probs, atol=1e-5)
    for name, grad in grads.items():
        assert torch.allclose(grad, expected_grads[name], atol=1e-5, rtol=1e-4), name


def test_bfloat16_gradients_match_autograd_through_log_softmax(tiny_model_dir):
    """The hand-written backward in bfloat16 (its gradient reaches the weights in the model's dtype) agrees
    with autograd through the same bfloat16 projection and a float32 log_softmax."""
    model = Transformer.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).train()
    tokens = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(4))
    weights = torch.randn(2, 10, generator=torch.Generator().manual_seed(5))
    chunked = lambda m, t: token_log_probs(m, t, chunk_size=4)
    log_probs, _, grads = loss_and_gradients(model, chunked, tokens, weights)
    expected_log_probs, _, expected_grads = loss_and_gradients(model, full_logits_log_probs, tokens, weights)
    assert torch.allclose(log_probs, expected_log_probs, atol=1e-3)
    for name, grad in grads.items():
        scale = expected_grads[name].float().abs().max().item() + 1e-6
        assert (grad.float() - expected_grads[name].float()).abs().max().item() <= 0.02 * scale, name


@pytest.mark.parametrize("tokens, chunk_size, message", [([[5]], 4, "seq >= 2"), ([[5, 6]], 0, "chunk_size=0")])
def test_bad_arguments_are_explained(tiny_model_dir, tokens, chunk_size, message):
    model = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        token_log_probs(model, torch.tensor(tokens), chunk_size)


def answer_positions_reference(model, sequences, answer_starts):
    """Log-probs of each answer token from a plain full-logits forward over each whole sequence, alone."""
    rows = []
    for sequence, start in zip(sequences, answer_starts):
        log_probs, _ = full_logits_log_probs(model, torch.tensor([sequence]))
        rows.append(log_probs[0, start - 1 :])
    return rows


# A group sharing its whole prompt; prompts sharing a template start; nothing shared (the first tokens
# differ); a prompt of one token (nothing can be shared: its hidden state predicts the answer).
SEQUENCE_SETS = {
    "one group": ([[5, 6, 7, 8, 1, 2], [5, 6, 7, 8, 3], [5, 6, 7, 8, 4, 4, 4]], [4, 4, 4]),
    "shared template start": ([[5, 6, 7, 9, 1, 2], [5, 6, 3, 3, 8, 3, 1], [5, 6, 7, 8, 4]], [4, 5, 4]),
    "nothing shared": ([[1, 6, 7, 1, 2], [2, 6, 7, 3]], [3, 3]),
    "one-token prompt": ([[5, 9, 9], [5, 6, 7, 8, 1]], [1, 4]),
    # Two groups whose prompts differ in length: one prefix each, the shorter padded.
    "two groups": ([[5, 6, 7, 8, 9, 1, 2], [5, 6, 7, 8, 9, 3], [5, 6, 7, 8, 9, 4, 4, 4],
                    [2, 6, 3, 4], [2, 6, 3, 1, 1, 1], [2, 6, 3, 5, 2]], [5, 5, 5, 3, 3, 3]),
    # A group of one-token prompts beside a group with a long one.
    "groups with an empty prefix": ([[5, 1, 2], [5, 3], [4, 6, 7, 8, 9, 1], [4, 6, 7, 8, 9, 2, 2],
                                     [4, 6, 7, 8, 9, 3]], [1, 1, 5, 5, 5]),
}


@pytest.mark.parametrize("name,checkpointing", [(name, False) for name in SEQUENCE_SETS] + [("two groups", True)])
def test_answer_log_probs_match_whole_sequence_forwards(tiny_model_dir, name, checkpointing):
    """Each prefix runs once and only answer tokens are scored, yet values and gradients are
    those of a forward over each sequence alone (with gradient checkpointing too)."""
    sequences, answer_starts = SEQUENCE_SETS[name]
    model = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
    model.gradient_checkpointing = checkpointing
    batch = answer_batch(sequences, answer_starts, pad_token_id=0, device="cpu")
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(1)) * batch.mask

    model.zero_grad()
    log_probs, entropy = answer_log_probs(model, batch, chunk_size=2)
    (log_probs * weights).sum().backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}

    model.zero_grad()
    expected = answer_positions_reference(model, sequences, answer_starts)
    sum((row * weights[index, : len(row)]).sum() for index, row in enumerate(expected)).backward()
    for index, row in enumerate(expected):
        assert batch.mask[index].sum() == len(row)
        assert torch.allclose(log_probs[index, : len(row)], row.detach(), atol=1e-5)
    for name_, param in model.named_parameters():
        assert torch.allclose(grads[name_], param.grad, atol=1e-5, rtol=1e-4), name_
    assert entropy.shape == log_probs.shape


def test_answer_batch_runs_each_prompt_once():
    batch = answer_batch(*SEQUENCE_SETS["one group"], pad_token_id=0, device="cpu")
    assert batch.prefixes.tolist() == [[5, 6, 7]]  # the last prompt token stays with the rows
    assert batch.tokens.shape == (3, 4) and batch.targets.tolist() == [[1, 2, 0], [3, 0, 0], [4, 4, 4]]
    assert answer_batch(*SEQUENCE_SETS["nothing shared"], pad_token_id=0, device="cpu").prefixes is None

    batch = answer_batch(*SEQUENCE_SETS["two groups"], pad_token_id=0, device="cpu")
    assert batch.prefixes.tolist() == [[5, 6, 7, 8], [2, 6, 0, 0]]
    assert batch.prefix_lengths.tolist() == [4, 2] and batch.prefix_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert batch.tokens[3].tolist() == [3, 4, 0, 0] and batch.positions[3].tolist() == [0, 0, 0]
    assert batch.mask[3].tolist() == [True, False, False]


def test_answer_batch_shares_the_template_start_when_every_prompt_differs():
    """Distinct prompts (SFT's) gain nothing from a prefix each; the start they all share runs once."""
    sequences = [[5, 6, 7, 9, 1], [5, 6, 8, 9, 2], [5, 6, 3, 9, 3, 3]]
    batch = answer_batch(sequences, [4, 4, 4], pad_token_id=0, device="cpu")
    # One prefix per prompt would run 3 x 3 + 3 x 3 positions; the shared start 2 + 3 x 4.
    assert batch.prefixes.tolist() == [[5, 6]] and batch.prefix_index.tolist() == [0, 0, 0]
    assert batch.tokens.tolist() == [[7, 9, 1, 0], [8, 9, 2, 0], [3, 9, 3, 3]]


def test_gradients_through_a_shared_prefix_are_the_same_every_run(tiny_model_dir):
    """Two threads sum the rows' gradients into the prefix they share in the same order every time: the same batch
    gives bit-identical gradients, so a seed's run is the same run (SFT stops at the same step). Indexing's backward
    (index_put_ with accumulate) added them in parallel in no fixed order: the demo's SFT weights differed after
    its first step from one run to the next."""
    model = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
    generator = torch.Generator().manual_seed(0)
    random_tokens = lambda length: torch.randint(0, model.config.vocab_size, (length,), generator=generator).tolist()
    template = random_tokens(60)  # SFT's prompts: one template, then each its own question
    prompts = [template + random_tokens(5) for _ in range(32)]
    batch = answer_batch([prompt + random_tokens(30) for prompt in prompts], [len(prompt) for prompt in prompts], 0,
                         torch.device("cpu"))
    assert batch.prefixes.shape[0] == 1  # every row continues the template's prefix
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = []
        for _ in range(6):
            model.zero_grad()
            log_probs, _ = answer_log_probs(model, batch, 16, with_entropy=False)
            (log_probs * batch.mask).sum().backward()
            runs.append({name: param.grad.clone() for name, param in model.named_parameters()})
    finally:
        torch.set_num_threads(threads)
    for run in runs[1:]:
        assert all(torch.equal(run[name], runs[0][name]) for name in run), [
            name for name in run if not torch.equal(run[name], runs[0][name])]
