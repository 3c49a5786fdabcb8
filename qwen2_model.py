"""Qwen2 / Qwen2.5, Qwen3 and Llama-family decoders in plain PyTorch, loading Hugging Face checkpoints directly.

The three are one model with small switches (see ModelConfig): Qwen2 has q/k/v biases; Qwen3 has
none and RMS-normalises each query and key head before RoPE; Llama has biases only where its config
asks for them, and may stretch RoPE for long contexts ("llama3" scaling). Anything else a config.json
asks for that changes the math is refused by name rather than ignored (see `unsupported_settings`).

Module and parameter names mirror the Hugging Face layout (minus the leading "model." prefix) so
loading and saving are a plain state-dict copy. The file needs only torch, safetensors and the standard
library: copy it alone into another project. (The entry points check a model directory first, with the
fix for each mistake: inputs.check_model_dir.)
"""

import contextlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- log-probs of targets
# With Qwen's 151,936-token vocabulary the fp32 logits of one 2 x 1280 micro-batch take 1.5 GB, and autograd
# would keep several tensors that size: forward(targets=...) projects to the vocabulary chunk by chunk.


class ChunkLogProbs(torch.autograd.Function):
    """log p(target) and entropy [batch, chunk] of hidden states [batch, chunk, hidden_size].

    Forward keeps the chunk's log-normaliser [batch, chunk, 1] and no logits; backward recomputes the
    logits once and writes the gradient of log p(target) directly, d/dlogits = onehot(target) - softmax,
    instead of replaying log_softmax under autograd. The entropy is computed once, in forward, as a metric.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, targets: torch.Tensor, lm_head_weight: torch.Tensor, with_entropy: bool):
        logits = F.linear(hidden, lm_head_weight).float()
        log_normaliser = logits.logsumexp(dim=-1, keepdim=True)
        log_probs = logits.sub_(log_normaliser)  # in place: one vocabulary-sized fp32 tensor at a time
        target_log_probs = log_probs.gather(-1, targets[..., None]).squeeze(-1)
        entropy = -log_probs.exp().mul_(log_probs).sum(-1) if with_entropy else None  # no third vocab-sized tensor
        ctx.save_for_backward(hidden, targets, lm_head_weight, log_normaliser)
        ctx.mark_non_differentiable(*([entropy] if with_entropy else []))
        return target_log_probs, entropy

    @staticmethod
    def backward(ctx, grad_target_log_probs: torch.Tensor, _grad_entropy):
        hidden, targets, lm_head_weight, log_normaliser = ctx.saved_tensors
        grad = grad_target_log_probs[..., None]
        probs = F.linear(hidden, lm_head_weight).float().sub_(log_normaliser).exp_()
        grad_logits = probs.mul_(-grad).scatter_add_(-1, targets[..., None], grad).to(hidden.dtype)
        grad_hidden = grad_logits @ lm_head_weight
        grad_weight = None
        if ctx.needs_input_grad[2]:  # a frozen head (LoRA) skips the vocabulary-sized matmul
            grad_weight = grad_logits.flatten(0, -2).T @ hidden.flatten(0, -2)
        return grad_hidden, None, grad_weight, None


def chunked_token_log_probs(hidden: torch.Tensor, targets: torch.Tensor, lm_head_weight: torch.Tensor,
                            chunk_size: int, with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(targets), entropy or None), both [batch, seq], from final hidden states [batch, seq, hidden_size]."""
    # Each chunk contiguous: a strided slice would make F.linear broadcast the head into a batched matmul, which
    # copies the whole vocabulary weight per call in bfloat16 on a CPU (0.5 s a chunk for SmolLM2).
    pieces = [ChunkLogProbs.apply(hidden[:, start : start + chunk_size].contiguous(),
                                  targets[:, start : start + chunk_size], lm_head_weight, with_entropy)
              for start in range(0, targets.shape[1], chunk_size)]
    log_probs, entropy = zip(*pieces)
    return torch.cat(log_probs, dim=1), torch.cat(entropy, dim=1) if with_entropy else None


# model_type -> the transformers class whose math (and config defaults) each architecture follows.
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)
SUPPORTED_ROPE_TYPES = ("default", "llama3")
# What transformers assumes for a key that config.json leaves out (its config classes' defaults).
HF_DEFAULTS = {
    "qwen2": dict(num_key_value_heads=32, max_position_embeddings=32768),
    "qwen3": dict(num_key_value_heads=32, max_position_embeddings=32768, head_dim=128),
    "llama": dict(max_position_embeddings=2048),
}
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Keys read below, and keys that change nothing in the forward pass (token ids, bookkeeping, init).
READ_KEYS = {
    *REQUIRED_KEYS, "model_type", "num_key_value_heads", "max_position_embeddings", "head_dim", "rms_norm_eps",
    "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias", "attention_dropout", "rope_theta",
    "rope_scaling", "rope_parameters", "partial_rotary_factor", "original_max_position_embeddings",
    "use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "quantization_config",
}
NO_MATH_KEYS = {
    "architectures", "transformers_version", "torch_dtype", "dtype", "bos_token_id", "eos_token_id", "pad_token_id",
    "use_cache", "initializer_range", "pretraining_tp", "_name_or_path", "return_dict", "output_attentions",
    "output_hidden_states", "generation_config",
}


def rope_settings(hf_config: dict) -> dict:
    """The RoPE dict as transformers reads it: legacy `rope_scaling` + top-level `rope_theta`
    (transformers < 5) or `rope_parameters` (transformers >= 5, theta inside)."""
    rope = dict(hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    if "original_max_position_embeddings" in hf_config:  # a top-level value wins, as in transformers
        rope["original_max_position_embeddings"] = hf_config["original_max_position_embeddings"]
    if rope["rope_type"] == "llama3":
        default_max = HF_DEFAULTS[hf_config["model_type"]]["max_position_embeddings"]
        rope.setdefault("original_max_position_embeddings", hf_config.get("max_position_embeddings", default_max))
    return rope


def sliding_window_layers(hf_config: dict) -> list[int]:
    """Layers that transformers' Qwen2/Qwen3 run with sliding-window attention."""
    if hf_config["model_type"] == "llama" or not hf_config.get("use_sliding_window") or not hf_config.get("sliding_window"):
        return []
    num_layers = hf_config.get("num_hidden_layers", 0)
    layer_types = hf_config.get("layer_types") or [
        "sliding_attention" if i >= hf_config.get("max_window_layers", 28) else "full_attention" for i in range(num_layers)
    ]
    return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]


def unsupported_settings(hf_config: dict) -> list[str]:
    """One line per config.json setting that would change the math and is not implemented here."""
    problems = [f"{key} is missing" for key in REQUIRED_KEYS if key not in hf_config]
    if hf_config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf_config['hidden_act']!r}: only SiLU (SwiGLU) MLPs are implemented")
    if hf_config.get("quantization_config"):
        problems.append("quantization_config: quantized weights are not supported; use the bf16/fp32 checkpoint")
    if hf_config.get("attention_dropout", 0.0):
        problems.append(f"attention_dropout={hf_config['attention_dropout']}: dropout is not implemented; set it to 0.0")
    if sliding := sliding_window_layers(hf_config):
        problems.append(
            f"use_sliding_window=true (window {hf_config['sliding_window']} on layers {sliding[0]}..{sliding[-1]}): "
            "sliding-window attention is not implemented; set use_sliding_window to false if your sequences are "
            "shorter than sliding_window (the math is then the same)"
        )
    layer_types = set(hf_config.get("layer_types") or ())
    if layer_types & set(hf_config.get("rope_parameters") or {}):
        problems.append("rope_parameters given per layer type: only one RoPE for all layers is implemented")
        return problems
    rope = rope_settings(hf_config)
    if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
        source = "rope_scaling" if hf_config.get("rope_scaling") else "rope_parameters"
        problems.append(f"{source} has rope_type={rope['rope_type']!r}: only {SUPPORTED_ROPE_TYPES} are implemented")
    if rope.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append("partial_rotary_factor: only rotating the whole head (1.0) is implemented")
    if rope["rope_type"] == "llama3":
        if missing := [key for key in LLAMA3_ROPE_KEYS if key not in rope]:
            problems.append(f"llama3 rope scaling lacks {missing}")
    return problems


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
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    qkv_bias: bool = True  # Qwen2: always; Qwen3, Llama: attention_bias
    o_bias: bool = False  # Qwen3, Llama: attention_bias
    mlp_bias: bool = False  # Llama: mlp_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head before RoPE
    # "llama3" scaling: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings.
    rope_llama3: dict | None = None

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_dict(cls, hf_config: dict) -> "ModelConfig":
        model_type = hf_config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json has model_type={model_type!r}; this repo implements {SUPPORTED_MODEL_TYPES} "
                "(Qwen2/Qwen2.5, Qwen3 and Llama-family checkpoints). Point model_dir at one of those."
            )
        if problems := unsupported_settings(hf_config):
            raise ValueError(
                f"config.json ({model_type}) asks for what this repo does not implement, so the model would not "
                "compute what it was trained to:\n  " + "\n  ".join(problems)
            )
        if unknown := sorted(hf_config.keys() - READ_KEYS - NO_MATH_KEYS):
            logger.warning("config.json keys not read here (transformers' %s does not read them either): %s",
                           ARCHITECTURES[model_type], ", ".join(unknown))
        values = HF_DEFAULTS[model_type] | {key: value for key, value in hf_config.items() if value is not None}
        rope = rope_settings(hf_config)
        biased = values.get("attention_bias", False)
        return cls(
            **{key: values[key] for key in REQUIRED_KEYS},
            num_key_value_heads=values.get("num_key_value_heads", values["num_attention_heads"]),
            rms_norm_eps=values.get("rms_norm_eps", 1e-6),
            rope_theta=rope["rope_theta"],
            tie_word_embeddings=values.get("tie_word_embeddings", False),
            max_position_embeddings=values["max_position_embeddings"],
            head_dim=values.get("head_dim"),
            qkv_bias=model_type == "qwen2" or biased,
            o_bias=model_type != "qwen2" and biased,
            mlp_bias=model_type == "llama" and values.get("mlp_bias", False),
            qk_norm=model_type == "qwen3",
            rope_llama3={key: rope[key] for key in LLAMA3_ROPE_KEYS} if rope["rope_type"] == "llama3" else None,
        )


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


def rope_inverse_frequencies(config: "ModelConfig", device) -> torch.Tensor:
    """RoPE's rotation speed per pair of dimensions [head_dim / 2], float32."""
    exponents = torch.arange(0, config.head_dim, 2, device=device, dtype=torch.float32) / config.head_dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_llama3 is None:
        return inv_freq
    # Llama 3.1's long-context scaling: slow (long-wavelength) rotations are divided by `factor`, fast
    # ones kept, and those in between blended linearly in (original context / wavelength).
    scaling = config.rope_llama3
    context, low, high = scaling["original_max_position_embeddings"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelength = 2 * math.pi / inv_freq
    blend = (context / wavelength - low) / (high - low)
    blend = torch.where(wavelength < context / high, 1.0, torch.where(wavelength > context / low, 0.0, blend))
    return blend * inv_freq + (1 - blend) * inv_freq / scaling["factor"]


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos/sin tables of shape [batch, seq, head_dim] for integer positions [batch, seq]."""
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
        # One allocation whose per-layer views are the buffers. On a CPU, glibc maps a block this large afresh
        # and unmaps it whole when freed; per-layer buffers of a few MiB each stayed in its heap instead, and a
        # GRPO process grew by about a cache's size per rollout (SmolLM2: +440 MiB a step, to 4.3 GiB).
        shape = (2, config.num_hidden_layers, batch_size, max_seq_len, config.num_key_value_heads, config.head_dim)
        block = torch.zeros(shape, device=device, dtype=dtype)
        # Detached, each layer's buffer is a tensor of its own to autograd, as separate allocations were: a step
        # run with grad enabled writes one layer's keys without making the others views of a tensor it changed.
        layers = range(config.num_hidden_layers)
        return cls([block[0, layer].detach() for layer in layers], [block[1, layer].detach() for layer in layers])

    @property
    def max_seq_len(self) -> int:
        return self.keys[0].shape[1]

    def first_slots(self, num_slots: int) -> "KVCache":
        """Views of the first num_slots slots of every buffer: writes through them land in this cache."""
        return KVCache(*([buffer[:, :num_slots] for buffer in buffers] for buffers in (self.keys, self.values)))


# ----------------------------------------------------------------------------- LoRA
# Hu et al. 2021 (arXiv:2106.09685): a weight W [out, in] stays frozen and learns a low-rank change B A
# (A [rank, in], B [out, rank]), so a layer computes x W^T + (alpha / rank) x A^T B^T. The names below are
# PEFT's, so an adapter saved here loads with peft.PeftModel.from_pretrained, and the reverse.

ADAPTER_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class Linear(nn.Linear):
    """nn.Linear that can carry a LoRA adapter (add_adapter). Its A and B stay float32 whatever the weight's
    dtype (the master copy AdamW updates) and are cast to the input's dtype for the two thin matmuls.

    While packed_weight is set (a copy of the weight that oneDNN laid out for itself: generation.packed_weights,
    on a CPU, gradients off) the layer multiplies by it instead: the same product, 1.1-3x faster at decoding's
    few rows."""

    adapter_scale = 0.0  # alpha / rank; 0: no adapter
    adapter_enabled = True
    packed_weight: torch.Tensor | None = None

    def add_adapter(self, rank: int, alpha: float, generator: torch.Generator) -> None:
        """A from PEFT's default (Kaiming-uniform, bound 1 / sqrt(in)), B = 0: the layer computes what it did."""
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=self.weight.device, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=self.weight.device, dtype=torch.float32)
        with torch.no_grad():
            bound = 1 / math.sqrt(self.in_features)
            uniform = torch.rand(self.lora_A.weight.shape, generator=generator)
            self.lora_A.weight.copy_(uniform.mul_(2 * bound).sub_(bound))
            self.lora_B.weight.zero_()
        self.adapter_scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is None:
            out = super().forward(x)
        else:
            out = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        if not (self.adapter_scale and self.adapter_enabled):
            return out
        down = F.linear(x, self.lora_A.weight.to(x.dtype))  # [..., rank]
        # out + scale (x A^T) B^T as one fused matmul-add: no [tokens, out] temporary to write and read back
        up = torch.addmm(out.reshape(-1, out.shape[-1]), down.reshape(-1, down.shape[-1]),
                         self.lora_B.weight.to(x.dtype).T, alpha=self.adapter_scale)
        return up.view(out.shape)

    def merged_weight(self) -> torch.Tensor:
        """W + (alpha / rank) B A, in W's dtype: the weight that computes what the layer and its adapter do."""
        if not self.adapter_scale:
            return self.weight
        delta = self.adapter_scale * (self.lora_B.weight @ self.lora_A.weight)
        return (self.weight.float() + delta).to(self.weight.dtype)


def masked_grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of q [batch, heads, L, head_dim] over k, v [batch, kv_heads, S, head_dim] under a boolean mask
    [batch, 1, L, S] (True: attend), for grouped-query attention (heads = groups x kv_heads).

    On a GPU, SDPA's flash kernel takes no mask and its memory-efficient one no unequal head counts, so a mask
    with enable_gqa falls back to the math kernel, which repeats K and V per query head. Instead each group of
    query heads is folded into the query length ([batch, kv_heads, groups x L, head_dim], the mask tiled to
    match): the same products, equal head counts, K and V never copied, and a fused kernel takes it."""
    batch, heads, length, head_dim = q.shape
    groups = heads // k.shape[1]
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    folded = q.reshape(batch, k.shape[1], groups * length, head_dim)  # query head h = kv head h // groups
    tiled = mask.expand(batch, 1, length, mask.shape[-1]).repeat(1, 1, groups, 1)  # row g x L + l is row l
    return F.scaled_dot_product_attention(folded, k, v, attn_mask=tiled).reshape(batch, heads, length, head_dim)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def queries_keys_values(self, x, cos, sin):
        """q [batch, heads, seq, head_dim] and k, v [batch, kv_heads, seq, head_dim], rotated."""
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # per head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q.transpose(1, 2), cos, sin), apply_rotary(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        batch, _, seq, _ = attended.shape
        return self.o_proj(attended.transpose(1, 2).reshape(batch, seq, -1))

    def forward(self, x, cos, sin, layer_cache=None, positions=None, mask=None):
        q, k, v = self.queries_keys_values(x, cos, sin)
        if layer_cache is None:
            return self.output(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        cache_k, cache_v = layer_cache
        rows = torch.arange(x.shape[0], device=x.device)[:, None]
        cache_k[rows, positions] = k.transpose(1, 2)
        cache_v[rows, positions] = v.transpose(1, 2)
        return self.output(masked_grouped_attention(q, cache_k.transpose(1, 2), cache_v.transpose(1, 2), mask))

    def forward_with_prefix(self, prefix_x, x, prefix_rope, rope, mask, prefix_index):
        """Attention over prefixes [P, L] and the rows continuing them [batch, S] (row b continues prefix
        prefix_index[b]): each row attends to its prefix's keys and values, computed once per prefix
        (backward sums the rows' gradients into them)."""
        prefix_q, prefix_k, prefix_v = self.queries_keys_values(prefix_x, *prefix_rope)
        q, k, v = self.queries_keys_values(x, *rope)
        prefix_out = F.scaled_dot_product_attention(prefix_q, prefix_k, prefix_v, is_causal=True, enable_gqa=True)
        # index_select, not prefix_k[prefix_index]: indexing's backward sums the rows into their prefix with
        # index_put_(accumulate=True), whose CPU kernel adds in parallel in no fixed order (two threads: another
        # gradient each run); index_select's backward, index_add_, adds in the rows' order.
        keys = torch.cat([prefix_k.index_select(0, prefix_index), k], dim=2)
        values = torch.cat([prefix_v.index_select(0, prefix_index), v], dim=2)
        out = masked_grouped_attention(q, keys, values, mask)
        return self.output(prefix_out), self.output(out)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, layer_cache=None, positions=None, mask=None, prefix=None):
        """prefix (its hidden states, (cos, sin), each row's prefix): also run the prefixes that the rows of x
        continue and return both (see forward_with_prefix). One forward for both, so wrappers' hooks (FSDP) run."""
        if prefix is not None:
            return self.forward_with_prefix(*prefix, x, (cos, sin), mask)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer_cache, positions, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_with_prefix(self, prefix_x, prefix_rope, prefix_index, x, rope, mask):
        prefix_attended, attended = self.self_attn.forward_with_prefix(
            self.input_layernorm(prefix_x), self.input_layernorm(x), prefix_rope, rope, mask, prefix_index)
        prefix_x, x = prefix_x + prefix_attended, x + attended
        return prefix_x + self.mlp(self.post_attention_layernorm(prefix_x)), x + self.mlp(self.post_attention_layernorm(x))


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
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
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
        cos, sin = rotary_cos_sin(positions, rope_inverse_frequencies(self.config, x.device), x.dtype)
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

    def hidden_states_after_prefix(self, prefixes: torch.Tensor, prefix_lengths: torch.Tensor,
                                   prefix_index: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Final hidden states [batch, seq, hidden] of rows that continue prefixes [P, L] (right-padded to
        prefix_lengths [P]; row b continues prefix_index[b]): the same values as a causal forward over each
        row's prefix + tokens, with each prefix run once."""
        prefix_length, (batch, seq) = prefixes.shape[1], tokens.shape
        inv_freq = rope_inverse_frequencies(self.config, tokens.device)
        prefix_x, x = self.embed_tokens(prefixes), self.embed_tokens(tokens)
        starts = prefix_lengths[prefix_index]  # where each row's own tokens begin
        own = torch.arange(seq, device=tokens.device)
        prefix_rope = rotary_cos_sin(torch.arange(prefix_length, device=tokens.device)[None], inv_freq, x.dtype)
        rope = rotary_cos_sin(starts[:, None] + own, inv_freq, x.dtype)
        # A row's token sees its prefix's real tokens (not the padding) and its own tokens up to itself.
        sees_prefix = torch.arange(prefix_length, device=tokens.device) < starts[:, None]
        mask = torch.cat([sees_prefix[:, None, :].expand(-1, seq, -1),
                          (own <= own[:, None]).expand(batch, -1, -1)], dim=-1)[:, None]
        prefix = prefix_rope, prefix_index
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                prefix_x, x = checkpoint(layer, x, *rope, mask=mask, prefix=(prefix_x, *prefix), use_reentrant=False)
            else:
                prefix_x, x = layer(x, *rope, mask=mask, prefix=(prefix_x, *prefix))
        return self.norm(x)

    def forward(self, tokens: torch.Tensor, positions=None, kv_cache: KVCache | None = None, *,
                logits_at: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                target_positions: torch.Tensor | None = None, prefix: tuple | None = None,
                logprob_chunk_size: int = 256, with_entropy: bool = True):
        """Logits [batch, seq, vocab] in the model's dtype, or what a caller needs instead of all of them:

        logits_at [batch]: only the logits at each row's given position, [batch, vocab] (prefill).
        targets: (log p(targets), entropy) in float32, computed chunk by chunk without the whole logits
        tensor (the update; see logprobs.py). targets [batch, seq] are predicted at every position, or
        targets [batch, n] at target_positions [batch, n] only. with_entropy=False: entropy is None.
        prefix (prefixes [P, L], their lengths [P], each row's prefix [batch]): prompts the rows continue, each
        run once; see hidden_states_after_prefix.
        """
        if prefix is not None:
            hidden = self.hidden_states_after_prefix(*prefix, tokens)
        else:
            hidden = self.hidden_states(tokens, positions, kv_cache)
        if targets is not None:
            if target_positions is not None:
                hidden = hidden.gather(1, target_positions[..., None].expand(-1, -1, hidden.shape[-1]))
            return chunked_token_log_probs(hidden, targets, self.lm_head.weight, logprob_chunk_size, with_entropy)
        if logits_at is not None:
            hidden = hidden[torch.arange(len(hidden), device=hidden.device), logits_at]
        return self.lm_head(hidden)

    # ------------------------------------------------------------------------- LoRA adapters

    def add_adapters(self, rank: int, alpha: float, layers=ADAPTER_LAYERS, seed: int = 0) -> None:
        """A LoRA adapter beside every `layers` linear layer of each block (Linear.add_adapter); every weight of
        the model itself is frozen, so only the adapters train."""
        self.requires_grad_(False)
        generator = torch.Generator().manual_seed(seed)
        self.adapter_settings = {"rank": rank, "alpha": alpha, "layers": list(layers)}
        for layer in self.adapted_layers().values():
            layer.add_adapter(rank, alpha, generator)

    adapter_settings: dict | None = None  # {"rank", "alpha", "layers"} once add_adapters ran

    def adapted_layers(self) -> dict[str, Linear]:
        """The layers carrying an adapter, by module name (e.g. layers.0.self_attn.q_proj)."""
        if not self.adapter_settings:
            return {}
        chosen = self.adapter_settings["layers"]
        return {name: module for name, module in self.named_modules()
                if isinstance(module, Linear) and name.rsplit(".", 1)[-1] in chosen}

    @contextlib.contextmanager
    def adapters_disabled(self):
        """The model without its adapters, for the block: the base model, as it was loaded (LoRA's KL reference)."""
        layers = list(self.adapted_layers().values())
        for layer in layers:
            layer.adapter_enabled = False
        try:
            yield self
        finally:
            for layer in layers:
                layer.adapter_enabled = True

    def merge_adapters(self) -> None:
        """Fold each adapter into its weight (Linear.merged_weight) and drop it: the same outputs, at full-model
        cost, and every weight trainable again."""
        with torch.no_grad():
            for layer in self.adapted_layers().values():
                layer.weight.copy_(layer.merged_weight())
                del layer.lora_A, layer.lora_B
                layer.adapter_scale = 0.0
        self.adapter_settings = None
        self.requires_grad_(True)

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The adapters' weights by PEFT's names (base_model.model.model.layers.N....lora_A.weight)."""
        return {f"{PEFT_PREFIX}{hf_name(name)}": tensor for name, tensor in self.state_dict().items() if ".lora_" in name}

    def save_adapter(self, out_dir, base_model: str) -> None:
        """The adapters in PEFT's layout (adapter_config.json, adapter_model.safetensors), naming `base_model` (the
        model directory or Hub id they go on): peft.PeftModel.from_pretrained loads them onto transformers' model."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        settings = self.adapter_settings
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
                  "r": settings["rank"], "lora_alpha": settings["alpha"], "target_modules": sorted(settings["layers"]),
                  "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
                  "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}
        (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in self.adapter_tensors().items()}
        save_file(tensors, out_dir / ADAPTER_WEIGHTS, metadata={"format": "pt"})

    def load_adapter(self, adapter_dir) -> None:
        """Adapters saved by save_adapter (or PEFT, without bias or dropout) into this model's, which add_adapters
        made with the same settings."""
        adapter_dir = Path(adapter_dir)
        saved = read_adapter_config(adapter_dir)
        settings = self.adapter_settings or {}
        if not settings or (saved["r"], saved["lora_alpha"], sorted(saved["target_modules"])) != (
                settings["rank"], settings["alpha"], sorted(settings["layers"])):
            raise ValueError(f"{adapter_dir}: rank {saved['r']}, alpha {saved['lora_alpha']}, layers "
                             f"{sorted(saved['target_modules'])}; this model's adapters: {settings or 'none'}")
        own = self.adapter_tensors()
        with safe_open(adapter_dir / ADAPTER_WEIGHTS, framework="pt", device="cpu") as handle:
            if set(handle.keys()) != own.keys():
                raise ValueError(f"{adapter_dir / ADAPTER_WEIGHTS}: its tensors are not this model's adapters "
                                 f"(e.g. {sorted(set(handle.keys()) ^ own.keys())[:3]})")
            with torch.no_grad():
                for name, tensor in own.items():
                    tensor.copy_(handle.get_tensor(name))

    def new_kv_cache(self, batch_size: int, max_seq_len: int) -> KVCache:
        weight = self.embed_tokens.weight
        return KVCache.empty(self.config, batch_size, max_seq_len, weight.device, weight.dtype)

    @classmethod
    def from_pretrained(cls, model_dir, device="cpu", dtype: torch.dtype = torch.bfloat16) -> "Transformer":
        model_dir = Path(model_dir)
        hf_config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
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
                f"{model_dir}: weights do not match a {hf_config['model_type']} model of this config.json "
                f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}).{weights_hint(hf_config, missing)}"
            )
        model.load_state_dict(state, strict=False, assign=True)
        model.tie_weights()
        return model

    def save_pretrained(self, out_dir, max_shard_bytes: int = 5 * 1024**3) -> None:
        """Write config.json and safetensors (sharded above max_shard_bytes) in the Hugging Face layout; adapters
        merged into their weights (save_adapter writes them alone)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        dtype = self.embed_tokens.weight.dtype
        # transformers >= 5 writes "dtype", older versions "torch_dtype": keep the layout the config came in.
        dtype_key = "dtype" if "dtype" in self.hf_config else "torch_dtype"
        hf_config = self.hf_config | {dtype_key: str(dtype).removeprefix("torch.")}
        (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        merged = {f"{name}.weight": layer.merged_weight() for name, layer in self.adapted_layers().items()}
        tensors = {
            hf_name(name): merged.get(name, tensor).detach().to("cpu").contiguous()
            for name, tensor in self.state_dict().items()
            if not (self.config.tie_word_embeddings and name == "lm_head.weight") and ".lora_" not in name
        }
        write_safetensors(tensors, out_dir, max_shard_bytes)


PEFT_PREFIX = "base_model.model."  # PeftModel's names for the wrapped transformers model's weights


def read_adapter_config(adapter_dir) -> dict:
    """A PEFT LoRA adapter's adapter_config.json; what this model cannot compute is refused by name."""
    config = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    problems = [f"{key}={config.get(key)!r}" for key, allowed in (("peft_type", "LORA"), ("bias", "none"),
                ("use_rslora", False), ("use_dora", False)) if config.get(key, allowed) != allowed]
    target = config.get("target_modules")
    if not isinstance(target, list) or not set(target) <= set(ADAPTER_LAYERS):
        problems.append(f"target_modules={target!r} (this model adapts {', '.join(ADAPTER_LAYERS)})")
    if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("layers_to_transform") is not None:
        problems.append("a rank, alpha or layer pattern (one rank and alpha for all layers here)")
    if problems:
        raise ValueError(f"{adapter_dir}: a LoRA adapter this model cannot load: {'; '.join(problems)}")
    return config


class WithoutAdapters:
    """Calls a model with its LoRA adapters off: the base model they train beside, for no memory of its own (the
    KL reference of a LoRA run)."""

    def __init__(self, model: Transformer):
        self.model = model

    def __call__(self, *args, **kwargs):
        with self.model.adapters_disabled():
            return self.model(*args, **kwargs)


def weights_hint(hf_config: dict, missing: set[str]) -> str:
    if hf_config["model_type"] == "qwen2" and any(name.endswith("q_proj.bias") for name in missing):
        return (" Qwen2 always has q/k/v biases (transformers' Qwen2ForCausalLM too); a checkpoint without them "
                "is Llama-architecture: set model_type to llama and architectures to [LlamaForCausalLM].")
    return ""


def hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def safetensors_files(model_dir: Path) -> list[Path]:
    """model.safetensors, or the shards model.safetensors.index.json lists."""
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file():
        return [model_dir / "model.safetensors"]
    return [model_dir / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]


def load_safetensors(model_dir: Path, device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = {}
    for file in safetensors_files(model_dir):
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
        norm_weights = {id(module.weight) for module in model.modules() if isinstance(module, RMSNorm)}
        for name, param in model.named_parameters():
            if id(param) in norm_weights:
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                scale = std / math.sqrt(2 * model.config.num_hidden_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
