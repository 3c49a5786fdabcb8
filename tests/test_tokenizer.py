"""Our tokenizer against transformers' AutoTokenizer on the same directory."""

import json
import shutil

import pytest
from transformers import AutoTokenizer

from tokenizer import Tokenizer

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant. Think first."},
    {"role": "user", "content": "Using the numbers [3, 44, 7], create an equation that equals 58."},
]
PREFILL = "Let me solve this step by step.\n<think>"


@pytest.mark.parametrize("messages", [MESSAGES, MESSAGES[1:]], ids=["with_system", "default_system"])
def test_rendered_prompt_and_ids_match_transformers(tiny_model_dir, messages):
    ours = Tokenizer(tiny_model_dir)
    reference = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected_text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + PREFILL
    text = ours.render_chat(messages, prefill=PREFILL)
    assert text == expected_text
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n" + PREFILL)
    assert ours.encode(text) == reference.encode(expected_text, add_special_tokens=False)


def test_special_tokens_and_round_trip(tiny_model_dir):
    ours = Tokenizer(tiny_model_dir)
    reference = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert (ours.eos_token, ours.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert ours.eos_token_id == reference.convert_tokens_to_ids("<|im_end|>")
    assert ours.pad_token_id == reference.convert_tokens_to_ids("<|endoftext|>")
    text = "<think> 44 - 3 = 41 </think>\n<answer> (44 - 3) + 17 </answer><|im_end|>"
    ids = ours.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert ids[-1] == ours.eos_token_id
    assert ours.decode(ids) == text == reference.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == text.removesuffix("<|im_end|>")
    assert reference.convert_ids_to_tokens(ours.encode("1234")) == ["1", "2", "3", "4"]  # Qwen splits digits


def test_missing_tokenizer_file_is_explained(tmp_path, tiny_model_dir):
    shutil.copytree(tiny_model_dir, tmp_path / "model")
    (tmp_path / "model" / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json' is missing"):
        Tokenizer(tmp_path / "model")


def test_template_from_chat_template_jinja_file(tmp_path, tiny_model_dir):
    """Newer Hub checkpoints keep the template in chat_template.jinja instead of tokenizer_config.json."""
    shutil.copytree(tiny_model_dir, tmp_path / "model")
    config_path = tmp_path / "model" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    (tmp_path / "model" / "chat_template.jinja").write_text(config.pop("chat_template"))
    config_path.write_text(json.dumps(config))
    assert Tokenizer(tmp_path / "model").render_chat(MESSAGES) == Tokenizer(tiny_model_dir).render_chat(MESSAGES)
