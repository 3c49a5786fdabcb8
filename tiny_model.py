"""Build a tiny Qwen2-architecture model directory offline, in exactly the Hugging Face layout.

Nothing here can be downloaded, so tests and the CPU demo use these: config.json, model.safetensors
(random init), a byte-level BPE tokenizer.json trained here, and tokenizer_config.json with Qwen's
special tokens and a ChatML chat template. The real loading code then reads them like any Qwen2.5.

    uv run tiny_model.py --out artifacts/tiny-qwen2 [--hidden-size 128 ...]
"""

import argparse
import json
import random
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from qwen2_model import ModelConfig, Transformer, init_weights

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
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
DEFAULT_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)


def task_like_corpus(seed: int, num_lines: int = 3000) -> list[str]:
    """Text shaped like CountDown and GSM8K prompts and answers, to train the BPE merges on."""
    from countdown_task import SYSTEM_MESSAGE, USER_TEMPLATE, RESPONSE_PREFILL

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


def train_tokenizer(corpus: list[str], vocab_size: int, split: str = "qwen") -> Tokenizer:
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
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def write_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 32768,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def build_tiny_model(
    out_dir, *, seed: int = 0, tokenizer_vocab_size: int = 512, tokenizer_split: str = "qwen", **shape_overrides
) -> Path:
    """Write a seeded random Qwen2 model plus tokenizer to out_dir and return the path.

    tokenizer_split: "qwen" pre-tokenizes like Qwen2 (words, single digits); "digits" only splits digits.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(task_like_corpus(seed), tokenizer_vocab_size, tokenizer_split)
    write_tokenizer(tokenizer, out_dir)
    shape = DEFAULT_SHAPE | shape_overrides
    # Like Qwen2.5, the embedding table is padded past the tokenizer's size to a multiple of 64.
    vocab_size = -(-tokenizer.get_vocab_size() // 64) * 64
    config = ModelConfig(vocab_size=vocab_size, max_position_embeddings=4096, **shape)
    hf_config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "bos_token_id": tokenizer.token_to_id("<|endoftext|>"),
        "eos_token_id": tokenizer.token_to_id("<|im_end|>"),
        "use_sliding_window": False,
        **{name: getattr(config, name) for name in config.__dataclass_fields__},
    }
    model = Transformer(config, hf_config)
    init_weights(model, seed)
    model.to(torch.float32).save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
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
