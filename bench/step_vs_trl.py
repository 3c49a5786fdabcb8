"""A whole GRPO step (rollout + update), ours vs TRL's GRPOTrainer, at equal settings.

Both sides get the same model directory (a tiny Qwen2 with the CPU demo's base shape and random weights,
or --model DIR, a real checkpoint such as SmolLM2-135M-Instruct), the same CountDown questions and
rendered prompts in the same order, the same reward function (countdown_task's, plus a tiny
text-checksum term so that every group has a spread: see bench_reward), group size, batch, max_gen_len,
learning rate, micro-batch, dtype, threads, gradient checkpointing (off unless --gradient-checkpointing;
TRL's default is on) and loss: token-level (TRL's "dapo"), no KL (beta 0), one optimizer step per
rollout, group-std scaling, constant learning rate, clip norm 1. Each side lives in its own worker
process (its peak memory is its own), set up once and warmed up with one step; the parent then asks
them for a step in turn, so machine load hits both alike. Both take their memory baseline at the same
point: model, tokenizer, data and optimizer built, before the first step.

    uv run --group bench python -m bench.step_vs_trl
    uv run --group bench python -m bench.step_vs_trl --model SMOLLM2_DIR --questions 4 --micro-batch-size 8 --threads 2
    uv run --group bench python -m bench.step_vs_trl --device cuda --compile   # bf16; compiled decode for ours

TRL runs offline: no Hub, no wandb (report_to none). Known differences that are TRL's own design,
not settings: its rollout is transformers' generate() (all rows until the longest finishes), it
logs per-step metrics. Both divide by the unbiased group std (ours: `loss.std_estimator: sample`).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from argparse import Namespace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also run as a file: uv run bench/step_vs_trl.py

from bench.report import emit_json

# Before transformers/TRL are imported anywhere in the worker: nothing may reach the network.
OFFLINE_ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                       "WANDB_DISABLED": "true", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
# The CPU demo's base model (configs/cpu_demo.yaml's bootstrap) and its CountDown questions.
MODEL_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, tokenizer_split="digits", tokenizer_vocab_size=1024)
QUESTIONS = dict(min_numbers=2, max_numbers=3, min_number=1, max_number=20, min_target=1, max_target=100,
                 expressions_per_draw=20, with_solutions=False)
SIDES = ("ours", "TRL")


def bench_reward(response: str, nums: list[int], target: int) -> float:
    """CountDown's reward plus a tiny term from the text's checksum, the same on both sides.

    Random weights score 0 on every answer, so every group's rewards would be equal: our update then
    skips its forward and backward (the gradient would be exactly 0) while TRL's still runs them. The
    term gives every group a spread, so both sides do the whole update.
    """
    import countdown_task

    return countdown_task.grade(response, nums, target)["reward"] + zlib.crc32(response.encode()) % 1000 / 1e5


INSTALL_HINT = "TRL is missing: it is in the bench dependency group. Run\n  uv run --group bench python -m bench.step_vs_trl"


def prepare(workdir: Path, args) -> None:
    """The shared inputs: a model directory (unless --model) and a CountDown dataset with a step's worth of
    questions per round."""
    import countdown_task
    from tiny_model import build_tiny_model

    if args.model is None:
        build_tiny_model(workdir / "model", seed=args.seed, **MODEL_SHAPE)
    size = args.questions * (args.rounds + 1) + 1  # +1: the dataset keeps at least one test row
    countdown_task.generate(Namespace(out=workdir / "countdown", size=size, seed=args.seed, **QUESTIONS))


def device_and_dtype(args) -> tuple[torch.device, torch.dtype]:
    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def memory_now(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class StepClock:
    """Wall and CPU seconds of the current step and its rollout; one JSON line per finished step."""

    def __init__(self, device: torch.device, reports):
        self.device = device
        self.reports = reports
        self.baseline_memory, self.gradient_checkpointing = None, None

    def set_up(self, gradient_checkpointing: bool) -> None:
        """Everything is built and no step has run: the memory baseline (the same point on both sides), and
        whether the model as built really checkpoints (each step reports it, so a mismatch cannot pass)."""
        self.baseline_memory, self.gradient_checkpointing = memory_now(self.device), gradient_checkpointing

    def now(self) -> tuple[float, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter(), time.process_time()

    def begin_step(self) -> None:
        sys.stdin.readline()  # wait for the parent's turn signal
        self.step_start, self.rollout_seconds = self.now(), None

    def time_rollout(self, rollout):
        start = self.now()
        result = rollout()
        end = self.now()
        self.rollout_seconds = (end[0] - start[0], end[1] - start[1])
        return result

    def end_step(self) -> None:
        end = self.now()
        wall, cpu = end[0] - self.step_start[0], end[1] - self.step_start[1]
        rollout_wall, rollout_cpu = self.rollout_seconds
        report = dict(
            total_wall=wall, total_cpu=cpu, rollout_wall=rollout_wall, rollout_cpu=rollout_cpu,
            update_wall=wall - rollout_wall, update_cpu=cpu - rollout_cpu,
            peak_memory_bytes=peak_memory(self.device), baseline_memory_bytes=self.baseline_memory,
            gradient_checkpointing=self.gradient_checkpointing,
        )
        print(json.dumps(report), file=self.reports, flush=True)


def run_ours(workdir: Path, args, reports) -> None:
    """train.py's step: the same functions, settings from the command line."""
    import countdown_task
    from config import LossConfig, OptimConfig, RolloutConfig
    from distributed import OptimizerStep
    from grpo import compute_advantages, rollout, update_policy
    from optimizer import new_adamw
    from qwen2_model import Transformer
    from tokenizer import Tokenizer
    from train import make_batch

    def reward(response: str, item: dict, end_token: str | None) -> dict:
        text = response[: -len(end_token)] if end_token and response.endswith(end_token) else response
        return {"reward": bench_reward(text, item["nums"], item["target"]), "reward_info": {}}

    device, dtype = device_and_dtype(args)
    model = Transformer.from_pretrained(model_dir(workdir, args), device=device, dtype=dtype)
    model.gradient_checkpointing = args.gradient_checkpointing
    tokenizer = Tokenizer(model_dir(workdir, args))
    dataset = countdown_task.CountdownDataset(workdir / "countdown", tokenizer, "train", test_size=1)
    sampling = RolloutConfig(num_answers_per_question=args.answers, max_gen_len=args.max_gen_len,
                             compile_decode=args.compile)
    optim = OptimConfig(learning_rate=args.learning_rate, micro_batch_size=args.micro_batch_size, max_grad_norm=1.0)
    loss = LossConfig(std_estimator="sample")  # TRL divides by the unbiased group std
    optimizer_step = OptimizerStep(model, new_adamw(model.parameters(), optim), optim.max_grad_norm)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    clock = StepClock(device, reports)
    clock.set_up(model.gradient_checkpointing)
    for step in range(args.rounds + 1):  # the first is the warm-up
        clock.begin_step()
        batch = make_batch(dataset, range(step * args.questions, (step + 1) * args.questions), max_prompt_len=10**6)
        model.eval()
        episodes = clock.time_rollout(lambda: rollout(model, tokenizer, batch, reward, config=sampling,
                                                               generator=generator))
        advantages = compute_advantages(episodes, loss)
        update = update_policy(model, optimizer_step, episodes, advantages, config=loss, optim=optim,
                               max_gen_len=args.max_gen_len, pad_token_id=tokenizer.pad_token_id)
        if not update:
            sys.exit("our update was skipped (no reward spread), so this step would not be comparable with TRL's")
        clock.end_step()


def run_trl(workdir: Path, args, reports) -> None:
    try:
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        sys.exit(INSTALL_HINT)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    import countdown_task
    from tokenizer import Tokenizer

    device, dtype = device_and_dtype(args)
    # The same rendered prompts as ours, in the same order (TRL's shuffling is off).
    ours = countdown_task.CountdownDataset(workdir / "countdown", Tokenizer(model_dir(workdir, args)), "train", test_size=1)
    rows = [dict(prompt=item["prompt"], nums=item["nums"], target=item["target"]) for item in ours]
    config = GRPOConfig(
        output_dir=str(workdir / "trl"), report_to="none", save_strategy="no", logging_steps=10**6,
        disable_tqdm=True, use_cpu=device.type == "cpu", bf16=dtype == torch.bfloat16, seed=args.seed,
        max_steps=args.rounds + 1, learning_rate=args.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0,
        num_generations=args.answers, max_completion_length=args.max_gen_len, temperature=1.0, top_p=1.0,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=args.questions * args.answers // args.micro_batch_size,
        beta=0.0, loss_type="dapo", scale_rewards="group", num_iterations=1, shuffle_dataset=False,
        dataloader_num_workers=0, gradient_checkpointing=args.gradient_checkpointing,
    )
    clock = StepClock(device, reports)

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            return clock.time_rollout(lambda: super(Timed, self)._generate_and_score_completions(inputs))

    class TurnByTurn(TrainerCallback):
        def on_train_begin(self, *unused, model, **kwargs):  # the trainer has built its optimizer
            clock.set_up(model.is_activation_checkpointing)

        def on_step_begin(self, *unused, **kwargs):
            clock.begin_step()

        def on_step_end(self, *unused, **kwargs):
            clock.end_step()

    def countdown_reward(completions, nums, target, **kwargs) -> list[float]:
        return [bench_reward(text, n, t) for text, n, t in zip(completions, nums, target)]

    model = AutoModelForCausalLM.from_pretrained(model_dir(workdir, args), dtype=dtype)
    trainer = Timed(
        model=model, reward_funcs=countdown_reward, args=config, train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(model_dir(workdir, args)), callbacks=[TurnByTurn()],
    )
    trainer.train()


def model_dir(workdir: Path, args) -> Path:
    return args.model or workdir / "model"


def worker_command(side: str, workdir: Path, args) -> list[str]:
    shared = [*(["--model", str(args.model)] if args.model else []),
              *(["--gradient-checkpointing"] if args.gradient_checkpointing else []),
              "--questions", str(args.questions), "--answers", str(args.answers), "--max-gen-len", str(args.max_gen_len),
              "--micro-batch-size", str(args.micro_batch_size), "--learning-rate", str(args.learning_rate),
              "--rounds", str(args.rounds), "--seed", str(args.seed), "--device", args.device,
              "--threads", str(args.threads), *(["--compile"] if args.compile else [])]
    return [sys.executable, "-m", "bench.step_vs_trl", "--worker", side, "--workdir", str(workdir), *shared]


def measure(args) -> dict:
    rounds = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as temp_dir:
        workdir = Path(temp_dir)
        prepare(workdir, args)
        environment = os.environ | OFFLINE_ENVIRONMENT
        workers = {
            side: subprocess.Popen(worker_command(side, workdir, args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True, env=environment)
            for side in SIDES
        }
        try:
            for round_number in range(args.rounds + 1):
                order = SIDES if round_number % 2 == 0 else SIDES[::-1]
                for side in order:
                    worker = workers[side]
                    worker.stdin.write("go\n")
                    worker.stdin.flush()
                    line = worker.stdout.readline()
                    if not line:
                        raise RuntimeError(f"the {side} worker stopped (exit code {worker.wait()}); see its output above")
                    if round_number:  # round 0 is the warm-up
                        rounds[side].append(json.loads(line))
                        print(f"  round {round_number} {side}: {line.strip()}", file=sys.stderr)
        finally:
            for worker in workers.values():
                worker.stdin.close()
                worker.wait(timeout=600)
    sides = {}
    for side, steps in rounds.items():
        if any(step["gradient_checkpointing"] != args.gradient_checkpointing for step in steps):
            raise RuntimeError(f"{side}'s model has gradient checkpointing {steps[0]['gradient_checkpointing']}, "
                               f"not {args.gradient_checkpointing} as asked: the sides would not be comparable")
        medians = {key: statistics.median(step[key] for step in steps) for key in steps[0] if key.endswith(("_wall", "_cpu"))}
        peak = max(step["peak_memory_bytes"] for step in steps)
        sides[side] = medians | dict(peak_memory_bytes=peak, step_memory_bytes=peak - steps[0]["baseline_memory_bytes"], rounds=steps)
    device, dtype = device_and_dtype(args)
    return dict(
        model=str(args.model or "tiny random Qwen2 (the CPU demo's base shape)"),
        gradient_checkpointing=args.gradient_checkpointing,
        device=str(device), dtype=str(dtype).removeprefix("torch."), threads=args.threads, questions=args.questions,
        answers=args.answers, max_gen_len=args.max_gen_len, micro_batch_size=args.micro_batch_size,
        learning_rate=args.learning_rate, compile_decode=args.compile, rounds=args.rounds,
        load_average=" ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "unknown",
        sides=sides,
        speedup=({f"{part}_{clock}": sides["TRL"][f"{part}_{clock}"] / sides["ours"][f"{part}_{clock}"]
                  for part in ("total", "rollout", "update") for clock in ("wall", "cpu")}),
    )


def print_table(report: dict) -> None:
    print(
        f"one GRPO step of {report['model']} on {report['device']} ({report['dtype']}, {report['threads']} threads, "
        f"gradient checkpointing {'on' if report['gradient_checkpointing'] else 'off'}): {report['questions']} "
        f"questions x {report['answers']} answers, max_gen_len {report['max_gen_len']}, micro-batch "
        f"{report['micro_batch_size']}, lr {report['learning_rate']}; median of {report['rounds']} interleaved rounds "
        f"(CPU s / wall s); load average {report['load_average']}"
    )
    print("| side | step | rollout | update | peak memory MiB | step memory MiB |\n|---|---|---|---|---|---|")
    for side, result in report["sides"].items():
        cells = [f"{result[f'{part}_cpu']:.2f} / {result[f'{part}_wall']:.2f}" for part in ("total", "rollout", "update")]
        memory = [f"{result[key] / 2**20:.0f}" for key in ("peak_memory_bytes", "step_memory_bytes")]
        print(f"| {side} | " + " | ".join(cells + memory) + " |")
    speedup = report["speedup"]
    cells = [f"{speedup[f'{part}_cpu']:.2f}x / {speedup[f'{part}_wall']:.2f}x" for part in ("total", "rollout", "update")]
    print("| ours vs TRL (throughput) | " + " | ".join(cells) + " | | |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a Hugging Face model directory (default: a tiny random Qwen2)")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="on for both sides (default: off)")
    parser.add_argument("--questions", type=int, default=16, help="questions per step")
    parser.add_argument("--answers", type=int, default=8, help="answers per question (the group size)")
    parser.add_argument("--max-gen-len", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--rounds", type=int, default=3, help="timed steps per side, after one warm-up step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto: cuda when present (bf16), else cpu (fp32)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for torch in each worker")
    parser.add_argument("--compile", action="store_true", help="ours: compiled decode step (CUDA only)")
    parser.add_argument("--json-out", type=Path, help="also write the JSON report here")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.model and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; give a Hugging Face model directory "
                     "(SmolLM2-135M-Instruct offline: bash ../shared/tools/make_smollm2.sh DIR .)")
    if args.model:
        args.model = args.model.resolve()  # the workers may resolve paths elsewhere
    if (args.questions * args.answers) % args.micro_batch_size:
        parser.error("--micro-batch-size must divide questions x answers (TRL accumulates whole micro-batches)")
    return args


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        # The parent reads step reports from stdout; everything else printed goes to stderr.
        reports = os.fdopen(os.dup(sys.stdout.fileno()), "w")
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
        return (run_ours if args.worker == "ours" else run_trl)(args.workdir, args, reports)
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit(INSTALL_HINT)
    report = measure(args)
    print_table(report)
    emit_json(report, args.json_out)
    return report


if __name__ == "__main__":
    main()
