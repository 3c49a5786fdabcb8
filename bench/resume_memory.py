"""Host memory of a resume: the trainer state read by checkpoint.load_trainer_state (memory-mapped) against
torch.load reading the whole file, each then loaded into the offloaded AdamW (optim.memory_efficient_adamw),
whose moments live in CPU memory: the case where a second copy costs the most (config_24GB.yaml).

Each side runs in its own fresh process, in interleaved rounds; the figure is the process's anonymous memory
(RssAnon: what cannot be paged back to a file) after the read and after the optimizer's load, above its
level before the read.

    uv run python -m bench.resume_memory [--megabytes 1024] [--rounds 2] [--json-out F]
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also run as a file: uv run bench/resume_memory.py

from bench.report import emit_json  # noqa: E402
from optimizer import MemoryEfficientAdamW  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
PARAMETERS = 4  # the moments split over a few weights, as a model's are
CHILD = """
import json, sys
sys.path.insert(0, {root!r})
import torch, checkpoint
from optimizer import MemoryEfficientAdamW

def anon_mb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024

params = [torch.nn.Parameter(torch.zeros(n)) for n in {sizes}]
optimizer = MemoryEfficientAdamW(params, enabled=True)
before = anon_mb()
if {mapped}:
    state = checkpoint.load_trainer_state({directory!r})
else:
    state = torch.load({directory!r} + "/" + checkpoint.TRAINER_STATE, weights_only=False)
after_read = anon_mb() - before
optimizer.load_state_dict(state["optimizer"])  # the state is still held, as restore_trainer_state holds it
print(json.dumps({{"after_read_mb": after_read, "after_optimizer_mb": anon_mb() - before}}))
"""


def write_state(directory: Path, megabytes: int) -> list[int]:
    """A trainer state of an offloaded AdamW whose two fp32 moments take `megabytes` in all."""
    numel = megabytes * 2**20 // (2 * 4 * PARAMETERS)
    params = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(PARAMETERS)]
    optimizer = MemoryEfficientAdamW(params, enabled=True)
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    torch.save({"step": 1, "optimizer": optimizer.state_dict()}, directory / "trainer_state.pt")
    return [numel] * PARAMETERS


def measure(directory: Path, sizes: list[int], mapped: bool) -> dict:
    code = CHILD.format(root=str(REPO_ROOT), sizes=sizes, mapped=mapped, directory=str(directory))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=1024, help="the moments' size in the trainer state")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        sizes = write_state(Path(directory), args.megabytes)
        rounds = [{side: measure(Path(directory), sizes, mapped=side == "mapped") for side in ("read", "mapped")}
                  for _ in range(args.rounds)]
    report = {"moments_mb": args.megabytes, "rounds": rounds,
              "peak_mb": {side: max(r[side]["after_optimizer_mb"] for r in rounds) for side in ("read", "mapped")}}
    print(f"{'side':<8} {'after read MB':>14} {'after optimizer load MB':>24}   (moments: {args.megabytes} MB)",
          file=sys.stderr)
    for index, one in enumerate(rounds):
        for side in ("read", "mapped"):
            print(f"{side:<8} {one[side]['after_read_mb']:>14.0f} {one[side]['after_optimizer_mb']:>24.0f}   "
                  f"round {index + 1}", file=sys.stderr)
    emit_json(report, args.json_out)
    return report


if __name__ == "__main__":
    main()
