"""Batched sampling of many answers per prompt with a KV cache.

The engine prefills each prompt once (all prompts right-padded in one pass, every row at its own
positions) and copies that prompt's cache to its samples. Decoding then runs one token per step for
all active rows; sampled tokens stay on the device, and only every FINISHED_CHECK_INTERVAL steps
does the host look at which rows are done, to stop early and drop finished rows from the batch.
"""

import contextlib
import functools
import math
from dataclasses import dataclass, field

import torch

from logprobs import shared_prefix_length
from qwen2_model import KVCache, Linear, Transformer
from run_logging import progress_bar

# Reading the finished flags forces a host-device sync; doing it every few steps keeps the device
# queue full at the cost of a few wasted tokens for rows that finished in between.
FINISHED_CHECK_INTERVAL = 8
# A compiled step is specialised to the cache length; rounding it up lets batches whose longest
# prompts differ share one compiled graph (and, freed and reallocated, usually the same addresses).
COMPILED_CACHE_LENGTH_MULTIPLE = 256
# On a CPU, oneDNN multiplies by a weight it has laid out for itself once ("packed") faster than nn.Linear
# does at decoding's few rows (docs/performance.md section 2). Below ~2^18 weights (the tiny test models'
# layers) the packed call's fixed cost is more than it saves.
PACKED_MIN_WEIGHTS = 1 << 18
# Vocabulary slots per block of the two-level CDF inversion (invert_cdf): 48 blocks of SmolLM2's vocabulary,
# 1187 of 128 in Qwen's (its largest power-of-two divisor).
CDF_BLOCK = 1024


@dataclass
class Completion:
    token_ids: list[int]  # generated ids, including the eos id when finished
    finished: bool  # stopped on eos (False: hit its length limit)
    # The sampler's measurements of each generated token (see sample_and_score); not part of what was sampled,
    # so two completions with the same tokens are equal even where these differ in their last bits.
    log_probs: list[float] = field(default_factory=list, compare=False)
    entropies: list[float] = field(default_factory=list, compare=False)


def invert_cdf(probs: torch.Tensor, top_p: float, uniforms: torch.Tensor) -> torch.Tensor:
    """The token [rows] whose (nucleus-truncated) CDF step holds each row's uniform.

    Inverting the CDF at one uniform per row is a fixed-shape computation whose randomness comes from
    outside, so a compiled CUDA graph can replay it. The CDF is found in two levels: the sums of blocks of
    CDF_BLOCK slots locate each row's block, then a cumulative sum over that block alone finds the slot. That
    reads `probs` once, where a cumulative sum over the whole vocabulary reads it and writes it again.
    """
    order = None
    if top_p < 1:
        probs, order = probs.sort(dim=-1, descending=True)
        # Keep a token while the mass ranked above it is below top_p: the smallest set reaching top_p.
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p, 0.0)
    rows, vocab = probs.shape
    block = math.gcd(vocab, CDF_BLOCK)  # a power of two that divides the vocabulary (1: one level)
    blocks = probs.reshape(rows, vocab // block, block)
    block_cdf = blocks.sum(dim=-1).cumsum_(dim=-1)
    block_index, threshold = rising_step(block_cdf, uniforms[:, None] * block_cdf[:, -1:])
    mass_before = torch.where(block_index > 0, block_cdf.gather(-1, (block_index - 1).clamp(min=0)), 0.0)
    block_cdf_inside = blocks.gather(1, block_index[:, :, None].expand(-1, -1, block)).squeeze(1).cumsum_(dim=-1)
    slot, _ = rising_step(block_cdf_inside, threshold - mass_before)
    index = block_index * block + slot
    return (index if order is None else order.gather(-1, index)).squeeze(-1)


def rising_step(cdf: torch.Tensor, threshold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [rows, 1] of the first entry of `cdf` [rows, n] above `threshold` [rows, 1], the threshold used).

    The threshold is held strictly below the CDF's total, so the step found is one where the CDF rises: a slot
    of nonzero mass, whatever the rounding of the uniform times the total.
    """
    total = cdf[:, -1:]
    threshold = torch.minimum(threshold, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, threshold, right=True), threshold


def sample_and_score(logits: torch.Tensor, temperature: float, top_p: float, uniforms: torch.Tensor | None):
    """(next token ids, their log-probs, entropies), each [rows]: tokens drawn by `invert_cdf` at the rows'
    uniforms (temperature 0: the argmax), and log p and entropy in float32 under softmax(logits / temperature)
    (greedy: temperature 1) before top_p's truncation.

    At temperature 1 that is the policy as the trainer scores it (logprobs.answer_log_probs), so the update can
    measure how far its own log-probs are from the sampler's (grpo.update_policy). Two float32 [rows, vocab]
    tensors at most (log-probs, and the probabilities): at 256 rows of Qwen's 151,936-token vocabulary each is
    156 MB (bench/memory_plan.py).
    """
    # One kernel normalises: no max, exp-sum and subtraction passes of their own (and no division at temperature 1).
    scaled = logits if temperature in (0, 1) else logits.float() / temperature
    log_probs = torch.log_softmax(scaled, dim=-1, dtype=torch.float32)
    probs = log_probs.exp()
    entropy = -torch.bmm(probs[:, None, :], log_probs[:, :, None]).view(-1)  # -sum p log p, without p log p
    tokens = log_probs.argmax(dim=-1) if temperature == 0 else invert_cdf(probs, top_p, uniforms)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1), entropy


def decode_step(
    model: Transformer,
    kv_cache: KVCache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    *,
    uniforms: torch.Tensor | None,
    temperature: float,
    top_p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Feed one token per row at its position and sample the next: fixed shapes for a given batch.

    Returns `sample_and_score`'s (tokens, log-probs, entropies).
    """
    hidden = model.hidden_states(tokens[:, None], positions[:, None], kv_cache)[:, -1]
    return sample_and_score(model.lm_head(hidden), temperature, top_p, uniforms)


def layers_to_pack(model: Transformer) -> list[Linear]:
    """The linear layers `packed_weights` lays out for oneDNN: on a CPU, every large one in bfloat16; in float32 only
    the vocabulary projection, since a packed float32 copy of every layer adds 4 bytes a weight to the rollout's
    peak memory (bf16 has oneDNN's kernels only where the CPU has bf16 instructions)."""
    weight = model.lm_head.weight
    # Sharded (FSDP) weights are not plain tensors and are gathered only inside forward: nothing to pack.
    if weight.device.type != "cpu" or type(weight.data) is not torch.Tensor or not torch.backends.mkldnn.is_available():
        return []
    if weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        layers = [module for module in model.modules() if isinstance(module, Linear)]
    elif weight.dtype == torch.float32:
        layers = [model.lm_head]
    else:
        return []
    return [layer for layer in layers if layer.weight.numel() >= PACKED_MIN_WEIGHTS]


@contextlib.contextmanager
def packed_weights(model: Transformer, rows: int):
    """For the block, `layers_to_pack` multiply by copies of their weights laid out for oneDNN for `rows` input rows
    (Linear.packed_weight): packed per generate call, since training changes the weights. The copies cost the
    packed weights' size in memory and a fraction of a second to make."""
    layers = layers_to_pack(model)
    for layer in layers:
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), rows)
    try:
        yield
    finally:
        for layer in layers:
            layer.packed_weight = None


@functools.cache
def compiled_decode_step():
    # dynamic=False: one specialised graph per batch size, which is what CUDA graphs replay.
    return torch.compile(decode_step, mode="reduce-overhead", fullgraph=True, dynamic=False)


def prefill(model: Transformer, prompts: list[list[int]], max_seq_len: int):
    """One right-padded forward over all prompts -> (cache, last-token logits [rows, vocab], lengths [rows]).

    The prompts' common start (a chat template's system prompt, the task's instructions) runs once and is
    copied to every row: at 256 CountDown prompts it is most of the prefill's work.
    """
    device = model.embed_tokens.weight.device
    lengths = torch.tensor([len(prompt) for prompt in prompts], device=device)
    kv_cache = model.new_kv_cache(len(prompts), max_seq_len)
    # Each row keeps at least its last token, whose logits are the first sample's.
    shared = shared_prefix_length(prompts, min(len(prompt) for prompt in prompts) - 1)
    if shared:
        first_row = KVCache([buffer[:1] for buffer in kv_cache.keys], [buffer[:1] for buffer in kv_cache.values])
        # Through the model's forward (not hidden_states), so wrappers' hooks (FSDP's gathers) run.
        model(torch.tensor([prompts[0][:shared]], device=device), torch.arange(shared, device=device)[None], first_row,
              logits_at=torch.tensor([shared - 1], device=device))
        for buffer in kv_cache.keys + kv_cache.values:
            buffer[1:, :shared] = buffer[:1, :shared]
    padded = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(prompt[shared:], device=device) for prompt in prompts], batch_first=True
    )
    positions = torch.arange(shared, shared + padded.shape[1], device=device).expand(len(prompts), -1)
    # Only the last real token's logits are needed: skip the vocabulary projection elsewhere.
    return kv_cache, model(padded, positions, kv_cache, logits_at=lengths - 1 - shared), lengths


def rows_to_keep(finished: torch.Tensor) -> torch.Tensor:
    """The rows not finished, placed to move as few as possible: of the first len(active) places, each that holds
    an active row keeps it, and each that holds a finished one takes an active row from beyond them. Compaction
    (keep_rows_in_place) then copies one row per finished row, where keeping the rows in order copies every row
    after the first finished one."""
    num_active = int((~finished).sum())
    rows = torch.arange(num_active, device=finished.device)
    rows[finished[:num_active].nonzero().squeeze(1)] = (~finished[num_active:]).nonzero().squeeze(1) + num_active
    return rows


def keep_rows_in_place(kv_cache: KVCache, rows: torch.Tensor, filled: int | None = None) -> KVCache:
    """The cache of `rows` (distinct, any order), row i moved to place i of each buffer, one layer at a time.

    Indexing each buffer with `rows` would build the whole new cache before the old one is freed; at 256
    rows of a 3B model that transient second cache is 12 GB. Here the extra memory is one layer's moving rows,
    and only what moves is copied: the rows whose place changes, and only the first `filled` slots (None: all),
    since the slots beyond were never written.
    """
    moved = (rows != torch.arange(len(rows), device=rows.device)).nonzero().squeeze(1)
    sources, slots = rows[moved], slice(None, filled)
    keys, values = (
        [buffer[: len(rows)] for buffer in buffers] for buffers in (kv_cache.keys, kv_cache.values)
    )
    for kept, buffer in zip(keys + values, kv_cache.keys + kv_cache.values):
        kept[moved, slots] = buffer[sources, slots]  # gathered before written: sources and places may overlap
    return KVCache(keys, values)


def check_arguments(prompts, *, num_samples_per_prompt, max_gen_len, temperature, top_p, stop_lengths) -> None:
    if not prompts:
        raise ValueError("prompts is empty; pass at least one tokenized prompt.")
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {index} has no tokens; every prompt needs at least one token to condition on.")
    if num_samples_per_prompt < 1 or max_gen_len < 1:
        raise ValueError(
            f"num_samples_per_prompt={num_samples_per_prompt} and max_gen_len={max_gen_len} must both be >= 1."
        )
    if temperature < 0:
        raise ValueError(f"temperature={temperature} is negative; use 0 for greedy or a positive value to sample.")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]; 1 disables nucleus truncation.")
    if stop_lengths is not None and len(stop_lengths) != len(prompts) * num_samples_per_prompt:
        raise ValueError(
            f"stop_lengths has {len(stop_lengths)} entries; give one per completion "
            f"({len(prompts)} prompts x {num_samples_per_prompt} samples)."
        )


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    *,
    num_samples_per_prompt: int,
    max_gen_len: int,
    eos_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    share_prompt_prefill: bool = True,
    evict_finished: bool = True,
    compile_decode: bool = False,
    progress: bool = False,
    stop_lengths: list[int] | None = None,
    max_rows: int | None = None,
) -> list[Completion]:
    """Sample num_samples_per_prompt completions per prompt, prompt-major (prompt 0's samples first).

    generator: drives all sampling; it must live on the model's device. Row r's token at step t inverts the
    CDF at uniform [r, t] of one [rows, max_gen_len] draw made first, so what a seed gives does not depend on
    how the rows are batched (max_rows, eviction).
    share_prompt_prefill=False, evict_finished=False is the simple reference path: every prompt is
    prefilled once per sample and every row decodes until the last one finishes.
    compile_decode: on CUDA, run each decode step as a captured CUDA graph (see `decode`); ignored
    elsewhere.
    stop_lengths: optional per-completion length limits below max_gen_len (benchmarks plant them
    because random weights never emit eos); a row that hits its limit is not `finished`.
    max_rows: decode at most this many rows at once (whole prompts' groups, at least one prompt's), each
    batch with a cache of its own size: the KV cache's memory bound (bench/memory_plan.py). None: all at once.
    """
    check_arguments(prompts, num_samples_per_prompt=num_samples_per_prompt, max_gen_len=max_gen_len,
                    temperature=temperature, top_p=top_p, stop_lengths=stop_lengths)
    device = model.embed_tokens.weight.device
    num_rows = len(prompts) * num_samples_per_prompt
    uniforms = None if temperature == 0 else torch.rand((num_rows, max_gen_len), generator=generator, device=device)
    limits = torch.full((num_rows,), max_gen_len, device=device)
    if stop_lengths is not None:
        limits = limits.minimum(torch.tensor(stop_lengths, device=device))
    per_batch = max(1, (max_rows or num_rows) // num_samples_per_prompt)  # prompts per batch
    completions = []
    with packed_weights(model, rows=per_batch * num_samples_per_prompt):
        for first in range(0, len(prompts), per_batch):
            rows = slice(first * num_samples_per_prompt, (first + per_batch) * num_samples_per_prompt)
            outputs = generate_rows(model, prompts[first : first + per_batch], num_samples_per_prompt=num_samples_per_prompt,
                                    max_gen_len=max_gen_len, eos_token_id=eos_token_id, temperature=temperature,
                                    top_p=top_p, uniforms=None if uniforms is None else uniforms[rows],
                                    length_limits=limits[rows], share_prompt_prefill=share_prompt_prefill,
                                    evict_finished=evict_finished, compile_decode=compile_decode, progress=progress)
            completions += completions_from_outputs(*(output.tolist() for output in outputs),
                                                    limits=limits[rows].tolist(), eos_token_id=eos_token_id)
    return completions


def generate_rows(model: Transformer, prompts: list[list[int]], *, num_samples_per_prompt: int, max_gen_len: int,
                  eos_token_id: int, temperature: float, top_p: float, uniforms: torch.Tensor | None,
                  length_limits: torch.Tensor, share_prompt_prefill: bool, evict_finished: bool, compile_decode: bool,
                  progress: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch of generate's rows, prefilled and decoded together: `decode`'s outputs."""
    compiled = compile_decode and model.embed_tokens.weight.device.type == "cuda"
    # The last sampled token is never fed back, so it needs no cache slot.
    max_seq_len = max(len(prompt) for prompt in prompts) + max_gen_len - 1
    if compiled:
        max_seq_len = -(-max_seq_len // COMPILED_CACHE_LENGTH_MULTIPLE) * COMPILED_CACHE_LENGTH_MULTIPLE
    kv_cache, logits, positions = prefill_rows(model, prompts, num_samples_per_prompt=num_samples_per_prompt,
                                               max_seq_len=max_seq_len, share_prompt_prefill=share_prompt_prefill)
    return decode(model, kv_cache, logits, positions, length_limits=length_limits, eos_token_id=eos_token_id,
                  temperature=temperature, top_p=top_p, uniforms=uniforms,
                  evict_finished=evict_finished and not compiled, compiled=compiled, progress=progress)


def prefill_rows(model: Transformer, prompts, *, num_samples_per_prompt: int, max_seq_len: int,
                 share_prompt_prefill: bool):
    """Cache, next-token logits and positions for every completion row, prompt-major."""
    if not share_prompt_prefill:
        return prefill(model, [prompt for prompt in prompts for _ in range(num_samples_per_prompt)], max_seq_len)
    # The prompts' own cache only needs their width; each row gets a copy in a full-length buffer.
    prompt_cache, logits, positions = prefill(model, prompts, max(len(prompt) for prompt in prompts))
    rows = torch.arange(len(prompts), device=logits.device).repeat_interleave(num_samples_per_prompt)
    return copy_prompt_cache_to_rows(model, prompt_cache, rows, max_seq_len), logits[rows], positions[rows]


def copy_prompt_cache_to_rows(model: Transformer, prompt_cache: KVCache, rows: torch.Tensor, max_seq_len: int) -> KVCache:
    """A full-length cache whose row i holds prompt rows[i]'s cache."""
    kv_cache = model.new_kv_cache(len(rows), max_seq_len)
    for row_buffer, prompt_buffer in zip(kv_cache.keys + kv_cache.values, prompt_cache.keys + prompt_cache.values):
        row_buffer[:, : prompt_cache.max_seq_len] = prompt_buffer[rows]
    return kv_cache


def decode(
    model: Transformer,
    kv_cache: KVCache,
    logits: torch.Tensor,
    positions: torch.Tensor,
    *,
    length_limits: torch.Tensor,
    eos_token_id: int,
    temperature: float,
    top_p: float,
    uniforms: torch.Tensor | None,
    evict_finished: bool,
    compiled: bool,
    progress: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Generated ids [rows, max(length_limits)], each row valid up to its eos or its length limit, and
    each token's log-prob and entropy from `sample_and_score` (same shape, float32). Row r's token at step t
    inverts the CDF at uniforms[r, t] (None: greedy).

    compiled: run each step as a captured CUDA graph. Finished rows then stay in the batch: every
    new batch size would need its own compile and capture, which costs far more than decoding a few
    finished rows inside an already captured graph.
    """
    device, num_rows, max_gen_len = logits.device, len(logits), int(length_limits.max())
    step_fn = compiled_decode_step() if compiled else decode_step
    if compiled:
        for tensor in kv_cache.keys + kv_cache.values:
            # The cache is written in place every step; a static address lets the graph do that directly
            # (unguarded: a new cache's address re-records the graph instead of recompiling the step).
            torch._dynamo.mark_static_address(tensor, guard=False)
    # Reading the finished flags is free on a CPU, so finished rows leave the batch at once there.
    evict_every_step = evict_finished and device.type == "cpu"
    outputs = torch.full((num_rows, max_gen_len), eos_token_id, device=device)
    log_probs, entropies = (torch.zeros((num_rows, max_gen_len), device=device) for _ in range(2))
    # State of the active rows; eviction shrinks these together with the cache.
    row_ids, limits = torch.arange(num_rows, device=device), length_limits
    finished = torch.zeros(num_rows, dtype=torch.bool, device=device)
    # Slots written so far (all rows), tracked on the host: compaction copies only these.
    filled = int(positions.max())
    # Each step's tokens and their statistics are written at row_ids, the rows' original places, so a row's
    # log-probs stay aligned with its tokens however the batch shrinks.
    next_tokens, next_log_probs, next_entropies = sample_and_score(
        logits, temperature, top_p, None if uniforms is None else uniforms[:, 0])
    bar = progress_bar(desc="generate", total=max_gen_len, unit="token", enabled=progress, leave=False)
    for step in range(max_gen_len):
        outputs[row_ids, step] = next_tokens
        log_probs[row_ids, step], entropies[row_ids, step] = next_log_probs, next_entropies
        finished |= (next_tokens == eos_token_id) | (limits <= step + 1)
        if step + 1 == max_gen_len:
            break
        check = (step + 1) % FINISHED_CHECK_INTERVAL == 0
        if check:
            bar.update(FINISHED_CHECK_INTERVAL)
            if finished.all():
                break
        if (check and evict_finished or evict_every_step) and finished.any():
            active = rows_to_keep(finished)
            kv_cache = keep_rows_in_place(kv_cache, active, filled)
            next_tokens, next_log_probs, next_entropies, positions, row_ids, limits = (
                t[active] for t in (next_tokens, next_log_probs, next_entropies, positions, row_ids, limits))
            finished = finished[active]
        if len(row_ids) == 0:
            continue  # all finished between checks
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        # Eager steps attend over the written slots only (views, no copy): early in a long generation
        # most of the buffer is empty. A captured graph needs the whole, fixed-shape buffer.
        step_cache = kv_cache if compiled else kv_cache.first_slots(filled + 1)
        step_uniforms = None if uniforms is None else uniforms[row_ids, step + 1]
        next_tokens, next_log_probs, next_entropies = step_fn(model, step_cache, next_tokens, positions,
                                                              uniforms=step_uniforms, temperature=temperature,
                                                              top_p=top_p)
        if compiled:  # the graph's output buffers are overwritten by its next replay
            next_tokens, next_log_probs, next_entropies = (t.clone() for t in (next_tokens, next_log_probs, next_entropies))
        positions, filled = positions + 1, filled + 1
    bar.close()
    return outputs, log_probs, entropies


def completions_from_outputs(outputs: list[list[int]], log_probs: list[list[float]], entropies: list[list[float]], *,
                             limits: list[int], eos_token_id: int) -> list[Completion]:
    """Cut each row at its first eos (kept) or its length limit; rows may hold stale tokens beyond."""
    completions = []
    for tokens, row_log_probs, row_entropies, limit in zip(outputs, log_probs, entropies, limits):
        tokens = tokens[:limit]
        finished = eos_token_id in tokens
        length = tokens.index(eos_token_id) + 1 if finished else len(tokens)
        completions.append(Completion(tokens[:length], finished, row_log_probs[:length], row_entropies[:length]))
    return completions
