"""The first thing to run on a GPU: one table of what no CPU can check (bench/gpu.sh runs it, <= 10 minutes).

    uv run python -m bench.gpu_check [--model DIR] [--smollm2 DIR] [--out DIR]
    uv run python -m bench.gpu_check --dry-run      # the same checks on the CPU at toy sizes: the wiring

1. bf16 parity: our model and transformers' on the same weights in bf16 on the device: the largest logit
   difference and how often their top tokens agree, beside ours in bf16 against ours in fp32.
2. Attention backend: which SDPA kernel each of the model's attention calls runs (flash, memory-efficient,
   cuDNN or the math fallback, which repeats K and V per query head): the causal training forward, the decode
   step over the cache and the update's rows over their shared prompt (qwen2_model.masked_grouped_attention).
3. Decode: tokens/s of generate() (eager, 64 rows) and the memory bandwidth it reaches (weights + the cache
   read per step), as a fraction of what a device-to-device copy reaches on this card.
4. Update memory: the peak of one update micro-batch in config_24GB.yaml's shape (2 x 1280 tokens, checkpointed
   blocks, 128-position vocabulary chunks) against bench/memory_plan.py's arithmetic for this model.
5. The offloaded AdamW step (config_24GB.yaml's) over this model's weights: seconds, and the PCIe rate it reaches.
6. GRPO: 20 steps of the SmolLM2 recipe in bf16 with config_24GB.yaml's optimizer (float32 master weights and
   AdamW's moments in CPU memory): step seconds, finite losses, the device's peak memory.
--model: the model of checks 1-5 (default: random weights of the Qwen2.5-0.5B shape); --smollm2: the
SmolLM2-135M-Instruct directory of check 6 (../shared/tools/make_smollm2.sh writes one; default: skipped).
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also run as a file: uv run bench/gpu_check.py

import config as config_lib  # noqa: E402
from bench import memory_plan  # noqa: E402
from bench.rollout import load_model  # noqa: E402
from generation import generate  # noqa: E402
from logprobs import answer_batch, answer_log_probs  # noqa: E402
from qwen2_model import Transformer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SDPA_KERNELS = {"flash": "flash", "efficient": "memory-efficient", "cudnn": "cuDNN", "math": "math (K, V repeated)"}


def bf16_parity(model_dir: Path, device: torch.device, sizes: dict) -> dict:
    """Ours against transformers' on the same bf16 weights, and ours bf16 against ours fp32."""
    from transformers import AutoModelForCausalLM

    ours = Transformer.from_pretrained(model_dir, device=device, dtype=torch.bfloat16).eval()
    ours_fp32 = Transformer.from_pretrained(model_dir, device=device, dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    tokens = torch.randint(0, ours.config.vocab_size, (4, sizes["parity_len"]),
                           generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        logits, reference, fp32 = ours(tokens).float(), theirs(tokens).logits.float(), ours_fp32(tokens)
    return {"max_abs_logit_diff_vs_transformers": (logits - reference).abs().max().item(),
            "top1_agreement_vs_transformers": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
            "max_abs_logit_diff_bf16_vs_fp32": (logits - fp32).abs().max().item()}


def sdpa_kernels(function) -> list[str]:
    """The SDPA kernels one call of `function` runs, by the aten ops the profiler records."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as recorded, torch.no_grad():
        function()
    names = {event.name for event in recorded.events()}
    found = [label for key, label in SDPA_KERNELS.items()
             if any(name.startswith("aten::_scaled_dot_product") and key in name for name in names)]
    return found or ["none recorded"]


def attention_backends(model: Transformer, device: torch.device, sizes: dict) -> dict:
    vocab, prompt, rows = model.config.vocab_size, sizes["prompt_len"], sizes["decode_rows"]
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (2, prompt), generator=generator).to(device)
    cache = model.new_kv_cache(rows, prompt + 8)
    positions = torch.full((rows, 1), prompt, device=device)
    step_tokens = torch.randint(0, vocab, (rows, 1), generator=generator).to(device)
    shared = torch.randint(0, vocab, (prompt,), generator=generator).tolist()
    sequences = [shared + torch.randint(0, vocab, (32,), generator=generator).tolist() for _ in range(8)]
    batch = answer_batch(sequences, [prompt] * 8, 0, device)
    return {"causal forward (training, no mask)": sdpa_kernels(lambda: model(tokens)),
            "decode step over the cache (mask, grouped heads)": sdpa_kernels(
                lambda: model(step_tokens, positions, cache, logits_at=torch.zeros(rows, dtype=torch.long, device=device))),
            "update rows over their shared prompt (mask, grouped heads)": sdpa_kernels(
                lambda: answer_log_probs(model, batch, 64, with_entropy=False))}


def copy_bandwidth(device: torch.device, megabytes: int) -> float:
    """GB/s of a device-to-device copy (read + write): what streaming memory reaches on this device."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(5):
        target.copy_(source)
    synchronize(device)
    return 2 * 5 * source.numel() / (time.perf_counter() - start) / 1e9


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_speed(model: Transformer, device: torch.device, sizes: dict) -> dict:
    rows, prompt, new = sizes["decode_rows"], sizes["prompt_len"], sizes["decode_tokens"]
    prompts = [torch.randint(0, model.config.vocab_size, (prompt,), generator=torch.Generator().manual_seed(row)).tolist()
               for row in range(rows)]
    run = lambda: generate(model, prompts, num_samples_per_prompt=1, max_gen_len=new, eos_token_id=-1,
                           temperature=1.0, generator=torch.Generator(device=device).manual_seed(0))
    run()  # warm-up
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    seconds = time.perf_counter() - start
    weights = sum(param.numel() * param.element_size() for param in model.parameters())
    slot_bytes = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * model.config.head_dim * 2
    cache_read = rows * (prompt + new / 2) * slot_bytes  # the average step reads half the answers' slots
    achieved = new * (weights + cache_read) / seconds / 1e9
    copy = copy_bandwidth(device, sizes["copy_megabytes"])
    return {"tokens_per_second": rows * new / seconds, "bandwidth_gb_per_s": achieved, "copy_gb_per_s": copy,
            "fraction_of_copy_bandwidth": achieved / copy}


def update_memory(model: Transformer, device: torch.device, sizes: dict) -> dict:
    """One micro-batch's forward and backward in config_24GB.yaml's update shape, against memory_plan's count."""
    settings = config_lib.to_dict(config_lib.load(config_lib.TrainConfig, [REPO / "config_24GB.yaml"]))
    settings["optim"]["micro_batch_size"], settings["rollout"]["max_gen_len"] = 2, sizes["answer_len"]
    settings["rollout"]["max_prompt_len"] = sizes["prompt_len"]
    model.gradient_checkpointing = True
    model.train()
    length = sizes["prompt_len"] + sizes["answer_len"]
    sequences = [torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(row)).tolist()
                 for row in range(2)]
    batch = answer_batch(sequences, [sizes["prompt_len"]] * 2, 0, device)
    planned = memory_plan.plan(model.config, settings)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    log_probs, _ = answer_log_probs(model, batch, settings["optim"]["logprob_chunk_size"])
    log_probs.sum().backward()
    model.zero_grad(set_to_none=True)
    model.eval()
    measured = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
    # A plain backward: the weights' bf16 gradients, then the plan's activations and one vocabulary chunk.
    planned = (sum(param.numel() * param.element_size() for param in model.parameters())
               + planned["components"]["activations"] + planned["components"]["logits_chunk"])
    return {"measured peak beyond the weights (bytes)": measured, "planned (bytes)": planned,
            "measured / planned": measured / planned if measured else None}


def offloaded_step(model: Transformer, device: torch.device) -> dict:
    """config_24GB.yaml's optimizer step over this model's weights: float32 gradient sums on the device, masters
    and moments in CPU memory, pieces copied in and out while the one before is updated."""
    from bench.optimizer_step import timed_step
    from optimizer import MemoryEfficientAdamW

    params = [torch.nn.Parameter(param.detach().clone()) for param in model.parameters()]
    gradients = [torch.randn_like(param, dtype=torch.float32) * 1e-3 for param in params]
    optimizer = MemoryEfficientAdamW(params, lr=1e-5, enabled=True, master_weights=True)
    timed_step(optimizer, params, gradients)  # creates the state
    synchronize(device)
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        timed_step(optimizer, params, gradients)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    count = sum(param.numel() for param in params)
    return {"weights": count, "seconds_per_step": min(seconds),
            "gradients_in_and_weights_out_gb_per_s": (4 + 2) * count / min(seconds) / 1e9}


def grpo_steps(smollm2: Path | None, device: torch.device, sizes: dict, work: Path) -> dict:
    if smollm2 is None:
        return {"skipped": "no --smollm2 directory (../shared/tools/make_smollm2.sh OUT . writes one)"}
    import train

    overrides = [f"device={device.type}", "model.dtype=bfloat16", "optim.memory_efficient_adamw=true",
                 "optim.master_weights=float32", f"optim.num_steps={sizes['grpo_steps']}", "checkpoint.interval=0",
                 f"task.data_dir={work / 'countdown'}", f"bootstrap.data_dir={work / 'countdown'}",
                 f"model.dir={work / 'sft-model'}", f"bootstrap.model_dir={work / 'sft-model'}",
                 f"bootstrap.sft_overrides=[model.dir={smollm2}, device={device.type}, 'logging.log_dir={work / 'logs'}', "
                 f"'checkpoint.dir={work / 'checkpoints'}']",
                 f"logging.log_dir={work / 'logs'}", f"checkpoint.dir={work / 'checkpoints'}", "run_name=gpu-check",
                 "progress=false", *sizes["grpo_overrides"]]
    config = config_lib.load(config_lib.TrainConfig, [REPO / "configs" / "smollm2_cpu.yaml"], overrides)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    train.train(config)
    seconds = time.perf_counter() - start
    from bench.plot_curves import read_scalars

    scalars = read_scalars(str(work / "logs" / "gpu-check"))
    losses = scalars.get("train/loss", ([], []))[1]
    rollout = scalars.get("time/rollout_seconds", ([], []))[1]
    update = scalars.get("train/update_seconds", ([], []))[1]
    return {"steps": len(scalars.get("reward/mean", ([], []))[0]), "seconds_with_warm_up": seconds,
            "mean_rollout_seconds": sum(rollout) / max(len(rollout), 1),
            "mean_update_seconds": sum(update) / max(len(update), 1),
            "losses_finite": all(value == value and abs(value) != float("inf") for value in losses),
            "last_train_success": scalars.get("train/success_rate", ([], [0.0]))[1][-1],
            "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}


SIZES = {  # the real run, and the dry run on a CPU
    "gpu": dict(parity_len=256, prompt_len=128, decode_rows=64, decode_tokens=256, copy_megabytes=1024,
                answer_len=1024, grpo_steps=20, grpo_overrides=[]),
    "dry": dict(parity_len=16, prompt_len=16, decode_rows=4, decode_tokens=8, copy_megabytes=8, answer_len=16,
                grpo_steps=2, grpo_overrides=["rollout.episodes_per_step=8", "rollout.max_gen_len=8",
                                              "bootstrap.dataset_args=--size 80 --min-numbers 3 --max-numbers 3 "
                                              "--with-solutions", "task.test_size=8"]),
}


def table(report: dict) -> str:
    lines = ["| check | result |", "|---|---|"]
    for check, values in report["checks"].items():
        for key, value in values.items():
            shown = f"{value:.4g}" if isinstance(value, float) else ", ".join(value) if isinstance(value, list) else value
            lines.append(f"| {check}: {key} | {shown} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory for checks 1-5 (default: random Qwen2.5-0.5B-shape weights)")
    parser.add_argument("--smollm2", type=Path, help="SmolLM2-135M-Instruct's directory, for check 6")
    parser.add_argument("--out", type=Path, help="write gpu_check.json and gpu_check.md here")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU at toy sizes")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device is usable here (--dry-run runs the checks on the CPU at toy sizes)")
    device = torch.device("cpu" if args.dry_run else "cuda")
    sizes = SIZES["dry" if args.dry_run else "gpu"]
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        model_dir = Path(args.model) if args.model else work / "model"
        if not args.model:  # the shape's random weights, written once so that transformers reads the same ones
            load_model("tiny" if args.dry_run else "qwen2.5-0.5b", torch.device("cpu"), torch.float32).save_pretrained(model_dir)
        model = Transformer.from_pretrained(model_dir, device=device, dtype=torch.bfloat16).eval()
        checks = {}
        for name, run in (("bf16 parity", lambda: bf16_parity(model_dir, device, sizes)),
                          ("attention backend", lambda: attention_backends(model, device, sizes)),
                          ("decode", lambda: decode_speed(model, device, sizes)),
                          ("update memory", lambda: update_memory(model, device, sizes)),
                          ("offloaded AdamW step", lambda: offloaded_step(model, device)),
                          ("GRPO (SmolLM2, bf16, config_24GB optimizer)",
                           lambda: grpo_steps(args.smollm2, device, sizes, work / "grpo"))):
            start = time.perf_counter()
            try:
                checks[name] = run()
            except Exception as error:  # one failing check still leaves the others' results
                checks[name] = {"failed": f"{type(error).__name__}: {error}"}
            checks[name]["seconds"] = time.perf_counter() - start
            print(f"{name}: {json.dumps(checks[name])}", file=sys.stderr, flush=True)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
              "torch": torch.__version__, "cuda": torch.version.cuda, "model": args.model or "random Qwen2.5-0.5B shape",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "checks": checks}
    print(table(report))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "gpu_check.md").write_text(table(report) + "\n")
    return report


if __name__ == "__main__":
    main()
