"""Our Qwen2 implementation against transformers' Qwen2ForCausalLM, loaded from the same directory."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import runtime
from config import ModelSetup
from qwen2_model import Transformer
from tiny_model import build_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]


def load(model_dir) -> Transformer:
    """As the entry points load a model: the directory checked first, each mistake named with its fix."""
    return runtime.load_model(ModelSetup(dir=str(model_dir), dtype="float32"), torch.device("cpu"))


def test_the_model_file_needs_only_torch_safetensors_and_the_standard_library():
    project = {path.stem for path in REPO_ROOT.glob("*.py")} - {"qwen2_model"}
    loaded = subprocess.run([sys.executable, "-c", "import sys, qwen2_model; print(' '.join(sys.modules))"],
                            cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert not project & set(loaded), project & set(loaded)
    top_level = {name.partition(".")[0] for name in loaded}
    assert {"torch", "safetensors"} <= top_level and not top_level & {"yaml", "huggingface_hub", "transformers"}


def reference_logits(model_dir, tokens):
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return reference(tokens).logits


def our_logits(model_dir, tokens):
    model = Transformer.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens)


SHAPES = {
    "tied_gqa2": dict(tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=2),
    "untied_mha": dict(tie_word_embeddings=False, num_attention_heads=4, num_key_value_heads=4),
    "gqa4_theta1e6_head32": dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=1, rope_theta=1e6, tie_word_embeddings=False
    ),
    "head8_theta500": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, rope_theta=500.0),
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_logits_match_transformers(tmp_path, shape):
    model_dir = build_tiny_model(tmp_path / "model", seed=1, **shape)
    tokens = torch.randint(0, 500, (3, 37), generator=torch.Generator().manual_seed(0))
    ours, theirs = our_logits(model_dir, tokens), reference_logits(model_dir, tokens)
    assert ours.shape == theirs.shape == (3, 37, json.loads((model_dir / "config.json").read_text())["vocab_size"])
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_sharded_checkpoint_loads_in_both(tmp_path, tiny_model_dir):
    model = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_bytes=40_000)
    shards = sorted(sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, sharded / name)
    tokens = torch.randint(0, 500, (2, 21), generator=torch.Generator().manual_seed(1))
    assert (our_logits(sharded, tokens) - reference_logits(sharded, tokens)).abs().max().item() <= 1e-4
    assert torch.equal(our_logits(sharded, tokens), our_logits(tiny_model_dir, tokens))


def test_saved_directory_loads_in_transformers_with_same_logits(tmp_path, tiny_model_dir):
    model = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():  # make the saved weights differ from the fixture's
        model.layers[0].mlp.up_proj.weight.mul_(1.5)
    model.save_pretrained(tmp_path / "saved")
    tokens = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model.eval()(tokens)
    assert (reference_logits(tmp_path / "saved", tokens) - expected).abs().max().item() <= 1e-4


def test_gradient_checkpointing_gives_same_gradients(tiny_model_dir):
    tokens = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(3))
    grads = []
    for checkpointing in (False, True):
        model = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
        model.gradient_checkpointing = checkpointing
        model(tokens).logsumexp(-1).sum().backward()
        grads.append(model.layers[0].self_attn.q_proj.weight.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_kv_cache_prefill_and_decode_match_full_forward(tiny_model_dir):
    """Rows with different prompt lengths, right-padded in one prefill, then decoded token by token."""
    model = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(4)
    prompt_lengths, decode_steps, pad_id = [5, 11, 8], 6, 0
    sequences = [torch.randint(1, 500, (length + decode_steps,), generator=generator) for length in prompt_lengths]
    batch = len(sequences)
    prompts = torch.full((batch, max(prompt_lengths)), pad_id)
    for row, length in enumerate(prompt_lengths):
        prompts[row, :length] = sequences[row][:length]
    cache = model.new_kv_cache(batch, max(prompt_lengths) + decode_steps)
    positions = torch.arange(prompts.shape[1]).expand(batch, -1)
    with torch.no_grad():
        prefill_logits = model(prompts, positions, cache)
        cached = [[prefill_logits[row, length - 1]] for row, length in enumerate(prompt_lengths)]
        lengths = torch.tensor(prompt_lengths)
        for step in range(decode_steps - 1):
            next_tokens = torch.stack([sequences[row][lengths[row]] for row in range(batch)])[:, None]
            step_logits = model(next_tokens, lengths[:, None], cache)
            for row in range(batch):
                cached[row].append(step_logits[row, 0])
            lengths = lengths + 1
        for row, length in enumerate(prompt_lengths):
            full = model(sequences[row][None, : length + decode_steps - 1])[0, length - 1 :]
            assert (torch.stack(cached[row]) - full).abs().max().item() <= 1e-4


@pytest.mark.parametrize("heads, kv_heads, length", [(4, 2, 1), (8, 2, 5), (6, 6, 3), (14, 2, 4)])
def test_masked_grouped_attention_is_attention_with_repeated_keys_and_values(heads, kv_heads, length):
    """Folding each group of query heads into the query length computes what repeating K and V per head does:
    a decode-shaped call (one query per row) and a prefix-shaped one, with rows of their own lengths."""
    from qwen2_model import masked_grouped_attention

    generator = torch.Generator().manual_seed(heads + length)
    batch, slots, head_dim = 3, 9, 16
    q = torch.randn(batch, heads, length, head_dim, generator=generator)
    k, v = (torch.randn(batch, kv_heads, slots, head_dim, generator=generator) for _ in range(2))
    positions = torch.tensor([[2 + i for i in range(length)], [4 + i for i in range(length)], [0 + i for i in range(length)]])
    mask = torch.arange(slots)[None, None, None, :] <= positions[:, None, :, None]
    repeat = heads // kv_heads
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1), attn_mask=mask)
    assert (masked_grouped_attention(q, k, v, mask) - expected).abs().max() <= 1e-6


def test_missing_directory_says_how_to_download(tmp_path):
    with pytest.raises(FileNotFoundError, match="git clone https://huggingface.co/Qwen/Qwen2.5-3B-Instruct"):
        load(tmp_path / "nope")


def test_download_hint_names_the_missing_hub_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="git clone https://huggingface.co/Qwen/Qwen2.5-Math-1.5B"):
        load(tmp_path / "Qwen2.5-Math-1.5B")


def test_missing_config_is_explained(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load(tmp_path / "empty")


def test_missing_weights_are_explained(tmp_path, tiny_model_dir):
    shutil.copytree(tiny_model_dir, tmp_path / "model")
    (tmp_path / "model" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors' is missing"):
        load(tmp_path / "model")


def test_git_lfs_pointer_is_explained(tmp_path, tiny_model_dir):
    shutil.copytree(tiny_model_dir, tmp_path / "model")
    (tmp_path / "model" / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\n")
    with pytest.raises(ValueError, match="git lfs pull"):
        load(tmp_path / "model")


def test_other_model_type_is_refused(tmp_path, tiny_model_dir):
    shutil.copytree(tiny_model_dir, tmp_path / "model")
    config_path = tmp_path / "model" / "config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"model_type": "mistral"}))
    with pytest.raises(ValueError, match="model_type='mistral'.*Qwen2/Qwen2.5, Qwen3 and Llama"):
        Transformer.from_pretrained(tmp_path / "model")
