"""Qwen2 / Qwen2.5 decoder in plain PyTorch, loading Hugging Face checkpoints directly.

Module and parameter names mirror the Hugging Face layout (minus the leading
"model." prefix) so loading and saving are a plain state-dict copy.
"""

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from logprobs import chunked_token_log_probs

def download_hint(model_dir: Path) -> str:
    # A directory named like a Hub model (Qwen2.5-Math-1.5B, ...) gets that model's clone command.
    name = model_dir.name if model_dir.name.startswith("Qwen") else "Qwen2.5-3B-Instruct"
    return f"Download a Qwen2.5 checkpoint first, e.g.\n  git lfs install && git clone https://huggingface.co/Qwen/{name} {model_dir}"
SUPPORTED_MODEL_TYPES = ("qwen2",)


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_dict(cls, hf_config: dict) -> "ModelConfig":
        model_type = hf_config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json has model_type={model_type!r}; this repo implements {SUPPORTED_MODEL_TYPES} "
                "(Qwen2 and Qwen2.5 checkpoints). Point model_dir at a Qwen2.5 model."
            )
        rope_scaling = hf_config.get("rope_scaling") or {}
        if rope_scaling.get("rope_type", rope_scaling.get("type", "default")) != "default":
            raise ValueError(f"rope_scaling {rope_scaling} is not supported; remove it from config.json.")
        values = {f.name: hf_config[f.name] for f in fields(cls) if f.name in hf_config}
        # transformers >= 5 writes rope_theta inside rope_parameters.
        if "rope_theta" not in values and "rope_parameters" in hf_config:
            values["rope_theta"] = hf_config["rope_parameters"]["rope_theta"]
        values.setdefault("num_key_value_heads", hf_config["num_attention_heads"])
        return cls(**values)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 even for bf16 activations, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables of shape [batch, seq, head_dim] for integer positions [batch, seq]."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; Qwen rotates the two halves of head_dim (not interleaved pairs)."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class KVCache:
    """Per-layer key/value buffers [batch, max_seq_len, kv_heads, head_dim].

    Every row writes at its own positions, so prompts of different lengths share one batch.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys = keys
        self.values = values

    @classmethod
    def empty(cls, config: ModelConfig, batch_size: int, max_seq_len: int, device, dtype) -> "KVCache":
        shape = (batch_size, max_seq_len, config.num_key_value_heads, config.head_dim)
        make = lambda: [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        return cls(make(), make())

    @property
    def max_seq_len(self) -> int:
        return self.keys[0].shape[1]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, layer_cache=None, positions=None, mask=None):
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin).transpose(1, 2)
        if layer_cache is None:
            out = F.scaled_dot_product_attention(
                q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            )
        else:
            cache_k, cache_v = layer_cache
            rows = torch.arange(batch, device=x.device)[:, None]
            cache_k[rows, positions] = k
            cache_v[rows, positions] = v
            out = F.scaled_dot_product_attention(
                q, cache_k.transpose(1, 2), cache_v.transpose(1, 2), attn_mask=mask, enable_gqa=True
            )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, layer_cache=None, positions=None, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer_cache, positions, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, hf_config: dict | None = None):
        super().__init__()
        self.config = config
        # The untouched config.json, written back on save so fields we do not model survive.
        self.hf_config = dict(hf_config or {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})
        self.gradient_checkpointing = False
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def hidden_states(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Final normalised hidden states [batch, seq, hidden].

        Without a cache: a causal forward over positions 0..seq-1 (right padding never leaks backwards).
        With a cache: `positions` [batch, seq] gives each row's absolute positions; keys/values are
        written there and each token attends to its row's cached positions up to its own.
        """
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        x = self.embed_tokens(tokens)
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        if kv_cache is not None:
            # Attend over the whole buffer with a per-row causal mask: static shapes (CUDA-graph friendly),
            # and slots beyond a row's position (padding, other rows' lengths) are never seen.
            key_positions = torch.arange(kv_cache.max_seq_len, device=tokens.device)
            mask = key_positions[None, None, None, :] <= positions[:, None, :, None]
        for index, layer in enumerate(self.layers):
            if kv_cache is not None:
                layer_cache = (kv_cache.keys[index], kv_cache.values[index])
                x = layer(x, cos, sin, layer_cache, positions, mask)
            elif self.gradient_checkpointing and self.training:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        return self.norm(x)

    def forward(self, tokens: torch.Tensor, positions=None, kv_cache: KVCache | None = None, *,
                logits_at: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                logprob_chunk_size: int = 256):
        """Logits [batch, seq, vocab] in the model's dtype, or what a caller needs instead of all of them:

        logits_at [batch]: only the logits at each row's given position, [batch, vocab] (prefill).
        targets [batch, seq]: (log p(targets) [batch, seq], entropy [batch, seq]) in float32, computed
        chunk by chunk without the whole logits tensor (the update; see logprobs.py).
        """
        hidden = self.hidden_states(tokens, positions, kv_cache)
        if targets is not None:
            return chunked_token_log_probs(hidden, targets, self.lm_head.weight, logprob_chunk_size)
        if logits_at is not None:
            hidden = hidden[torch.arange(len(hidden), device=hidden.device), logits_at]
        return self.lm_head(hidden)

    def new_kv_cache(self, batch_size: int, max_seq_len: int) -> KVCache:
        weight = self.embed_tokens.weight
        return KVCache.empty(self.config, batch_size, max_seq_len, weight.device, weight.dtype)

    @classmethod
    def from_pretrained(cls, model_dir, device="cpu", dtype: torch.dtype = torch.bfloat16) -> "Transformer":
        model_dir = Path(model_dir)
        hf_config = read_hf_config(model_dir)
        config = ModelConfig.from_hf_dict(hf_config)
        # Build on the meta device so the weights only ever exist once, where they are loaded.
        with torch.device("meta"):
            model = cls(config, hf_config)
        state = load_safetensors(model_dir, device, dtype)
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        else:
            if "lm_head.weight" not in state:
                raise ValueError(f"{model_dir}: tie_word_embeddings is false but lm_head.weight is missing.")
        expected = {name for name in model.state_dict() if not (config.tie_word_embeddings and name == "lm_head.weight")}
        missing, unexpected = expected - state.keys(), state.keys() - expected
        if missing or unexpected:
            raise ValueError(
                f"{model_dir}: weights do not match a Qwen2 model of this config.json "
                f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})."
            )
        model.load_state_dict(state, strict=False, assign=True)
        model.tie_weights()
        return model

    def save_pretrained(self, out_dir, max_shard_bytes: int = 5 * 1024**3) -> None:
        """Write config.json and safetensors (sharded above max_shard_bytes) in the Hugging Face layout."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        dtype = self.embed_tokens.weight.dtype
        hf_config = dict(self.hf_config, torch_dtype=str(dtype).removeprefix("torch."))
        (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        tensors = {
            hf_name(name): tensor.detach().to("cpu").contiguous()
            for name, tensor in self.state_dict().items()
            if not (self.config.tie_word_embeddings and name == "lm_head.weight")
        }
        write_safetensors(tensors, out_dir, max_shard_bytes)


def hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def read_hf_config(model_dir: Path) -> dict:
    if not model_dir.is_dir():
        raise FileNotFoundError(f"Model directory '{model_dir}' does not exist.\n{download_hint(model_dir)}")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"'{model_dir}' has no config.json, so it is not a Hugging Face model directory.\n{download_hint(model_dir)}"
        )
    return json.loads(config_path.read_text())


def weight_files(model_dir: Path) -> list[Path]:
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = [model_dir / "model.safetensors"]
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"Weight file '{file}' is missing.\n{download_hint(model_dir)}")
        with open(file, "rb") as handle:
            if handle.read(7) == b"version":
                raise ValueError(
                    f"'{file}' is a git-lfs pointer, not the weights: run `git lfs install && git lfs pull` "
                    f"inside {model_dir}."
                )
    return files


def load_safetensors(model_dir: Path, device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = {}
    for file in weight_files(model_dir):
        with safe_open(file, framework="pt", device=str(device)) as handle:
            for key in handle.keys():
                state[key.removeprefix("model.")] = handle.get_tensor(key).to(dtype)
    return state


def write_safetensors(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int) -> None:
    shards, current, current_bytes = [], {}, 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if current and current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = {}, 0
        current[name] = tensor
        current_bytes += size
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], out_dir / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out_dir / file_name, metadata={"format": "pt"})
        weight_map.update({name: file_name for name in shard})
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def init_weights(model: Transformer, seed: int, std: float = 0.02) -> None:
    """Random initialisation for models built from scratch (tests, the CPU demo)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                scale = std / math.sqrt(2 * model.config.num_hidden_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
