"""Policy-update step: chunked, checkpointed log-probs (logprobs.py) vs full vocabulary logits.

One forward + backward of GRPO's token-level loss on a micro-batch (default 2 x 1280 tokens, the
151,936-token Qwen vocabulary). A small model body keeps the CPU run short while the vocabulary
projection, the part this measures, has its real size. Each variant runs in its own process so its
peak memory is its own (peak RSS on CPU, torch.cuda.max_memory_allocated on CUDA); the parent then
checks that both produced the same loss and gradients.

    uv run python -m bench.update
    uv run python -m bench.update --model qwen2.5-0.5b --device cuda --dtype bfloat16

--host-reads times grpo.update_policy itself on GRPO-shaped episodes (random tokens, groups of 8 with a
reward spread), in interleaved rounds, as shipped (the step's sums stay on the device and are read
once) and with one host read per micro-batch, as it was before: a forward hook reads a scalar of
each micro-batch's output, the wait that `loss.item()` per micro-batch used to cause. On a CPU a read
costs nothing (there is no queue to drain); on a GPU it stalls the host until the device catches up.

    uv run python -m bench.update --host-reads --model tiny
"""

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also run as a file: uv run bench/update.py

from bench.report import emit_json
from bench.rollout import SHAPES
from config import LossConfig, OptimConfig
from data_types import Episode
from distributed import OptimizerStep
from grpo import compute_advantages, update_policy
from logprobs import token_log_probs
from optimizer import new_adamw
from qwen2_model import ModelConfig, Transformer, init_weights

MODEL_SHAPES = SHAPES | {
    "small-body": dict(
        vocab_size=151936, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=True,
    ),
}
FULL = "full logits"
FULL_LOGITS_CHUNK_SIZE = 0  # how the parent asks a subprocess for the full-logits variant


def full_logits_log_probs(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """The straightforward computation: all [B, T, vocab] logits, in fp32, kept for backward."""
    log_probs = model(tokens)[:, :-1].float().log_softmax(-1)
    return log_probs.gather(-1, tokens[:, 1:, None]).squeeze(-1)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_variant(args) -> dict:
    """Build the seeded model and batch, run one update step, save loss and gradients to args.result."""
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = Transformer(ModelConfig(**MODEL_SHAPES[args.model]))
    init_weights(model, seed=args.seed)
    model = model.to(device=device, dtype=getattr(torch, args.dtype)).train()
    model.gradient_checkpointing = True
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len), generator=generator).to(device)
    advantages = torch.randn(args.batch_size, 1, generator=generator).to(device)
    # Prompt positions carry no loss, as in GRPO: the mask covers the completion part only.
    mask = torch.zeros(args.batch_size, args.seq_len - 1, device=device)
    mask[:, args.prompt_len - 1 :] = 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    memory_before = peak_memory_bytes(device)
    for _ in range(2):  # time the second step: the first also pays one-off allocator and kernel set-up
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        if args.run_chunk_size == FULL_LOGITS_CHUNK_SIZE:
            log_probs = full_logits_log_probs(model, tokens)
        else:
            log_probs, _ = token_log_probs(model, tokens, chunk_size=args.run_chunk_size)
        loss = -(log_probs * advantages * mask).sum() / mask.sum()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    result = dict(
        seconds=seconds, tokens_per_second=tokens.numel() / seconds, loss=loss.item(),
        peak_memory_bytes=peak_memory_bytes(device), memory_before_step_bytes=memory_before,
    )
    grads = {name: param.grad.float().cpu() for name, param in model.named_parameters()}
    torch.save(dict(result=result, grads=grads), args.result)
    return result


def step_memory(result: dict) -> int:
    """Memory the step itself added on top of the runtime and the weights."""
    return result["peak_memory_bytes"] - result["memory_before_step_bytes"]


def agreement(full: dict, chunked: dict) -> dict:
    """Largest differences between two runs' loss and gradients, and the gradient scale."""
    grad_diff = max((full["grads"][n] - chunked["grads"][n]).abs().max().item() for n in full["grads"])
    grad_scale = max(g.abs().max().item() for g in full["grads"].values())
    return dict(
        loss_abs_diff=abs(full["result"]["loss"] - chunked["result"]["loss"]),
        grad_max_abs_diff=grad_diff, grad_max_abs=grad_scale, grad_max_rel_diff=grad_diff / grad_scale,
    )


def measure(args) -> dict:
    variants = {FULL: FULL_LOGITS_CHUNK_SIZE} | {f"chunk {size}": size for size in args.chunk_sizes}
    runs = {}
    with tempfile.TemporaryDirectory() as temp_dir:
        for variant, chunk_size in variants.items():
            result_path = Path(temp_dir) / f"{chunk_size}.pt"
            command = [sys.executable, "-m", "bench.update", *sys_args(args), "--run-chunk-size", str(chunk_size), "--result", str(result_path)]
            subprocess.run(command, check=True)
            runs[variant] = torch.load(result_path)
    results = {name: run["result"] for name, run in runs.items()}
    full = results[FULL]
    for name in list(variants)[1:]:
        results[name] |= agreement(runs[FULL], runs[name]) | dict(
            peak_memory_vs_full=results[name]["peak_memory_bytes"] / full["peak_memory_bytes"],
            step_memory_vs_full=step_memory(results[name]) / step_memory(full),
            speed_vs_full=results[name]["tokens_per_second"] / full["tokens_per_second"],
        )
    return dict(
        model=args.model, device=args.device, dtype=args.dtype, torch_threads=args.threads or torch.get_num_threads(),
        batch_size=args.batch_size, seq_len=args.seq_len, prompt_len=args.prompt_len,
        vocab_size=MODEL_SHAPES[args.model]["vocab_size"],
        memory_measure="torch.cuda.max_memory_allocated" if args.device.startswith("cuda") else "peak RSS",
        variants=results,
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def grpo_episodes(args, vocab_size: int) -> list[Episode]:
    """Random-token episodes in groups of 8 whose rewards alternate 0/1, so every group has a spread."""
    generator = torch.Generator().manual_seed(args.seed)

    def random_ids(length: int) -> list[int]:
        return torch.randint(1, vocab_size, (length,), generator=generator).tolist()

    return [Episode(question_index=index // 8, prompt="", prompt_token_ids=random_ids(args.prompt_len),
                    generated_token_ids=random_ids(args.seq_len - args.prompt_len), text="", is_finished=True,
                    reward=float(index % 2)) for index in range(args.episodes)]


def read_a_scalar(module, inputs, output) -> None:
    """A forward hook that waits for the device, as loss.item() did. (A hook's return value would
    replace the output, so it returns nothing.)"""
    output[0].sum().item()


def timed_update(model, episodes: list[Episode], args, read_per_micro_batch: bool) -> float:
    """Seconds of one update_policy call; optionally with a host read after each micro-batch's forward."""
    device = next(model.parameters()).device
    loss, optim = LossConfig(), OptimConfig(learning_rate=1e-6, micro_batch_size=args.batch_size)
    advantages = compute_advantages(episodes, loss)
    optimizer_step = OptimizerStep(model, new_adamw(model.parameters(), optim), optim.max_grad_norm)
    read = model.register_forward_hook(read_a_scalar) if read_per_micro_batch else None
    synchronize(device)
    start = time.perf_counter()
    update_policy(model, optimizer_step, episodes, advantages, config=loss, optim=optim,
                  max_gen_len=args.seq_len - args.prompt_len, pad_token_id=0)
    synchronize(device)
    if read is not None:
        read.remove()
    return time.perf_counter() - start


HOST_READ_VARIANTS = {"read once per step (now)": False, "read per micro-batch (before)": True}


def measure_host_reads(args) -> dict:
    """update_policy's tokens/s both ways, interleaved rounds after one warm-up each; medians."""
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = Transformer(ModelConfig(**MODEL_SHAPES[args.model]))
    init_weights(model, seed=args.seed)
    model = model.to(device=device, dtype=getattr(torch, args.dtype))
    episodes = grpo_episodes(args, model.config.vocab_size)
    tokens = args.episodes * args.seq_len
    seconds = {name: [] for name in HOST_READ_VARIANTS}
    for round_number in range(args.rounds + 1):
        for name, read in HOST_READ_VARIANTS.items():
            elapsed = timed_update(model, episodes, args, read)
            if round_number:  # round 0 is the warm-up
                seconds[name].append(elapsed)
    variants = {name: dict(seconds=statistics.median(times), tokens_per_second=tokens / statistics.median(times),
                           rounds=times) for name, times in seconds.items()}
    return dict(model=args.model, device=args.device, dtype=args.dtype, episodes=args.episodes,
                seq_len=args.seq_len, micro_batch_size=args.batch_size, variants=variants)


def print_host_reads(report: dict) -> None:
    print(f"grpo.update_policy, model {report['model']} on {report['device']} ({report['dtype']}): "
          f"{report['episodes']} episodes x {report['seq_len']} tokens, micro-batch {report['micro_batch_size']}; "
          "median of the rounds")
    print("| variant | seconds | tokens/s | rounds (s) |\n|---|---|---|---|")
    for name, result in report["variants"].items():
        rounds = ", ".join(f"{value:.3f}" for value in result["rounds"])
        print(f"| {name} | {result['seconds']:.3f} | {result['tokens_per_second']:.0f} | {rounds} |")


def sys_args(args) -> list[str]:
    """The shared settings, forwarded to the per-variant subprocesses."""
    return [
        "--model", args.model, "--device", args.device, "--dtype", args.dtype, "--batch-size", str(args.batch_size),
        "--seq-len", str(args.seq_len), "--prompt-len", str(args.prompt_len), "--seed", str(args.seed),
        *(["--threads", str(args.threads)] if args.threads else []),
    ]


def print_table(report: dict) -> None:
    gib = 1024**3
    print(
        f"update step, model {report['model']} on {report['device']} ({report['dtype']}), micro-batch "
        f"{report['batch_size']} x {report['seq_len']} tokens, vocab {report['vocab_size']}; memory = "
        f"{report['memory_measure']}, step = peak minus the memory before the step (weights, runtime)"
    )
    header = ["variant", "seconds", "tokens/s", "peak GiB", "step GiB", "peak vs full", "step vs full", "loss", "max |grad diff|"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("-" * (len(name) + 2) for name in header) + "|")
    for name, result in report["variants"].items():
        step = step_memory(result) / gib
        versus = [f"{result[key]:.2f}x" if key in result else "-" for key in ("peak_memory_vs_full", "step_memory_vs_full")]
        grad_diff = f"{result['grad_max_abs_diff']:.1e}" if "grad_max_abs_diff" in result else "-"
        cells = [name, f"{result['seconds']:.2f}", f"{result['tokens_per_second']:.1f}", f"{result['peak_memory_bytes'] / gib:.2f}",
                 f"{step:.2f}", *versus, f"{result['loss']:.8f}", grad_diff]
        print("| " + " | ".join(cells) + " |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small-body", choices=sorted(MODEL_SHAPES), help="random weights of this shape")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=1280, help="prompt + completion tokens per episode")
    parser.add_argument("--prompt-len", type=int, default=256, help="leading positions without loss")
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[512, 256], help="logprobs chunk sizes to compare")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    # Set by the parent process: run one variant and save its result there.
    parser.add_argument("--run-chunk-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--json-out", type=Path, help="also write the JSON report here")
    parser.add_argument("--host-reads", action="store_true",
                        help="time grpo.update_policy with its sums read once per step vs once per micro-batch")
    parser.add_argument("--episodes", type=int, default=32, help="--host-reads: episodes per update")
    parser.add_argument("--rounds", type=int, default=3, help="--host-reads: timed rounds after the warm-up")
    args = parser.parse_args(argv)
    if not 1 <= args.prompt_len < args.seq_len:
        parser.error(f"--prompt-len {args.prompt_len} must be in [1, --seq-len) so some positions carry loss")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.result:
        return run_variant(args)
    if args.host_reads:
        report = measure_host_reads(args)
        print_host_reads(report)
        emit_json(report, args.json_out)
        return report
    report = measure(args)
    print_table(report)
    emit_json(report, args.json_out)
    return report


if __name__ == "__main__":
    main()
