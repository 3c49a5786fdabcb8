"""The offloaded AdamW step's host work on a CPU: ours (weights in pieces through float32 masters) against
torch.optim.AdamW over float32 weights (foreach), interleaved rounds, the same weight shapes and gradients.

    uv run python -m bench.optimizer_step [--model qwen2.5-0.5b] [--threads 2] [--rounds 5] [--json-out F]

On a GPU the step also copies each piece's gradient in and its weights out, overlapped with the AdamW of the
piece before (optimizer.HostStaging); bench/gpu_check.py times that. Here the weights live in CPU memory, so the
table is the CPU's share: seconds per step, and the memory traffic it streams (float32 master, gradient and two
moments read and written, the bf16 weights written: 30 bytes per weight; torch's float32 AdamW: 28).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also run as a file: uv run bench/optimizer_step.py

from bench.report import emit_json  # noqa: E402
from bench.rollout import SHAPES, load_model  # noqa: E402
from optimizer import MemoryEfficientAdamW  # noqa: E402

BYTES_PER_WEIGHT = {"ours (offloaded, bf16 weights, float32 masters)": 30, "torch.optim.AdamW (float32)": 28}


def timed_step(optimizer, params: list[torch.Tensor], gradients: list[torch.Tensor]) -> float:
    float32_sums = getattr(optimizer, "float32_gradients", None)
    for param, gradient in zip(params, gradients):
        if float32_sums is not None:  # what backward leaves with master weights: the float32 sums
            float32_sums.buffers[param] = gradient
            float32_sums.written.add(param)
        else:
            param.grad = gradient
    start = time.perf_counter()
    optimizer.step()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(SHAPES), help="whose weight shapes")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    weights = [param.detach() for param in load_model(args.model, torch.device("cpu"), torch.float32).parameters()]
    generator = torch.Generator().manual_seed(0)
    gradients = [torch.randn(weight.shape, generator=generator) * 1e-3 for weight in weights]
    ours_params = [torch.nn.Parameter(weight.bfloat16()) for weight in weights]
    reference_params = [torch.nn.Parameter(weight.clone()) for weight in weights]
    runs = {"ours (offloaded, bf16 weights, float32 masters)":
            (MemoryEfficientAdamW(ours_params, lr=1e-5, enabled=True, master_weights=True), ours_params),
            "torch.optim.AdamW (float32)": (torch.optim.AdamW(reference_params, lr=1e-5), reference_params)}
    for optimizer, params in runs.values():  # the first step creates the state: not timed
        timed_step(optimizer, params, gradients)
    seconds = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (optimizer, params) in runs.items():
            seconds[name].append(timed_step(optimizer, params, gradients))
    count = sum(weight.numel() for weight in weights)
    results = {name: {"median_seconds": statistics.median(values), "min_seconds": min(values),
                      "max_seconds": max(values),
                      "gb_per_second": BYTES_PER_WEIGHT[name] * count / statistics.median(values) / 1e9}
               for name, values in seconds.items()}
    print(f"{args.model}: {count / 1e6:.0f}M weights, {args.threads} threads, {args.rounds} interleaved rounds",
          file=sys.stderr)
    print("| optimizer | step s (median) | min | max | GB/s streamed |", file=sys.stderr)
    print("|---|---|---|---|---|", file=sys.stderr)
    for name, result in results.items():
        print(f"| {name} | {result['median_seconds']:.3f} | {result['min_seconds']:.3f} | {result['max_seconds']:.3f} "
              f"| {result['gb_per_second']:.1f} |", file=sys.stderr)
    report = {"model": args.model, "weights": count, "threads": args.threads, "rounds": args.rounds,
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": results}
    emit_json(report, args.json_out)
    return report


if __name__ == "__main__":
    main()
