"""Device memory plan for GRPO on Qwen2.5-3B under config.yaml, config_24GB.yaml and LoRA, from arithmetic.

Training alternates three phases, and the device must hold the largest of them:
  rollout    weights (+ AdamW moments unless offloaded) + what generation holds, in three moments: the prompts'
             prefill, their cache's copy to the answers' rows, and decoding (rollout_plan lists every buffer)
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
CUDA_RESERVE = 1.0 * GB  # the CUDA context and the allocator's fragmentation: not buffers of ours, typically 0.5-1.5 GB


def card_bytes(config_name: str) -> float:
    """The card a config is written for: config_24GB.yaml's (and its overlays') 24 GB, else an A40's 48 GB."""
    return (24 if "24GB" in config_name else 48) * GB


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


def decode_rows(settings: dict) -> int:
    """Answers decoded at once: a round's (a step's, or dynamic sampling's round), at most max_decode_rows."""
    rollout = settings["rollout"]
    questions = rollout["episodes_per_step"] // rollout["num_answers_per_question"]
    if rollout["dynamic_sampling"] and rollout["dynamic_sampling_questions_per_round"]:
        questions = rollout["dynamic_sampling_questions_per_round"]
    rows = questions * rollout["num_answers_per_question"]
    return min(rows, rollout["max_decode_rows"] or rows)


def rollout_plan(config: ModelConfig, settings: dict, dtype_bytes: int) -> dict[str, int]:
    """Every buffer a rollout holds beside the weights (generation.py), in bytes, for one batch of decode_rows:

    prefill_cache        the prompts' own cache (one row per question), until copied to the answers' rows
    prefill_activations  one block's forward over every prompt token (the blocks run one after another)
    kv_cache             the answers' cache: rows x (prompt + answer - 1) slots x layers x (k, v)
    token_buffers        the sampled ids (int64), their log-probs and entropies, and the uniforms: rows x answer
    decode_step          one block's activations for a token per row, the tiled attention mask and its bias
    sampling             the step's logits (model dtype), log-probs and probabilities (float32; the CDF is per
                         block and one block per row: small); top_p < 1
                         adds a sort (values, int64 ids) and the truncated copy
    cache_compaction     the rows that move when finished rows leave, one layer's k or v at a time
    """
    rollout = settings["rollout"]
    rows = decode_rows(settings)
    questions = rows // rollout["num_answers_per_question"]
    kv_width = config.num_key_value_heads * config.head_dim
    slot_bytes = config.num_hidden_layers * 2 * kv_width * dtype_bytes
    cache_len = rollout["max_prompt_len"] + rollout["max_gen_len"] - 1  # the last sampled token is never fed back
    # Per token in one block: the residual, norm output, q, attention output and o_proj's (5 x hidden), k and v
    # (2 x kv width), gate, up and their product (3 x intermediate); the norm's float32 input.
    block_token_bytes = ((5 * config.hidden_size + 2 * kv_width + 3 * config.intermediate_size) * dtype_bytes
                         + 4 * config.hidden_size)
    prompt_tokens = questions * rollout["max_prompt_len"]
    groups = config.num_attention_heads // config.num_key_value_heads
    top_p_bytes = 4 + 8 + 4 if rollout["top_p"] < 1 else 0
    return dict(
        prefill_cache=prompt_tokens * slot_bytes,
        prefill_activations=prompt_tokens * block_token_bytes + questions * config.vocab_size * dtype_bytes,
        kv_cache=rows * cache_len * slot_bytes,
        token_buffers=rows * rollout["max_gen_len"] * (8 + 4 + 4 + 4),
        decode_step=rows * block_token_bytes + rows * groups * cache_len * (1 + dtype_bytes),
        sampling=rows * config.vocab_size * (dtype_bytes + 4 + 4 + top_p_bytes),
        cache_compaction=rows * cache_len * kv_width * dtype_bytes,
    )


def plan(config: ModelConfig, settings: dict) -> dict:
    dtype_bytes = torch.empty((), dtype=getattr(torch, settings["model"]["dtype"])).element_size()
    rollout, optim = settings["rollout"], settings["optim"]
    offloaded = optim["memory_efficient_adamw"]
    num_params, trainable = parameter_counts(config, settings["model"]["lora"])
    lora = bool(settings["model"]["lora"]["rank"])
    trained_bytes = 4 if lora else dtype_bytes  # adapters are float32
    weights = (num_params - trainable) * dtype_bytes + trainable * trained_bytes if lora else num_params * dtype_bytes
    # Master weights (optimizer.py): a float32 copy of each trained weight below float32, moments in float32, and
    # the gradients summed in float32 buffers, each micro-batch's bf16 gradient freed as backward computes it
    # (at most one weight's at a time: the largest, the embedding). Else moments and gradients in the weights' dtype.
    master = trained_bytes < 4 and optim["master_weights"] == "float32"
    state_bytes = 4 if master else trained_bytes
    master_weights = trainable * 4 if master else 0
    gradients = trainable * state_bytes + (config.vocab_size * config.hidden_size * dtype_bytes if master else 0)
    # Offloaded, moments and master copies live in CPU memory (host below); else on the device.
    moments = 0 if offloaded else 2 * trainable * state_bytes
    device_masters = 0 if offloaded else master_weights
    # torch's foreach AdamW builds sqrt(exp_avg_sq) for all parameters at once before its update.
    optimizer_temporaries = 0 if offloaded else trainable * state_bytes

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

    rollout_buffers = rollout_plan(config, settings, dtype_bytes)
    components = dict(
        weights=weights, master_weights=device_masters, gradients=gradients, adamw_moments=moments,
        adamw_step_temporaries=optimizer_temporaries, activations=activations, logits_chunk=logits_chunk,
        **rollout_buffers,
    )
    # Gradients are freed after each update (zero_grad(set_to_none=True)); masters and moments stay.
    resident = weights + device_masters + moments
    phases = dict(
        prefill=resident + rollout_buffers["prefill_cache"] + rollout_buffers["prefill_activations"],
        cache_copy=resident + rollout_buffers["prefill_cache"] + rollout_buffers["kv_cache"],
        decode=resident + rollout_buffers["kv_cache"] + rollout_buffers["token_buffers"] + rollout_buffers["decode_step"]
        + max(rollout_buffers["sampling"], rollout_buffers["cache_compaction"]),
        update=resident + gradients + activations + logits_chunk,
        optimizer=resident + gradients + optimizer_temporaries,
    )
    rows, cache_len = decode_rows(settings), seq_len - 1
    host = dict(adamw_moments_fp32_in_cpu_ram=2 * trainable * 4 if offloaded else 0,
                master_weights_in_cpu_ram=master_weights if offloaded else 0)
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
    print("| host RAM: master weights | " + " | ".join(f"{plans[c]['host']['master_weights_in_cpu_ram'] / GB:.2f}" for c in names) + " |")
    print("| **headroom** | " + " | ".join(f"**{plans[c]['headroom'] / GB:.2f}** of {plans[c]['card'] / GB:.0f}"
                                          for c in names) + " |")
    print(f"\nheadroom: the card's bytes less {CUDA_RESERVE / GB:.1f} GB (CUDA context, allocator slack) and the peak.")


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
        plans[name] |= {"card": card_bytes(name), "headroom": card_bytes(name) - CUDA_RESERVE - plans[name]["peak"]}
    print_table(plans)
    emit_json(plans, args.json_out)
    return plans


if __name__ == "__main__":
    main()
