"""The tokenizer of a Hugging Face model directory: tokenizer.json plus the chat template."""

from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RustTokenizer

from config import DataError
from inputs import check_tokenizer_files, read_json, tokenizer_dir


def _token_text(value) -> str | None:
    # tokenizer_config.json stores special tokens either as strings or as AddedToken dicts.
    return value.get("content") if isinstance(value, dict) else value


def _raise_template_error(message: str):
    raise TemplateError(message)


class Tokenizer:
    def __init__(self, model_dir):
        model_dir = tokenizer_dir(Path(model_dir))  # a LoRA adapter without tokenizer files: its base model's
        tokenizer_path = model_dir / "tokenizer.json"
        config_path = model_dir / "tokenizer_config.json"
        check_tokenizer_files(model_dir)
        try:
            self.tokenizer = RustTokenizer.from_file(str(tokenizer_path))
        except Exception as error:  # the Rust library's own exception type, whatever the damage
            raise DataError(f"{tokenizer_path} cannot be read ({error}); copy or download it again") from None
        config = read_json(config_path)
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token")) or self.eos_token
        if self.eos_token is None:
            raise DataError(f"{config_path} defines no eos_token.")
        self.eos_token_id = self.tokenizer.token_to_id(self.eos_token)
        self.pad_token_id = self.tokenizer.token_to_id(self.pad_token)
        self.bos_token = _token_text(config.get("bos_token"))
        template_path = model_dir / "chat_template.jinja"
        template_text = template_path.read_text() if template_path.is_file() else config.get("chat_template")
        self.chat_template = None
        if template_text:
            # The same Jinja settings transformers uses, so templates render identically.
            environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            environment.globals["raise_exception"] = _raise_template_error
            self.chat_template = environment.from_string(template_text)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def render_chat(self, messages: list[dict[str, str]], prefill: str = "") -> str:
        """Chat messages as the model's prompt text, opened for the assistant's turn, plus `prefill`."""
        if self.chat_template is None:
            raise ValueError("This tokenizer has no chat_template; use a plain-text prompt template instead.")
        text = self.chat_template.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token,
        )
        return text + prefill

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() of each text, on all cores at once: thousands of texts in seconds, not minutes."""
        return [encoding.ids for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
