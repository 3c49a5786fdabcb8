"""Qwen2, Qwen3 and Llama against transformers' own classes, on random tiny configs in both config.json layouts.

transformers builds and randomises each model (every weight, bias and norm, so a missing bias or a
norm in the wrong place shows) and saves it; our loader then reads that directory, our save is read
back by transformers, and logits, log-probs and greedy generation must agree.
"""

import json
import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from generation import generate
from logprobs import token_log_probs
from qwen2_model import ARCHITECTURES, ModelConfig, Transformer

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
# name -> (model_type, config.json keys beyond SHAPE, layout). "legacy": rope_theta and rope_scaling at the
# top level, as transformers < 5 wrote them; "v5": rope_parameters, as transformers 5 saves the model.
CASES = {
    "qwen2_tied_gqa_inactive_window": (
        "qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6, use_sliding_window=False,
                      sliding_window=4096, max_window_layers=1), "legacy"),
    "qwen2_untied_head_dim": ("qwen2", dict(num_key_value_heads=1, head_dim=24, rope_theta=500.0), "v5"),
    "qwen3_tied_head_dim": ("qwen3", dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True), "v5"),
    "qwen3_untied_mha_bias": (
        "qwen3", dict(num_key_value_heads=4, head_dim=8, attention_bias=True, rope_theta=1e4), "legacy"),
    "llama_tied_gqa_llama3": (
        "llama", dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=5e5,
                      rope_scaling=LLAMA3 | dict(original_max_position_embeddings=32)), "legacy"),
    "llama_untied_biases_head_dim_llama3": (
        "llama", dict(num_key_value_heads=1, head_dim=12, attention_bias=True, mlp_bias=True, max_position_embeddings=48,
                      rope_parameters=LLAMA3 | dict(rope_theta=1e4)), "v5"),
    "llama_mha_default_rope": ("llama", dict(num_key_value_heads=4), "legacy"),
}


def write_config(model_dir, config: dict) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))


def randomise(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.3
            param.copy_(1 + noise if name.endswith("norm.weight") else noise)


@pytest.fixture(scope="module", params=CASES, ids=CASES)
def case(request, tmp_path_factory):
    """(our model, transformers' model, directory) for one case, both loaded from the same files."""
    model_type, keys, layout = CASES[request.param]
    model_dir = tmp_path_factory.mktemp(request.param)
    config = {"model_type": model_type, "architectures": [ARCHITECTURES[model_type]], **SHAPE, **keys}
    write_config(model_dir, config)
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    randomise(reference, seed=len(request.param))
    reference.save_pretrained(model_dir)
    if layout == "legacy":  # the weights as saved, the config as an older transformers wrote it
        write_config(model_dir, config)
    else:
        assert "rope_parameters" in json.loads((model_dir / "config.json").read_text())
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ours = Transformer.from_pretrained(model_dir, dtype=torch.float32).eval()
    return ours, reference, model_dir


def test_logits_match_transformers(case):
    ours, reference, _ = case
    tokens = torch.randint(0, SHAPE["vocab_size"], (3, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(tokens) - reference(tokens).logits).abs().max().item() <= 1e-4


def test_saved_model_reloads_in_transformers_with_equal_logits(case, tmp_path):
    ours, _, model_dir = case
    ours.save_pretrained(tmp_path / "saved")
    saved_config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved_config == json.loads((model_dir / "config.json").read_text()) | {
        "dtype" if "dtype" in saved_config else "torch_dtype": "float32"}
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (reloaded(tokens).logits - ours(tokens)).abs().max().item() <= 1e-4


def test_log_probs_match_transformers(case):
    ours, reference, _ = case
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 29), generator=torch.Generator().manual_seed(2))
    log_probs, _ = token_log_probs(ours, tokens, chunk_size=8)
    with torch.no_grad():
        expected = reference(tokens).logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    assert (log_probs - expected).abs().max().item() <= 1e-4


def test_greedy_generation_equals_transformers_generate(case):
    """Our batched engine (prompts of different lengths in one batch) against transformers, prompt by prompt."""
    ours, reference, _ = case
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, SHAPE["vocab_size"], (length,), generator=generator).tolist() for length in (5, 11, 8)]
    eos_token_id, max_gen_len = SHAPE["vocab_size"] - 1, 16
    completions = generate(ours, prompts, num_samples_per_prompt=2, max_gen_len=max_gen_len,
                           eos_token_id=eos_token_id, temperature=0.0)
    for index, prompt in enumerate(prompts):
        expected = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_gen_len,
                                      eos_token_id=eos_token_id, pad_token_id=eos_token_id)[0, len(prompt):].tolist()
        for completion in completions[2 * index : 2 * index + 2]:
            assert completion.token_ids == expected


BASE = {"model_type": "qwen2", **SHAPE, "num_key_value_heads": 2}
REFUSED = {
    "yarn_v5": (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}),
                r"rope_parameters has rope_type='yarn'"),
    "linear_legacy_type_key": (dict(rope_scaling={"type": "linear", "factor": 2.0}), r"rope_scaling has rope_type='linear'"),
    "dynamic": (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), r"rope_type='dynamic'"),
    "longrope": (dict(model_type="llama", rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
                 r"rope_type='longrope'"),
    "llama3_incomplete": (dict(model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0}),
                          r"llama3 rope scaling lacks \['low_freq_factor', 'high_freq_factor'\]"),
    "partial_rotary": (dict(partial_rotary_factor=0.5), r"partial_rotary_factor"),
    "per_layer_rope": (dict(layer_types=["full_attention"] * 2, rope_parameters={"full_attention": {"rope_theta": 1e4}}),
                       r"rope_parameters given per layer type"),
    "sliding_window": (dict(use_sliding_window=True, sliding_window=64, max_window_layers=1),
                       r"use_sliding_window=true \(window 64 on layers 1..1\)"),
    "sliding_window_qwen3_layer_types": (
        dict(model_type="qwen3", use_sliding_window=True, sliding_window=64,
             layer_types=["sliding_attention", "full_attention"]), r"use_sliding_window=true \(window 64 on layers 0..0\)"),
    "gelu": (dict(model_type="llama", hidden_act="gelu"), r"hidden_act='gelu'"),
    "quantized": (dict(quantization_config={"quant_method": "awq"}), r"quantization_config"),
    "attention_dropout": (dict(attention_dropout=0.1), r"attention_dropout=0.1"),
    "missing_shape_key": (dict(hidden_size=None), r"hidden_size is missing"),
}


@pytest.mark.parametrize("keys,message", REFUSED.values(), ids=REFUSED.keys())
def test_settings_that_change_the_math_are_refused_by_name(tmp_path, keys, message):
    config = {key: value for key, value in (BASE | keys).items() if value is not None}
    write_config(tmp_path, config)
    with pytest.raises(ValueError, match=message):
        Transformer.from_pretrained(tmp_path)


def test_keys_nobody_reads_are_named_in_a_warning(tmp_path, caplog):
    write_config(tmp_path, BASE | {"rope_interleaved": False, "bos_token_id": 1})
    with pytest.raises(FileNotFoundError), caplog.at_level(logging.WARNING):  # no weights: the config is read first
        Transformer.from_pretrained(tmp_path)
    assert "rope_interleaved" in caplog.text and "bos_token_id" not in caplog.text


def test_qwen2_checkpoint_without_biases_is_pointed_to_llama(tmp_path):
    llama_config = BASE | {"model_type": "llama"}
    model = Transformer(ModelConfig.from_hf_dict(llama_config), llama_config)
    model.save_pretrained(tmp_path)
    write_config(tmp_path, json.loads((tmp_path / "config.json").read_text()) | {"model_type": "qwen2"})
    with pytest.raises(ValueError, match="q_proj.bias.*set model_type to llama"):
        Transformer.from_pretrained(tmp_path)
