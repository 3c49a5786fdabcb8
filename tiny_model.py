"""Build a tiny Qwen2, Qwen3 or Llama model directory offline, in exactly the Hugging Face layout.

Nothing here can be downloaded, so tests and the CPU demo use these: config.json as transformers 5
writes it for that architecture, model.safetensors (random init), a byte-level BPE tokenizer.json
trained here, and tokenizer_config.json with the family's special tokens and chat template (ChatML for
Qwen, the Llama 3 header format for Llama). The real loading code then reads them like a Hub model.

    uv run tiny_model.py --out artifacts/tiny-qwen2 [--arch qwen3] [--hidden-size 128 ...]
"""

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from qwen2_model import ARCHITECTURES, ModelConfig, Transformer, init_weights

QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Qwen2's pre-tokenizer split (a public format fact): digits are single tokens, words keep a leading space.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Only digits kept apart: BPE may then merge whole phrases, so the CountDown instructions shrink to a
# few tokens and a CPU run spends its compute on the numbers and the answer instead of the boilerplate.
DIGITS_SPLIT_PATTERN = r"\p{N}|[^\p{N}]+"
SPLIT_PATTERNS = {"qwen": QWEN_SPLIT_PATTERN, "digits": DIGITS_SPLIT_PATTERN}
# ChatML, as Qwen2.5's template renders it when no tools are given.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] != 'system' or not loop.first %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# ChatML as Qwen3's template renders it without tools or thinking history: no default system message.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama 3's header format (without its date preamble).
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
DEFAULT_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)


@dataclass(frozen=True)
class Family:
    special_tokens: list[str]
    chat_template: str
    eos_token: str
    pad_token: str | None  # None: padding uses eos, as Llama 3 checkpoints do
    bos_token: str | None
    config: dict  # config.json keys beyond the shape, as transformers 5 writes them for this class


SLIDING_WINDOW_OFF = dict(use_sliding_window=False, sliding_window=None, max_window_layers=28)
FAMILIES = {
    "qwen2": Family(QWEN_SPECIAL_TOKENS, CHAT_TEMPLATE, "<|im_end|>", "<|endoftext|>", None, SLIDING_WINDOW_OFF),
    # Like Qwen3-0.6B: explicit head_dim wider than hidden_size / heads.
    "qwen3": Family(QWEN_SPECIAL_TOKENS, QWEN3_CHAT_TEMPLATE, "<|im_end|>", "<|endoftext|>", None,
                    dict(SLIDING_WINDOW_OFF, attention_bias=False, head_dim=32)),
    # Like Llama 3.2: llama3 RoPE scaling (here over a 64-token original context, so it bends the tiny
    # model's frequencies too) and pad == eos.
    "llama": Family(LLAMA_SPECIAL_TOKENS, LLAMA3_CHAT_TEMPLATE, "<|eot_id|>", None, "<|begin_of_text|>",
                    dict(attention_bias=False, mlp_bias=False, pretraining_tp=1,
                         rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position_embeddings=64))),
}


def task_like_corpus(seed: int, num_lines: int = 3000) -> list[str]:
    """Text shaped like CountDown and GSM8K prompts and answers, to train the BPE merges on."""
    from countdown_task import RESPONSE_PREFILL, SYSTEM_MESSAGE, USER_TEMPLATE

    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        numbers = [rng.randint(1, 100) for _ in range(rng.randint(3, 4))]
        target = rng.randint(1, 200)
        user = USER_TEMPLATE.format(numbers=numbers, target=target)
        # The chat template's text around the messages, without its special tokens.
        lines.append(f"system\n{SYSTEM_MESSAGE}\nuser\n{user}\nassistant\n{RESPONSE_PREFILL}")
        ops = [rng.choice("+-*/") for _ in numbers[1:]]
        expression = " ".join(f"{n} {op}" for n, op in zip(numbers, ops)) + f" {numbers[-1]}"
        lines.append(f"{expression} = {target} </think>\n<answer> ({expression}) </answer>")
        lines.append(f"She has {numbers[0]} apples and buys {numbers[1]} more, so {numbers[0]} + {numbers[1]}.")
    return lines


def train_tokenizer(corpus: list[str], vocab_size: int, split: str = "qwen",
                    special_tokens: list[str] = QWEN_SPECIAL_TOKENS) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERNS[split]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def write_tokenizer(tokenizer: Tokenizer, out_dir: Path, family: Family) -> None:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": family.bos_token,
        "eos_token": family.eos_token,
        "pad_token": family.pad_token,
        "unk_token": None,
        "model_max_length": 32768,
        "chat_template": family.chat_template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def hf_config_dict(arch: str, shape: dict, vocab_size: int, tokenizer: Tokenizer) -> dict:
    """config.json as transformers 5 saves this architecture's model (minus transformers_version)."""
    family = FAMILIES[arch]
    shape = dict(shape)
    rope_parameters = dict(family.config.get("rope_parameters", {"rope_type": "default"}),
                           rope_theta=shape.pop("rope_theta"))
    config = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch, "dtype": "float32", "vocab_size": vocab_size,
        "hidden_act": "silu", "attention_dropout": 0.0, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "use_cache": True,
        "bos_token_id": tokenizer.token_to_id(family.bos_token or QWEN_SPECIAL_TOKENS[0]),
        "eos_token_id": tokenizer.token_to_id(family.eos_token),
        "pad_token_id": family.pad_token and tokenizer.token_to_id(family.pad_token),
        **family.config, **shape, "rope_parameters": rope_parameters,
    }
    if arch == "llama":
        config.setdefault("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    else:
        config["layer_types"] = ["full_attention"] * shape["num_hidden_layers"]
    return dict(sorted(config.items()))


def build_tiny_model(
    out_dir, *, arch: str = "qwen2", seed: int = 0, tokenizer_vocab_size: int = 512, tokenizer_split: str = "qwen",
    **shape_overrides,
) -> Path:
    """Write a seeded random model of `arch` (qwen2, qwen3, llama) plus tokenizer to out_dir; return the path.

    tokenizer_split: "qwen" pre-tokenizes like Qwen2 (words, single digits); "digits" only splits digits.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    family = FAMILIES[arch]
    tokenizer = train_tokenizer(task_like_corpus(seed), tokenizer_vocab_size, tokenizer_split, family.special_tokens)
    write_tokenizer(tokenizer, out_dir, family)
    # Like Qwen2.5, the embedding table is padded past the tokenizer's size to a multiple of 64.
    vocab_size = -(-tokenizer.get_vocab_size() // 64) * 64
    hf_config = hf_config_dict(arch, DEFAULT_SHAPE | shape_overrides, vocab_size, tokenizer)
    model = Transformer(ModelConfig.from_hf_dict(hf_config), hf_config)
    init_weights(model, seed)
    model.to(torch.float32).save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--arch", choices=sorted(FAMILIES), default="qwen2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-vocab-size", type=int, default=512)
    parser.add_argument("--tokenizer-split", choices=sorted(SPLIT_PATTERNS), default="qwen")
    for name, value in DEFAULT_SHAPE.items():
        kind = (lambda s: s.lower() == "true") if isinstance(value, bool) else type(value)
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value)
    args = vars(parser.parse_args(argv))
    out = build_tiny_model(args.pop("out"), **args)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
