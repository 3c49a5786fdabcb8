"""One table of GRPO variants over seeds, from bench/learning_cpu.py results.

Each variant is run per seed with the same cached dataset and SFT model (docs/variants.md):

    for seed in 0 1 2; do for v in baseline dapo dr_grpo gspo grpo_kl; do
      uv run bench/learning_cpu.py --seeds 1 --first-seed $seed --overlay configs/variants/$v.yaml \\
          --cache-dir runs/variants/cache --out runs/variants/$v-s$seed
    done; done
    uv run python -m bench.variants_table runs/variants

reads DIR/<variant>-s<seed>/learning_cpu.json and prints, per variant, the held-out success after
GRPO (T=1 and greedy) and its gain over the SFT start, as mean [min, max] over seeds, plus the GRPO
stage's wall time.
"""

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path


def read_runs(directory: Path) -> dict[str, list[dict]]:
    """variant -> one result per seed (the learning bench's per-seed entries), in seed order."""
    runs = defaultdict(list)
    for path in sorted(directory.glob("*-s*/learning_cpu.json")):
        variant = re.fullmatch(r"(.+)-s\d+", path.parent.name).group(1)
        runs[variant].extend(json.loads(path.read_text())["seeds"])
    return {variant: sorted(seeds, key=lambda s: s["seed"]) for variant, seeds in runs.items()}


def spread(values: list[float], scale: float = 100, signed: bool = False) -> str:
    number = "{:+.1f}" if signed else "{:.1f}"
    mean, low, high = (number.format(scale * v) for v in (statistics.mean(values), min(values), max(values)))
    return f"{mean} [{low}, {high}]"


def table(runs: dict[str, list[dict]]) -> str:
    lines = ["| variant | seeds | GRPO T=1 | gain T=1 | GRPO greedy | gain greedy | GRPO wall s |",
             "|---|---|---|---|---|---|---|"]
    for variant, seeds in runs.items():
        lines.append(" | ".join([
            f"| {variant}", ",".join(str(s["seed"]) for s in seeds),
            spread([s["after"]["success_t1"] for s in seeds]), spread([s["gain_t1"] for s in seeds], signed=True),
            spread([s["after"]["success_greedy"] for s in seeds]), spread([s["gain_greedy"] for s in seeds], signed=True),
            spread([s["stages"]["grpo_seconds"] for s in seeds], scale=1),
        ]) + " |")
    return "\n".join(lines) + "\n\nSuccess in % on the held-out questions: mean [min, max] over seeds.\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    args = parser.parse_args()
    print(table(read_runs(args.directory)))


if __name__ == "__main__":
    main()
