"""Where one GRPO step's time goes, and how close it runs to the machine's matmul limit.

    uv run bench/step.py [--config configs/cpu_demo.yaml] [--steps 3] [--warmup-steps 1] [--rounds 1]
                         [--compare REV] [--set section.key=value ...] [--out FILE.json]

Runs train.py itself (`train.main`, bootstrap included: a fresh clone builds the demo's inputs first) for
warm-up + measured steps, in a child process per run, with timers wrapped around its stages:
sampling (generation), reward, logprob_forward (the policy's forward in the update), backward (gradient
checkpointing's recompute included), reference (the KL anchor's forward), optimizer (clipping, AdamW,
zero_grad) and logging; `other` is the rest of the step (advantages, batching, metrics). A second child
repeats the same steps (same seed, same episodes) under torch's FlopCounterMode to count the step's
matmul and attention FLOPs; the fraction of the limit is FLOPs / (step seconds x the matmul rate that
torch.mm reaches on this machine with the config's threads, measured before and after the runs).

--compare REV checks REV out (git worktree, in a temporary directory) and runs the same children there,
interleaved with this tree's, round by round: the step's API (train.sample_step, grpo.answer_log_probs,
distributed.OptimizerStep) must be the same in both. --variant LABEL=KEY=VALUE,KEY=VALUE runs this tree once
more per variant with those overrides on top, interleaved the same way (LoRA against full fine-tuning). The
median of --rounds rounds is reported, with each run's peak RSS (the whole GRPO process: loading included).

LoRA and bfloat16 against full fine-tuning on the SmolLM2 recipe:
    uv run bench/step.py --config configs/smollm2_cpu.yaml --set model.dir=SFT_MODEL_DIR --set task.data_dir=DATA \
        --variant lora=model.lora.rank=1 --variant lora+bf16=model.lora.rank=1,model.dtype=bfloat16 --rounds 3

The SmolLM2 recipe needs its SFT model (GRPO from the base model sees no reward and skips the update):
    uv run bench/step.py --config configs/smollm2_cpu.yaml --set model.dir=SFT_MODEL_DIR --set task.data_dir=DATA
"""

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("sampling", "reward", "logprob_forward", "backward", "reference", "optimizer", "logging")


def matmul_limit_gflops(threads: int, repeats: int = 5) -> float:
    """The best fp32 torch.mm rate (GFLOP/s) over a few square sizes: what this CPU's matmul kernels reach."""
    import torch

    torch.set_num_threads(threads)
    best = 0.0
    for size in (512, 1024, 2048):
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up: thread pool, packing buffers
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = max(best, 2 * size**3 / (time.perf_counter() - start) / 1e9)
    return best


class StageTimer:
    """Exclusive seconds per stage during the measured steps: a stage's time excludes the stages inside it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.active = False
        self.start = 0.0  # when the measured step began
        self.inner: list[float] = []  # per open stage, the seconds of the stages nested in it

    def wrap(self, stage, function):
        """function, timed under `stage` (a name, or a function of the call's arguments returning one)."""

        @functools.wraps(function)
        def timed(*args, **kwargs):
            if not self.active:
                return function(*args, **kwargs)
            name = stage(*args, **kwargs) if callable(stage) else stage
            start = time.perf_counter()
            self.inner.append(0.0)
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.seconds[name] += elapsed - self.inner.pop()
                if self.inner:
                    self.inner[-1] += elapsed

        return timed


def log_prob_stage(model, *args, **kwargs) -> str:
    return "logprob_forward" if torch_grad_enabled() else "reference"  # the KL anchor's forward runs without grad


def torch_grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()


def child(args: argparse.Namespace) -> None:
    """Run train.py's loop with timers (or a FLOP counter) on the measured steps; print the result as JSON."""
    sys.path.insert(0, str(Path.cwd()))  # the tree being measured: this one, or --compare's checkout
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    import countdown_task
    import distributed
    import grpo
    import gsm8k_task
    import train

    timer, steps, step_seconds, flops = StageTimer(), [0], [], []
    counter: list[FlopCounterMode] = []

    def step_start(function):
        @functools.wraps(function)
        def started(*call_args, **kwargs):
            steps[0] += 1
            if steps[0] > args.warmup_steps:
                timer.active, timer.start = True, time.perf_counter()
                if args.count_flops:
                    counter.append(FlopCounterMode(display=False))
                    counter[-1].__enter__()
            return function(*call_args, **kwargs)
        return started

    def step_end(function):
        @functools.wraps(function)
        def ended(*call_args, **kwargs):
            result = function(*call_args, **kwargs)
            if timer.active:
                step_seconds.append(time.perf_counter() - timer.start)
                timer.active = False
                if counter:
                    counter[-1].__exit__(None, None, None)
                    flops.append(counter.pop().get_total_flops())
            return result
        return ended

    update_tokens = [0]  # tokens the update's forwards ran (shared prefixes once), over the measured steps

    def count_tokens(function):
        @functools.wraps(function)
        def counted(model, batch, *call_args, **kwargs):
            if timer.active and torch.is_grad_enabled():
                update_tokens[0] += batch.tokens.numel() + (0 if batch.prefixes is None else batch.prefixes.numel())
            return function(model, batch, *call_args, **kwargs)
        return counted

    train.sample_step = step_start(train.sample_step)
    train.log_step = step_end(timer.wrap("logging", train.log_step))
    grpo.generate = timer.wrap("sampling", grpo.generate)
    grpo.answer_log_probs = count_tokens(timer.wrap(log_prob_stage, grpo.answer_log_probs))
    countdown_task.reward = timer.wrap("reward", countdown_task.reward)
    gsm8k_task.reward = timer.wrap("reward", gsm8k_task.reward)
    torch.Tensor.backward = timer.wrap("backward", torch.Tensor.backward)
    distributed.OptimizerStep.__call__ = timer.wrap("optimizer", distributed.OptimizerStep.__call__)

    with tempfile.TemporaryDirectory() as scratch:
        train.main(["--config", args.config, *[f"--set={s}" for s in args.set],
                    f"--set=optim.num_steps={args.warmup_steps + args.steps}", "--set=eval.interval=0",
                    "--set=checkpoint.interval=0", f"--set=checkpoint.dir={scratch}/checkpoints",
                    f"--set=logging.log_dir={scratch}/logs", "--set=run_name=step-bench", "--set=progress=false"])
    import resource

    print(json.dumps({"steps": len(step_seconds), "step_seconds": sum(step_seconds) / len(step_seconds),
                      "stages": {name: timer.seconds[name] / len(step_seconds) for name in STAGES},
                      "update_tokens": update_tokens[0] / len(step_seconds),
                      "flops": sum(flops) / len(flops) if flops else None,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def run_child(tree: Path, overrides: list[str], args: argparse.Namespace, count_flops: bool) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--config", args.config,
               "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
               *[f"--set={s}" for s in args.set + overrides], *(["--count-flops"] if count_flops else [])]
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the step run in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(runs: dict[str, tuple[Path, list[str]]], args: argparse.Namespace) -> dict[str, dict]:
    """runs: label -> (tree, overrides on top of --set)."""
    timings: dict[str, list[dict]] = {label: [] for label in runs}
    for round_index in range(args.rounds):  # interleaved, so a slow spell of the machine hits every run
        for label, (tree, overrides) in runs.items():
            print(f"  round {round_index + 1}/{args.rounds}: {label}", file=sys.stderr, flush=True)
            timings[label].append(run_child(tree, overrides, args, count_flops=False))
    results = {}
    for label, (tree, overrides) in runs.items():
        flops = run_child(tree, overrides, args, count_flops=True)["flops"]
        timed = timings[label]
        median = sorted(timed, key=lambda run: run["step_seconds"])[(len(timed) - 1) // 2]  # a run, not an average
        results[label] = {"step_seconds": median["step_seconds"], "stages": median["stages"], "overrides": overrides,
                          "step_seconds_all": [run["step_seconds"] for run in timed], "gflops_per_step": flops / 1e9,
                          "update_tokens": median["update_tokens"],
                          "peak_rss_mib_all": [run["peak_rss_mib"] for run in timed]}
    return results


def table(results: dict[str, dict], limit: float) -> str:
    header = ["run", "step s", *STAGES, "other", "update tokens", "update s / 1k tokens", "GFLOP/step", "GFLOP/s",
              "of limit", "peak RSS MiB"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for label, result in results.items():
        stages = result["stages"]
        other = result["step_seconds"] - sum(stages.values())
        cells = [label, f"{result['step_seconds']:.2f}",
                 *[f"{stages[name]:.2f} ({100 * stages[name] / result['step_seconds']:.0f}%)" for name in STAGES],
                 f"{other:.2f}", f"{result['update_tokens']:,.0f}",
                 f"{1000 * update_seconds(stages) / result['update_tokens']:.3f}" if result["update_tokens"] else "-",
                 f"{result['gflops_per_step']:.1f}",
                 f"{result['gflops_per_step'] / result['step_seconds']:.1f}", f"{100 * result['fraction_of_limit']:.1f}%",
                 f"{max(result['peak_rss_mib_all']):,.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"\nSeconds per step (median of rounds), each stage's share in brackets; limit: torch.mm (float32) "
                 f"at {limit:.0f} GFLOP/s; peak RSS: the largest of the rounds. Update tokens: what the update's "
                 f"forwards ran per step (groups without reward spread are skipped, so runs whose policies differ "
                 f"update different amounts: compare them per 1k tokens).")
    return "\n".join(lines)


def update_seconds(stages: dict[str, float]) -> float:
    return sum(stages[name] for name in ("logprob_forward", "backward", "reference", "optimizer"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/cpu_demo.yaml", help="the training config to time")
    parser.add_argument("--set", action="append", default=[], help="a config override, section.key=value")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run")
    parser.add_argument("--warmup-steps", type=int, default=1, help="steps run first and not measured")
    parser.add_argument("--rounds", type=int, default=1, help="timed runs per tree, interleaved; the median is kept")
    parser.add_argument("--compare", metavar="REV", help="also time this git revision, side by side")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=KEY=VALUE[,KEY=VALUE]",
                        help="also time this tree with these overrides, side by side (repeatable)")
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--count-flops", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.warmup_steps < 0:
        parser.error("--warmup-steps must be >= 0")
    for variant in args.variant:
        label, _, overrides = variant.partition("=")
        if not label or "=" not in overrides:
            parser.error(f"--variant {variant!r}: expected LABEL=section.key=value[,section.key=value]")
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        return child(args)
    sys.path.insert(0, str(REPO))
    import config as config_lib
    from bench.report import machine
    from config import TrainConfig

    threads = config_lib.load(TrainConfig, [str(REPO / args.config)], args.set).cpu_threads
    with tempfile.TemporaryDirectory() as scratch:
        runs = {"this tree": (REPO, [])}
        for variant in args.variant:
            label, _, overrides = variant.partition("=")
            runs[label] = (REPO, overrides.split(","))
        if args.compare:
            subprocess.run(["git", "worktree", "add", "--detach", f"{scratch}/tree", args.compare], cwd=REPO, check=True,
                           capture_output=True)
            runs[args.compare] = (Path(scratch) / "tree", [])
            if (REPO / "artifacts").exists():  # the demo's bootstrapped data and models: the same for both trees
                (Path(scratch) / "tree" / "artifacts").symlink_to(REPO / "artifacts")
        try:
            limit_before = matmul_limit_gflops(threads)
            results = measure(runs, args)
            limit = max(limit_before, matmul_limit_gflops(threads))
        finally:
            if args.compare:
                subprocess.run(["git", "worktree", "remove", "--force", f"{scratch}/tree"], cwd=REPO, check=False)
    for result in results.values():
        result["fraction_of_limit"] = result["gflops_per_step"] / result["step_seconds"] / limit
    report = {"config": args.config, "overrides": args.set, "threads": threads, "steps": args.steps,
              "rounds": args.rounds, "matmul_limit_gflops": limit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": machine(), "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(table(results, limit))


if __name__ == "__main__":
    main()
