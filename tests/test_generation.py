"""The generation engine against a naive decoder (full forward, no cache, one sequence at a time)."""

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import generation
from generation import (Completion, decode_step, generate, invert_cdf, keep_rows_in_place, layers_to_pack, packed_weights,
                        rows_to_keep, sample_and_score)
from qwen2_model import Transformer, init_weights

FLAG_COMBINATIONS = [
    dict(share_prompt_prefill=share, evict_finished=evict) for share, evict in itertools.product((True, False), repeat=2)
]
FLAG_IDS = [f"share={f['share_prompt_prefill']}-evict={f['evict_finished']}" for f in FLAG_COMBINATIONS]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> Transformer:
    # The fixture's std-0.02 weights make greedy decoding repeat the last token forever; larger weights
    # give varied continuations, so a wrong position, cache row or eviction shows up as a wrong token.
    model = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    init_weights(model, seed=1, std=0.2)
    return model


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(1, 500, (length,), generator=generator).tolist() for length in (5, 12, 3, 9)]


@torch.no_grad()
def naive_greedy(model, prompt: list[int], max_gen_len: int, eos_token_id: int) -> Completion:
    sequence = list(prompt)
    for _ in range(max_gen_len):
        sequence.append(model(torch.tensor([sequence]))[0, -1].argmax().item())
        if sequence[-1] == eos_token_id:
            return Completion(sequence[len(prompt) :], finished=True)
    return Completion(sequence[len(prompt) :], finished=False)


@pytest.fixture(scope="module")
def eos_token_id(model, prompts) -> int:
    """A token that greedy decoding emits mid-way for prompt 0, so rows finish at different steps."""
    return naive_greedy(model, prompts[0], 24, eos_token_id=-1).token_ids[10]


@pytest.mark.parametrize("flags", FLAG_COMBINATIONS, ids=FLAG_IDS)
def test_prompts_sharing_their_start_match_the_naive_decoder(model, prompts, eos_token_id, flags):
    """The common start runs once in the prefill and is copied to every row; one prompt is that start
    plus a single token (its last token must stay out of the shared part)."""
    start = [11, 12, 13, 14, 15, 16]
    shared = [start + prompt for prompt in prompts] + [start + [17]]
    expected = [naive_greedy(model, prompt, 16, eos_token_id) for prompt in shared]
    completions = generate(model, shared, num_samples_per_prompt=2, max_gen_len=16, eos_token_id=eos_token_id,
                           temperature=0, **flags)
    assert completions == [c for c in expected for _ in range(2)]


@pytest.mark.parametrize("flags", FLAG_COMBINATIONS, ids=FLAG_IDS)
def test_greedy_matches_naive_decoder(model, prompts, eos_token_id, flags):
    max_gen_len, num_samples = 24, 3
    expected = [naive_greedy(model, prompt, max_gen_len, eos_token_id) for prompt in prompts]
    # The data must exercise both outcomes, and a finish after the first eviction check.
    assert any(c.finished for c in expected) and not all(c.finished for c in expected)
    assert any(c.finished and len(c.token_ids) > 8 for c in expected)
    completions = generate(model, prompts, num_samples_per_prompt=num_samples, max_gen_len=max_gen_len,
                           eos_token_id=eos_token_id, temperature=0, **flags)
    assert completions == [c for c in expected for _ in range(num_samples)]


def test_eos_is_kept_and_nothing_follows_it(model, prompts, eos_token_id):
    completions = generate(model, prompts, num_samples_per_prompt=2, max_gen_len=24, eos_token_id=eos_token_id,
                           temperature=0)
    for completion in completions:
        if completion.finished:
            assert completion.token_ids[-1] == eos_token_id and eos_token_id not in completion.token_ids[:-1]
        else:
            assert len(completion.token_ids) == 24 and eos_token_id not in completion.token_ids


def test_stop_lengths_cut_rows_without_marking_them_finished(model, prompts, eos_token_id):
    stop_lengths = [2, 30, 9, 17, 1, 24, 13, 3]
    completions = generate(model, prompts, num_samples_per_prompt=2, max_gen_len=20, eos_token_id=eos_token_id,
                           temperature=0, stop_lengths=stop_lengths)
    for row, completion in enumerate(completions):
        reference = naive_greedy(model, prompts[row // 2], min(stop_lengths[row], 20), eos_token_id)
        assert completion == reference


def test_one_token_generation(model, prompts):
    completions = generate(model, prompts, num_samples_per_prompt=2, max_gen_len=1, eos_token_id=-1, temperature=0)
    assert [c.token_ids for c in completions] == [naive_greedy(model, p, 1, -1).token_ids for p in prompts for _ in "ab"]


def chi_square_statistic(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic, pooling categories with too few expected counts; returns (statistic, dof)."""
    expected = probs.double() * counts.sum()
    large = expected >= min_expected
    observed = torch.cat([counts[large].double(), counts[~large].double().sum()[None]])
    expected = torch.cat([expected[large], expected[~large].sum()[None]])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    return statistic, int(keep.sum()) - 1


def chi_square_critical(dof: int, z: float = 3.719) -> float:
    """Upper 1e-4 quantile of chi-square(dof), Wilson-Hilferty approximation."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def sampled_counts(logits: torch.Tensor, temperature: float, top_p: float, num_draws: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    uniforms = torch.rand(num_draws, generator=generator)
    tokens, _, _ = sample_and_score(logits.expand(num_draws, -1), temperature, top_p, uniforms)
    return torch.bincount(tokens, minlength=logits.shape[-1])


def test_sample_follows_softmax_with_temperature():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    counts = sampled_counts(logits, temperature=0.5, top_p=1.0, num_draws=20000, seed=0)
    statistic, dof = chi_square_statistic(counts, torch.softmax(logits / 0.5, -1))
    assert statistic < chi_square_critical(dof)
    # The test has power: the same draws are far from the untempered distribution.
    statistic, dof = chi_square_statistic(counts, torch.softmax(logits, -1))
    assert statistic > 10 * chi_square_critical(dof)


def test_top_p_samples_only_the_renormalised_nucleus():
    probs = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05])
    # Ranked mass before each token: 0.5 -> 0, 0.3 -> 0.5, 0.1 -> 0.8: top_p 0.75 keeps tokens 1 and 3.
    counts = sampled_counts(probs.log(), temperature=1.0, top_p=0.75, num_draws=20000, seed=1)
    assert counts[[0, 2, 4]].sum() == 0
    statistic, dof = chi_square_statistic(counts[[1, 3]], torch.tensor([0.5, 0.3]) / 0.8)
    assert statistic < chi_square_critical(dof)


def test_sample_never_picks_zero_probability_tokens():
    logits = torch.tensor([-math.inf, 0.0, -math.inf, 0.0, -math.inf])
    uniforms = torch.tensor([0.0, 0.4999, 0.5, 1 - 2**-24, 1.0])  # the edges of [0, 1), and beyond
    tokens, _, _ = sample_and_score(logits.expand(5, -1), 1.0, 1.0, uniforms)
    assert tokens.tolist() == [1, 1, 3, 3, 3]


@pytest.mark.parametrize("vocab", [4096, 3000, 7])  # blocks of 1,024 slots; of 8 (3,000 = 8 x 375); of 1
def test_cdf_inversion_finds_the_slot_whose_cdf_step_holds_the_uniform(vocab):
    generator = torch.Generator().manual_seed(vocab)
    rows = 512
    probs = torch.rand(rows, vocab, generator=generator) ** 8  # a few large masses among many small ones
    probs[torch.rand(rows, vocab, generator=generator) < 0.5] = 0.0  # half the slots, whole blocks among them
    probs[: rows // 2, : vocab // 2] = 0.0
    probs[:, -1] = 1e-3  # every row has mass
    uniforms = torch.rand(rows, generator=generator)
    uniforms[:4] = torch.tensor([0.0, 1 - 2**-24, 1.0, 0.5])  # the edges of [0, 1), and beyond
    tokens = invert_cdf(probs.clone(), 1.0, uniforms)
    # The reference: one cumulative sum over the whole vocabulary, in float64.
    cdf = probs.double().cumsum(-1)
    point = uniforms.double() * cdf[:, -1]
    chosen = tokens[:, None]
    high = cdf.gather(-1, chosen).squeeze(-1)  # the chosen slot's CDF step is [low, high]
    low = high - probs.double().gather(-1, chosen).squeeze(-1)
    assert (probs.gather(-1, chosen) > 0).all()
    slack = 1e-5 * cdf[:, -1]  # float32 sums against float64 ones
    assert ((low - slack <= point) & (point <= high + slack)).all()
    # Within the slack the reference's own choice is the same slot on nearly every row.
    reference = torch.searchsorted(cdf, point[:, None], right=True).squeeze(-1).clamp(max=vocab - 1)
    assert (tokens == reference).float().mean() > 0.99


def test_first_generated_token_follows_model_distribution(model, prompts):
    temperature, num_samples = 0.7, 8000
    generator = torch.Generator().manual_seed(2)
    completions = generate(model, prompts[:1], num_samples_per_prompt=num_samples, max_gen_len=1, eos_token_id=-1,
                           temperature=temperature, generator=generator)
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in completions]), minlength=model.config.vocab_size)
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor(prompts[:1]))[0, -1] / temperature, -1)
    statistic, dof = chi_square_statistic(counts, probs)
    assert dof >= 5 and statistic < chi_square_critical(dof)


@pytest.mark.parametrize("flags", FLAG_COMBINATIONS, ids=FLAG_IDS)
def test_top_p_keeps_every_token_inside_the_nucleus(model, prompts, flags):
    top_p, temperature = 0.6, 0.8
    generator = torch.Generator().manual_seed(3)
    completions = generate(model, prompts, num_samples_per_prompt=4, max_gen_len=12, eos_token_id=-1,
                           temperature=temperature, top_p=top_p, generator=generator, **flags)
    for row, completion in enumerate(completions):
        prompt = prompts[row // 4]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion.token_ids]))[0, len(prompt) - 1 : -1]
        probs, order = torch.softmax(logits / temperature, -1).sort(-1, descending=True)
        nucleus_size = ((probs.cumsum(-1) - probs) < top_p).sum(-1)
        ranks = (order == torch.tensor(completion.token_ids)[:, None]).float().argmax(-1)
        assert (ranks < nucleus_size).all()
        assert nucleus_size.max() > 1  # the check is not vacuous


@pytest.mark.parametrize("flags", FLAG_COMBINATIONS, ids=FLAG_IDS)
def test_seeded_sampling_is_reproducible(model, prompts, flags):
    run = lambda seed: generate(model, prompts, num_samples_per_prompt=3, max_gen_len=16, eos_token_id=-1,
                                generator=torch.Generator().manual_seed(seed), **flags)
    assert run(5) == run(5)
    assert run(5) != run(6)


def test_cache_is_one_allocation_of_separate_zeroed_layer_buffers(model):
    """One block (glibc unmaps a block that large whole when it is freed, so a CPU process does not keep each
    rollout's cache in its heap), cut into contiguous per-layer buffers that do not overlap."""
    cache = model.new_kv_cache(3, 5)
    buffers = cache.keys + cache.values
    shape = (3, 5, model.config.num_key_value_heads, model.config.head_dim)
    assert len(buffers) == 2 * model.config.num_hidden_layers
    assert all(buffer.shape == shape and buffer.is_contiguous() and not buffer.any() for buffer in buffers)
    block = buffers[0].untyped_storage()
    assert {buffer.untyped_storage().data_ptr() for buffer in buffers} == {block.data_ptr()}
    layer_bytes = buffers[0].numel() * buffers[0].element_size()
    starts = sorted(buffer.data_ptr() for buffer in buffers)
    assert [b - a for a, b in zip(starts, starts[1:])] == [layer_bytes] * (len(buffers) - 1)
    assert block.nbytes() == len(buffers) * layer_bytes


def test_eviction_compacts_rows_inside_the_same_buffers(model):
    cache = model.new_kv_cache(5, 7)
    for buffer in cache.keys + cache.values:
        buffer.copy_(torch.randn(buffer.shape))
    rows = torch.tensor([1, 3, 4])
    expected = [buffer[rows].clone() for buffer in cache.keys + cache.values]
    pointers = [buffer.data_ptr() for buffer in cache.keys + cache.values]
    kept = keep_rows_in_place(cache, rows)
    assert all(torch.equal(a[: len(rows)], b) for a, b in zip(kept.keys + kept.values, expected))
    assert [buffer.data_ptr() for buffer in kept.keys + kept.values] == pointers


def test_eviction_copies_the_written_slots_of_the_rows_that_move(model):
    cache = model.new_kv_cache(6, 9)
    for buffer in cache.keys + cache.values:
        buffer.copy_(torch.randn(buffer.shape))
    before = [buffer.clone() for buffer in cache.keys + cache.values]
    rows, filled = torch.tensor([0, 1, 3, 5]), 4
    kept = keep_rows_in_place(cache, rows, filled)
    for old, new in zip(before, kept.keys + kept.values):
        assert torch.equal(new[:, :filled], old[rows, :filled])
        # Rows 0 and 1 keep their places, and nothing beyond the written slots is touched.
        assert torch.equal(new[:2], old[:2]) and torch.equal(new[:, filled:], old[:4, filled:])


def test_eviction_moves_rows_in_any_order_even_onto_each_others_places(model):
    cache = model.new_kv_cache(5, 4)
    for buffer in cache.keys + cache.values:
        buffer.copy_(torch.randn(buffer.shape))
    before = [buffer.clone() for buffer in cache.keys + cache.values]
    rows = torch.tensor([2, 0, 4, 3])  # row 2 to place 0 while row 0 goes to place 1: a cycle
    kept = keep_rows_in_place(cache, rows)
    assert all(torch.equal(new, old[rows]) for old, new in zip(before, kept.keys + kept.values))


@pytest.mark.parametrize("finished", ["0000", "1111", "1010", "0101", "0011", "1100", "01100110", "10000001"])
def test_rows_to_keep_fills_each_finished_place_with_an_active_row_from_beyond(finished):
    flags = torch.tensor([flag == "1" for flag in finished])
    rows = rows_to_keep(flags).tolist()
    active = [row for row, flag in enumerate(finished) if flag == "0"]
    assert sorted(rows) == active
    assert all(rows[place] == place for place in range(len(rows)) if place in active)  # active rows stay put
    assert sum(row != place for place, row in enumerate(rows)) == finished[: len(active)].count("1")


def test_decode_step_traces_as_one_graph(model, prompts):
    """compile_decode needs the step free of graph breaks; trace it here (CUDA graph capture needs a GPU)."""
    cache = model.new_kv_cache(2, 16)
    compiled = torch.compile(decode_step, backend="eager", fullgraph=True, dynamic=False)
    tokens, positions, uniforms = torch.tensor([3, 4]), torch.tensor([0, 0]), torch.tensor([0.3, 0.9])
    sampling = dict(uniforms=uniforms, temperature=0.9, top_p=0.8)
    expected = decode_step(model, model.new_kv_cache(2, 16), tokens, positions, **sampling)
    traced = compiled(model, cache, tokens, positions, **sampling)
    assert torch.equal(traced[0], expected[0])  # the tokens; their log-probs and entropies within rounding:
    torch.testing.assert_close(traced[1:], expected[1:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompts=[]), "prompts is empty"),
        (dict(prompts=[[1], []]), "prompt 1 has no tokens"),
        (dict(num_samples_per_prompt=0), "must both be >= 1"),
        (dict(temperature=-1.0), "temperature=-1.0 is negative"),
        (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (dict(stop_lengths=[3]), "give one per completion"),
    ],
)
def test_bad_arguments_are_explained(model, kwargs, message):
    arguments = dict(prompts=[[1, 2]], num_samples_per_prompt=2, max_gen_len=4, eos_token_id=0) | kwargs
    with pytest.raises(ValueError, match=message):
        generate(model, **arguments)


@torch.no_grad()
def naive_sampled(model, prompts, num_samples, max_gen_len, eos_token_id, temperature, seed, stop_lengths):
    """What generate() samples for a seed, derived from first principles, one row at a time.

    Row r's token at step t inverts softmax(logits / temperature)'s CDF (float64 here) at uniform [r, t] of
    one [rows, max_gen_len] draw, whatever rows leave the batch when or are decoded beside it.
    """
    uniforms = torch.rand((len(prompts) * num_samples, max_gen_len), generator=torch.Generator().manual_seed(seed))
    completions = []
    for row, prompt in enumerate(prompt for prompt in prompts for _ in range(num_samples)):
        generated = []
        while not generated or (generated[-1] != eos_token_id and len(generated) < min(stop_lengths[row], max_gen_len)):
            logits = model(torch.tensor([list(prompt) + generated]))[0, -1].double()
            cdf = torch.softmax(logits / temperature, -1).cumsum(-1)
            generated.append(int((cdf <= uniforms[row, len(generated)].double() * cdf[-1]).sum()))
        completions.append(Completion(generated, finished=generated[-1] == eos_token_id))
    return completions


@pytest.mark.parametrize("flags", FLAG_COMBINATIONS, ids=FLAG_IDS)
def test_each_token_keeps_its_own_log_prob_and_entropy_as_rows_leave_the_batch(model, prompts, flags):
    """The sampler's log p and entropy of every generated token, at the sampling temperature and before
    top_p, against a full forward over that completion: rows finish at different steps and leave the batch."""
    temperature, top_p, seed = 0.7, 0.9, 4
    stop_lengths = [3, 20, 9, 17, 1, 12, 20, 6]
    generator = torch.Generator().manual_seed(seed)
    completions = generate(model, prompts, num_samples_per_prompt=2, max_gen_len=20, eos_token_id=-1,
                           temperature=temperature, top_p=top_p, generator=generator,
                           stop_lengths=stop_lengths, **flags)
    for row, completion in enumerate(completions):
        prompt = prompts[row // 2]
        assert len(completion.token_ids) == len(completion.log_probs) == len(completion.entropies) == stop_lengths[row]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion.token_ids]))[0, len(prompt) - 1 : -1].double()
        probs = torch.softmax(logits / temperature, -1)
        expected_log_probs = probs.log()[torch.arange(len(completion.token_ids)), completion.token_ids]
        expected_entropies = -(probs * probs.log()).sum(-1)
        torch.testing.assert_close(torch.tensor(completion.log_probs, dtype=torch.float64), expected_log_probs,
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(completion.entropies, dtype=torch.float64), expected_entropies,
                                   rtol=0, atol=1e-5)


def test_greedy_tokens_get_the_untempered_policys_log_probs(model, prompts):
    completion = generate(model, prompts[:1], num_samples_per_prompt=1, max_gen_len=6, eos_token_id=-1,
                          temperature=0)[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0] + completion.token_ids]))[0, len(prompts[0]) - 1 : -1].double()
    expected = torch.log_softmax(logits, -1)[torch.arange(6), completion.token_ids]
    torch.testing.assert_close(torch.tensor(completion.log_probs, dtype=torch.float64), expected, rtol=0, atol=1e-5)


@pytest.fixture
def packing_forced(monkeypatch) -> None:
    """Decode through the oneDNN-packed weights that large models get on a CPU, forced here for the tiny model by
    lowering the size threshold."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN, so decoding never packs a weight")
    monkeypatch.setattr(generation, "PACKED_MIN_WEIGHTS", 0)


@pytest.fixture(params=[False, True], ids=["plain", "packed"])
def packed_projection(request, model) -> bool:
    if request.param:
        request.getfixturevalue("packing_forced")
    # float32: only the vocabulary projection is packed
    assert layers_to_pack(model) == ([model.lm_head] if request.param else [])
    return request.param


@pytest.fixture
def bf16_model(model) -> Transformer:
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no bf16 instructions for oneDNN, so bf16 decoding never packs a weight")
    return copy.deepcopy(model).to(torch.bfloat16)


def test_packed_weights_give_each_layers_product_and_are_dropped_after(model, bf16_model, packing_forced):
    generator = torch.Generator().manual_seed(0)
    for tested in (model, bf16_model):
        layers = layers_to_pack(tested)
        expected_count = 1 if tested is model else 7 * tested.config.num_hidden_layers + 1  # every Linear in bf16
        assert len(layers) == expected_count
        inputs = [torch.randn(5, 3, layer.in_features, generator=generator).to(layer.weight.dtype) for layer in layers]
        with packed_weights(tested, rows=15):
            assert all(layer.packed_weight is not None for layer in layers)
            outputs = [layer(x) for layer, x in zip(layers, inputs)]
        assert all(layer.packed_weight is None for layer in layers)
        for layer, x, output in zip(layers, inputs, outputs):
            tolerance = 1e-5 if tested is model else 1e-2
            torch.testing.assert_close(output, F.linear(x, layer.weight, layer.bias), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("with_adapters", [False, True], ids=["model", "lora"])
def test_bf16_generation_with_every_layer_packed_gives_the_plain_tokens(bf16_model, prompts, monkeypatch, with_adapters):
    if with_adapters:  # a trained LoRA: the adapter's product is added to the packed one
        bf16_model.add_adapters(rank=2, alpha=4.0)
        with torch.no_grad():
            for layer in bf16_model.adapted_layers().values():
                layer.lora_B.weight.normal_(std=0.5, generator=torch.Generator().manual_seed(1))
    settings = dict(num_samples_per_prompt=2, max_gen_len=12, eos_token_id=-1, temperature=1.0)
    plain = generate(bf16_model, prompts, generator=torch.Generator().manual_seed(3), **settings)
    monkeypatch.setattr(generation, "PACKED_MIN_WEIGHTS", 0)
    assert len(layers_to_pack(bf16_model)) == 7 * bf16_model.config.num_hidden_layers + 1
    packed = generate(bf16_model, prompts, generator=torch.Generator().manual_seed(3), **settings)
    assert [c.token_ids for c in packed] == [c.token_ids for c in plain]
    for packed_completion, plain_completion in zip(packed, plain):
        torch.testing.assert_close(packed_completion.log_probs, plain_completion.log_probs, rtol=0, atol=0.05)


@pytest.mark.parametrize("flags", FLAG_COMBINATIONS, ids=FLAG_IDS)
def test_sampled_tokens_for_a_seed_match_the_first_principles_sampler(model, prompts, flags, packed_projection):
    """Pins what a seed gives (the RNG draws and the token each one picks), so speed-ups cannot change it."""
    temperature, seed, num_samples, max_gen_len = 0.7, 11, 2, 20
    # Rows finish inside different eviction windows; the eos is a token sampling actually meets.
    stop_lengths = [3, 20, 9, 17, 1, 12, 20, 6]
    probe = naive_sampled(model, prompts, num_samples, max_gen_len, -1, temperature, seed, stop_lengths)
    eos_token_id = probe[1].token_ids[10]
    expected = naive_sampled(model, prompts, num_samples, max_gen_len, eos_token_id, temperature, seed, stop_lengths)
    assert any(c.finished for c in expected) and sum(len(c.token_ids) for c in expected) > 40
    completions = generate(
        model, prompts, num_samples_per_prompt=num_samples, max_gen_len=max_gen_len, eos_token_id=eos_token_id,
        temperature=temperature, generator=torch.Generator().manual_seed(seed), stop_lengths=stop_lengths, **flags,
    )
    assert completions == expected
    # Decoded a few prompts at a time (a cache of their size each), the rows get the same tokens.
    for max_rows in (num_samples, 3 * num_samples, 1):
        assert generate(model, prompts, num_samples_per_prompt=num_samples, max_gen_len=max_gen_len,
                        eos_token_id=eos_token_id, temperature=temperature, generator=torch.Generator().manual_seed(seed),
                        stop_lengths=stop_lengths, max_rows=max_rows, **flags) == expected
