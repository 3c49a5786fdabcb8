"""Device memory plan for GRPO on Qwen2.5-3B under config.yaml, config_24GB.yaml and LoRA, from arithmetic.

Training alternates three phases, and the device must hold the largest of them:
  rollout    weights (+ AdamW moments unless offloaded) + the KV cache of every episode being sampled
  update     weights + gradients (+ moments) + checkpointed activations + one logits chunk
  optimizer  weights + gradients (+ moments + torch's foreach temporaries) while AdamW steps
Gradients do not exist during rollout: the update ends with zero_grad(set_to_none=True). With model.lora only
the adapters (float32) have gradients and moments; the frozen weights have neither.
Not counted: the CUDA context and allocator fragmentation (typically 0.5-1.5 GB together).

    uv run python -m bench.memory_plan [--configs config.yaml config_24GB.yaml config_24GB.yaml+configs/lora.yaml]

A config written A+B is B merged over A, as `train.py --config A --config B` reads it.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also run as a file: uv run bench/memory_plan.py

import config as config_lib  # noqa: E402
from bench.report import emit_json  # noqa: E402
from qwen2_model import ModelConfig, Transformer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
QWEN25_3B = ModelConfig(
    vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
    num_attention_heads=16, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=True,
)
GB = 1e9


def parameter_counts(config: ModelConfig, lora: dict) -> tuple[int, int]:
    """(all, trainable) weights, exact, from the model itself built on the meta device (the tied head counted once),
    with its LoRA adapters when model.lora has a rank (then only they train)."""
    with torch.device("meta"):
        model = Transformer(config)
        if lora["rank"]:
            model.add_adapters(lora["rank"], lora["alpha"], lora["layers"])
    parameters = list(model.parameters())
    return sum(p.numel() for p in parameters), sum(p.numel() for p in parameters if p.requires_grad)


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
    num_params, trainable = parameter_counts(config, settings["model"]["lora"])
    lora = bool(settings["model"]["lora"]["rank"])
    trained_bytes = 4 if lora else dtype_bytes  # adapters are float32
    weights = (num_params - trainable) * dtype_bytes + trainable * trained_bytes if lora else num_params * dtype_bytes
    gradients = trainable * trained_bytes
    # Not offloaded, the optimizer is torch's AdamW math on the device, moments in the parameters' dtype.
    moments = 0 if offloaded else 2 * trainable * trained_bytes
    # torch's foreach AdamW builds sqrt(exp_avg_sq) for all parameters at once before its update.
    optimizer_temporaries = 0 if offloaded else trainable * trained_bytes

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
    host = dict(adamw_moments_fp32_in_cpu_ram=2 * trainable * 4 if offloaded else 0)
    return dict(
        parameters=num_params, trainable_parameters=trainable, dtype_bytes=dtype_bytes, rollout_rows=rows, cache_len=cache_len,
        micro_batch_tokens=tokens, components=components, phases=phases, peak=max(phases.values()),
        peak_phase=max(phases, key=phases.get), host=host,
    )


def print_table(plans: dict) -> None:
    names = list(plans)
    first = plans[names[0]]
    print(
        f"Qwen2.5-3B: {first['parameters'] / 1e9:.3f}e9 parameters (trained: " + ", ".join(
            f"{name} {plans[name]['trainable_parameters'] / 1e6:,.1f}M" for name in names) +
        f"); {first['rollout_rows']} episodes x {first['cache_len']} "
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
    parser.add_argument("--configs", nargs="+", default=["config.yaml", "config_24GB.yaml",
                                                         "config_24GB.yaml+configs/lora.yaml"],
                        help="config files (from the repository root), A+B for B merged over A")
    parser.add_argument("--json-out", type=Path, help="also write the JSON report here")
    args = parser.parse_args(argv)
    plans = {}
    for name in args.configs:
        config = config_lib.load(config_lib.TrainConfig, [REPO_ROOT / part for part in name.split("+")])
        plans[name] = plan(QWEN25_3B, config_lib.to_dict(config))
    print_table(plans)
    emit_json(plans, args.json_out)
    return plans


if __name__ == "__main__":
    main()
