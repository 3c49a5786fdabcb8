"""Matmul speed by dtype on this machine: float32 against bfloat16 at a model's shapes (default SmolLM2-135M's:
hidden 576, MLP 1536, vocabulary 49,152), forward-shaped [rows x in] @ [in x out], interleaved rounds.

Whether model.dtype: bfloat16 can pay on a CPU turns on this: CPUs with avx512_bf16 or AMX run bf16 matmuls
natively; others convert and run slower than float32.

    uv run python -m bench.matmul_dtype [--rows 320] [--threads 2] [--rounds 5] [--json-out F]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also run as a file: uv run bench/matmul_dtype.py

from bench.report import emit_json, machine  # noqa: E402

SHAPES = {"attention q/o 576x576": (576, 576), "MLP up 576x1536": (576, 1536), "MLP down 1536x576": (1536, 576),
          "vocabulary 576x49152": (576, 49152)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def gflops(rows: int, inner: int, outer: int, dtype: torch.dtype, calls: int = 10) -> float:
    left, right = torch.randn(rows, inner, dtype=dtype), torch.randn(inner, outer, dtype=dtype)
    torch.mm(left, right)  # warm-up: the kernel's first call picks and packs
    start = time.perf_counter()
    for _ in range(calls):
        torch.mm(left, right)
    return 2 * rows * inner * outer * calls / (time.perf_counter() - start) / 1e9


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=320, help="tokens per matmul (8 answers x 40 tokens)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rates = {shape: {name: [] for name in DTYPES} for shape in SHAPES}
    for _ in range(args.rounds):  # the dtypes alternate, so a drift of the machine hits both
        for shape, (inner, outer) in SHAPES.items():
            for name, dtype in DTYPES.items():
                rates[shape][name].append(gflops(args.rows, inner, outer, dtype))
    table = {shape: {name: {"median": statistics.median(values), "min": min(values), "max": max(values)}
                     for name, values in by_dtype.items()} for shape, by_dtype in rates.items()}
    print(f"{'shape':<24} {'float32 GFLOP/s':>22} {'bfloat16 GFLOP/s':>22} {'bf16 / fp32':>12}", file=sys.stderr)
    for shape, by_dtype in table.items():
        fp32, bf16 = by_dtype["float32"], by_dtype["bfloat16"]
        print(f"{shape:<24} {fp32['median']:>8.0f} ({fp32['min']:.0f}-{fp32['max']:.0f}) "
              f"{bf16['median']:>10.0f} ({bf16['min']:.0f}-{bf16['max']:.0f}) {bf16['median'] / fp32['median']:>11.2f}x",
              file=sys.stderr)
    report = {"rows": args.rows, "threads": args.threads, "rounds": args.rounds, "machine": machine(), "gflops": table}
    emit_json(report, args.json_out)
    return report


if __name__ == "__main__":
    main()
