"""Device memory plan for GRPO on Qwen2.5-3B under config.yaml and config_24GB.yaml, from arithmetic.

Training alternates three phases, and the device must hold the largest of them:
  rollout    weights (+ AdamW moments unless offloaded) + the KV cache of every episode being sampled
  update     weights + gradients (+ moments) + checkpointed activations + one logits chunk
  optimizer  weights + gradients (+ moments + torch's foreach temporaries) while AdamW steps
Gradients do not exist during rollout: the update ends with zero_grad(set_to_none=True).
Not counted: the CUDA context and allocator fragmentation (typically 0.5-1.5 GB together).

    uv run python -m bench.memory_plan [--configs config.yaml config_24GB.yaml]
"""

import argparse
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also run as a file: uv run bench/memory_plan.py

from bench.report import emit_json
from qwen2_model import ModelConfig, Transformer

REPO_ROOT = Path(__file__).resolve().parents[1]
QWEN25_3B = ModelConfig(
    vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
    num_attention_heads=16, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=True,
)
GB = 1e9


def parameter_count(config: ModelConfig) -> int:
    """Exact, from the model itself built on the meta device (the tied head counted once)."""
    with torch.device("meta"):
        return sum(param.numel() for param in Transformer(config).parameters())


def block_activation_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    """What autograd keeps for one decoder block's backward, per token.

    Model dtype: both norms' outputs, q before and after rotary, the rotated half, attention output,
    o_proj input (7 x hidden); k and v before and after rotary (4 x kv width); gate, up, silu(gate)
    and their product (4 x intermediate). float32: both RMSNorms' upcast inputs (2 x hidden).
    """
    kv_width = config.num_key_value_heads * config.head_dim
    model_dtype = 7 * config.hidden_size + 4 * kv_width + 4 * config.intermediate_size
    return model_dtype * dtype_bytes + 2 * config.hidden_size * 4


def plan(config: ModelConfig, settings: dict) -> dict:
    dtype_bytes = torch.empty((), dtype=getattr(torch, settings["model"]["dtype"])).element_size()
    rollout, optim = settings["rollout"], settings["optim"]
    offloaded = optim["memory_efficient_adamw"]
    num_params = parameter_count(config)
    weights = num_params * dtype_bytes
    gradients = num_params * dtype_bytes
    # Not offloaded, the optimizer is torch's AdamW math on the device, moments in the parameters' dtype.
    moments = 0 if offloaded else 2 * num_params * dtype_bytes
    # torch's foreach AdamW builds sqrt(exp_avg_sq) for all parameters at once before its update.
    optimizer_temporaries = 0 if offloaded else num_params * dtype_bytes

    seq_len = rollout["max_prompt_len"] + rollout["max_gen_len"]
    tokens = optim["micro_batch_size"] * seq_len
    hidden_bytes = tokens * config.hidden_size * dtype_bytes
    block_bytes = tokens * block_activation_bytes_per_token(config, dtype_bytes)
    if settings["model"]["gradient_checkpointing"]:
        # Each block's input is kept; in backward one block is recomputed and its gradients live beside it.
        activations = config.num_hidden_layers * hidden_bytes + 2 * block_bytes
    else:
        activations = config.num_hidden_layers * block_bytes + block_bytes
    activations += tokens * config.hidden_size * (dtype_bytes + 4)  # final norm output and its fp32 input
    # A chunk's backward holds three fp32 [batch, chunk, vocab] tensors (saved log-softmax, incoming
    # gradient, result); bench/update.py measures the same slope.
    logits_chunk = 3 * optim["micro_batch_size"] * optim["logprob_chunk_size"] * config.vocab_size * 4

    rows = rollout["episodes_per_step"]
    questions = rows // rollout["num_answers_per_question"]
    cache_bytes_per_slot = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * dtype_bytes
    cache_len = seq_len - 1  # the last sampled token is never fed back
    kv_cache = rows * cache_len * cache_bytes_per_slot
    # Each question is prefilled once into a prompt-wide cache, which lives beside the episodes' cache
    # while it is copied there.
    prefill_cache = questions * rollout["max_prompt_len"] * cache_bytes_per_slot
    # Per step: logits (model dtype), probabilities and their CDF in fp32; top-p adds a sort (values, int64 ids).
    sampling = rows * config.vocab_size * (dtype_bytes + 4 + 4 + (12 if rollout["top_p"] < 1 else 0))

    components = dict(
        weights=weights, gradients=gradients, adamw_moments=moments, adamw_step_temporaries=optimizer_temporaries,
        activations=activations, logits_chunk=logits_chunk, kv_cache=kv_cache, prefill_cache=prefill_cache,
        sampling=sampling,
    )
    phases = dict(
        rollout=weights + moments + kv_cache + prefill_cache + sampling,
        update=weights + gradients + moments + activations + logits_chunk,
        optimizer=weights + gradients + moments + optimizer_temporaries,
    )
    host = dict(adamw_moments_fp32_in_cpu_ram=2 * num_params * 4 if offloaded else 0)
    return dict(
        parameters=num_params, dtype_bytes=dtype_bytes, rollout_rows=rows, cache_len=cache_len,
        micro_batch_tokens=tokens, components=components, phases=phases, peak=max(phases.values()),
        peak_phase=max(phases, key=phases.get), host=host,
    )


def print_table(plans: dict) -> None:
    names = list(plans)
    first = plans[names[0]]
    print(
        f"Qwen2.5-3B: {first['parameters'] / 1e9:.3f}e9 parameters; {first['rollout_rows']} episodes x {first['cache_len']} "
        f"cache slots in rollout; update micro-batch {first['micro_batch_tokens']} tokens. GB = 1e9 bytes."
    )
    print("| component | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    rows = [(name, "components") for name in first["components"]] + [(name, "phases") for name in first["phases"]]
    for name, section in rows:
        label = name if section == "components" else f"**{name} phase**"
        print(f"| {label} | " + " | ".join(f"{plans[c][section][name] / GB:.2f}" for c in names) + " |")
    print("| **peak (device)** | " + " | ".join(f"**{plans[c]['peak'] / GB:.2f}** ({plans[c]['peak_phase']})" for c in names) + " |")
    print("| host RAM: AdamW moments | " + " | ".join(f"{plans[c]['host']['adamw_moments_fp32_in_cpu_ram'] / GB:.2f}" for c in names) + " |")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", type=Path, default=[REPO_ROOT / "config.yaml", REPO_ROOT / "config_24GB.yaml"])
    parser.add_argument("--json-out", type=Path, help="also write the JSON report here")
    args = parser.parse_args(argv)
    plans = {path.name: plan(QWEN25_3B, yaml.safe_load(path.read_text())) for path in args.configs}
    print_table(plans)
    emit_json(plans, args.json_out)
    return plans


if __name__ == "__main__":
    main()
