"""Evaluate a model directory, Hub model or training checkpoint on a task's held-out questions.

    uv run evaluate.py --model checkpoints/<run>/step_000100 [--config FILE] [--split test]
                       [--samples K] [--temperature T] [--threads N] [--out samples.jsonl]
    uv run evaluate.py --model MODEL_DIR --data DATA_DIR [--task gsm8k]   # any model, no config needed
    uv run evaluate.py --model Qwen/Qwen2.5-3B-Instruct --data Jiayi-Pan/Countdown-Tasks-3to4  # Hub ids (hub.py)

A training checkpoint is evaluated with its own config.yaml (task, dtype, answer length); any other
model directory in float32 with answers of up to 1024 tokens (--set eval.max_gen_len=N,
--set model.dtype=bfloat16 to change them). Reports success rate (pass@1, and pass@k when K > 1),
format rate (the share of answers in the task's format) and mean response length, and writes every
sample to JSONL. train.py's periodic evaluation calls the same `evaluate` function.
Under torchrun (`uv run torchrun --nproc_per_node N evaluate.py ...`) the questions are split over the
ranks and the samples gathered.
"""

import argparse
import json
import logging
from pathlib import Path

import checkpoint
import config as config_lib
import hub
import inputs
from config import EvalConfig, EvaluateConfig, MissingInputError, RolloutConfig

logger = logging.getLogger("evaluate")

# ----------------------------------------------------------------------------- command line
# Read and validated before the imports below load torch (seconds): --help and a config error answer at once.

def default_out(model: str, split: str) -> Path:
    """Beside the model; for a Hub id in the working directory, not in the Hub's cache."""
    if hub.is_hub_id(model):
        return Path(f"{model.replace('/', '--')}_eval_{split}.jsonl")
    return Path(model) / f"eval_{split}.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face model directory or Hub id, or a training "
                        "checkpoint")
    parser.add_argument("--data", help="the task's data directory or Hub id (task.data_dir; default: the checkpoint's)")
    parser.add_argument("--task", help="task.name: countdown, gsm8k or a task module's import path (default: the "
                        "checkpoint's, else countdown)")
    parser.add_argument("--config", action="append", help="YAML with seed/device/cpu_threads/model/task/eval keys; "
                        "repeat to merge several (default: the checkpoint's config.yaml, if any)")
    parser.add_argument("--split", default="test", choices=["train", "test"])
    parser.add_argument("--samples", type=int, help="answers per question (pass@k for k > 1)")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--max-questions", type=int)
    parser.add_argument("--threads", type=int, help="torch CPU threads (cpu_threads)")
    parser.add_argument("--out", help="JSONL of every sample (default: <model>/eval_<split>.jsonl; for a Hub id "
                        "<owner>--<name>_eval_<split>.jsonl here)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    args.model = config_lib.expand_path(args.model)  # like every path key: ~ and $VARIABLES
    args.out = Path(config_lib.expand_path(args.out or default_out(args.model, args.split)))
    return args


def check_model_path(model_dir: Path) -> None:
    """A missing model is named, with the checkpoints its run directory does hold (a mistyped step); a Hub id
    is fetched and checked with the other inputs."""
    if model_dir.exists() or hub.is_hub_id(str(model_dir)):
        return
    steps = sorted(path.name for path in model_dir.parent.glob(checkpoint.STEP_GLOB)) if model_dir.parent.is_dir() else []
    holds = f"; {model_dir.parent} holds {', '.join(steps)}" if steps else ""
    raise MissingInputError(f"--model {model_dir}: no such checkpoint or model directory{holds}")


def check_out_path(out_path: Path) -> None:
    """The samples file must be writable: found out now, not after the whole generation."""
    if out_path.is_dir():
        raise config_lib.InputError(f"--out {out_path} is a directory; pass a file, e.g. --out {out_path / 'samples.jsonl'}")
    inputs.check_writable("--out", out_path.parent)


def from_training_config(values: dict) -> dict:
    """The evaluation keys of a checkpoint's training config.yaml; its rollout length is the default."""
    picked = {key: values[key] for key in ("seed", "device", "cpu_threads", "progress", "model", "task", "eval")
              if key in values}
    picked["model"] = {key: value for key, value in picked.get("model", {}).items() if key != "dir"}
    if picked.get("eval", {}).get("max_gen_len") is None:  # null: GRPO's rollout length, else evaluate.py's default
        picked["eval"] = {key: value for key, value in picked.get("eval", {}).items() if key != "max_gen_len"}
        if "rollout" in values:
            picked["eval"]["max_gen_len"] = values["rollout"].get("max_gen_len", 1024)
    return picked


def load_config(args: argparse.Namespace) -> EvaluateConfig:
    """Defaults, then the checkpoint's own training config (if any), then --config files, --set and flags."""
    model_dir = Path(args.model)
    advice = checkpoint.run_directory_advice(model_dir, "--model ")  # its config.yaml is a run's, not a model's
    if advice:
        raise MissingInputError(advice)
    values = from_training_config(config_lib.read_yaml(model_dir / "config.yaml")) if (
        model_dir / "config.yaml").is_file() else {}
    for path in args.config or []:
        values = config_lib.merge(values, config_lib.read_yaml(path))
    flags = {"task.name": args.task, "task.data_dir": args.data, "eval.num_samples": args.samples,
             "eval.temperature": args.temperature, "eval.max_questions": args.max_questions, "cpu_threads": args.threads}
    for assignment in args.set + [f"{key}={value}" for key, value in flags.items() if value is not None]:
        config_lib.apply_override(values, assignment)
    if "dir" in values.get("model", {}):
        raise config_lib.ConfigError("model.dir: evaluate.py takes the model from --model; remove model.dir")
    config_lib.apply_override(values, f"model.dir={model_dir}")
    config = config_lib.build(EvaluateConfig, values)
    check_model_path(model_dir)  # a missing checkpoint is named, before the data it would have told us
    if not values.get("task", {}).get("data_dir"):
        raise config_lib.ConfigError("task.data_dir: evaluate.py needs the data: pass --data DIR (or a --config with "
                                     "task.data_dir)")
    check_out_path(args.out)
    return config


def read_command_line(argv: list[str] | None = None) -> tuple[argparse.Namespace, EvaluateConfig]:
    """The arguments and the validated config, after checking the model, the data and --out before torch loads."""
    args = parse_args(argv)
    config = load_config(args)
    inputs.check_model_and_data(config.task, config.model, splits=(args.split,))  # Hub ids fetched
    return args, config


# As a script: --help and bad input answered before torch loads; main() goes on with what was read.
COMMAND_LINE = config_lib.check_command_line(__name__, read_command_line)

import torch

import distributed
import tasks
from data_types import QuestionBatch
from grpo import rollout
from run_logging import log_to_console, progress_bar
from runtime import load_model, resolve_device, set_up_cpu
from training_run import exit_on_interrupt
from tokenizer import Tokenizer

# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    dataset,
    *,
    reward,
    max_gen_len: int,
    config: EvalConfig,
    generator: torch.Generator | None = None,
    progress: bool = True,
    baseline=None,
) -> tuple[dict[str, float], list[dict]]:
    """Success, format and length metrics over the first `config.max_questions` items, and every sample;
    with the task's shortcut baseline (tasks.shortcut_baseline), its report of the samples beside them.

    Each batch of questions is a GRPO rollout (sampled and scored the same way) with the eval settings.
    Data-parallel: each rank answers its share of the questions; every rank returns all samples.
    """
    sampling = RolloutConfig(num_answers_per_question=config.num_samples, max_gen_len=max_gen_len,
                             temperature=config.temperature, top_p=config.top_p)
    model.eval()
    num_questions = min(len(dataset), config.max_questions or len(dataset))
    questions = distributed.shard_range(num_questions)
    samples = []
    # Under FSDP, gathered once for the whole loop: ranks may run different numbers of batches.
    with distributed.full_parameters(model):
        batch_starts = range(0, len(questions), config.batch_size)
        for start in progress_bar(batch_starts, desc="eval", unit="batch", enabled=progress, leave=False):
            question_indices = questions[start : start + config.batch_size]
            batch = QuestionBatch.of_items([dataset[i] for i in question_indices])
            # progress: the generation bar moves with every decoded token, not once per batch.
            for episode in rollout(model, tokenizer, batch, reward, config=sampling, generator=generator,
                                   progress=progress):
                item = batch.items[episode.question_index]
                samples.append(
                    {
                        "question_index": question_indices[episode.question_index],
                        **{key: value for key, value in item.items() if key != "prompt_token_ids"},
                        "response": episode.text,
                        "num_tokens": episode.num_generated_tokens,
                        "finished": episode.is_finished,
                        "reward": episode.reward,
                        "reward_info": episode.reward_info,
                    }
                )
    samples = distributed.all_ranks(samples)
    metrics = summarize(samples, config.num_samples)
    return (metrics | baseline.report(samples) if baseline else metrics), samples


def run_evaluation(model, tokenizer, dataset, *, reward, max_gen_len: int, config: EvalConfig, seed: int,
                   run_logger, step: int, progress: bool, baseline=None) -> dict[str, float]:
    """evaluate() during training, sampling from `seed`; its metrics go to TensorBoard as eval/* at
    `step` (rank 0's run_logger; texts such as the policy's form as eval/forms) and to the console."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    metrics, samples = evaluate(model, tokenizer, dataset, reward=reward, max_gen_len=max_gen_len, config=config,
                                generator=generator, progress=progress, baseline=baseline)
    texts = {key: value for key, value in metrics.items() if isinstance(value, str)}
    if run_logger:  # rank 0 only
        run_logger.scalars({f"eval/{key}": value for key, value in metrics.items() if key not in texts}, step)
        run_logger.text("eval/sample", f"{samples[0]['prompt']}{samples[0]['response']}", step)
        if texts:
            run_logger.text("eval/forms", "\n".join(f"{key}: {value}" for key, value in texts.items()), step)
    logger.info("eval step %d: success %.3f format %.3f (%d questions)%s", step, metrics["success_rate"],
                metrics["format_rate"], metrics["num_questions"], "".join(
                    f"\n  {line}" for line in baseline_lines(metrics)))
    return metrics


def baseline_lines(metrics: dict) -> list[str]:
    """One console line per number count of a report with a shortcut baseline (countdown_forms.py)."""
    lines = []
    for count in sorted({key.split("_numbers/")[0] for key in metrics if "_numbers/" in key}, key=int):
        value = lambda name: metrics.get(f"{count}_numbers/{name}")
        line = (f"{count} numbers: success {value('success'):.3f} of {value('questions')} questions; "
                f"writes `{value('policy_form')}` {value('policy_form_share'):.0%}, "
                f"* or / in {value('mul_div_answer_share'):.0%}")
        if value("best_form") is not None:
            line += (f"; best form `{value('best_form')}` solves {value('best_form_coverage'):.3f}, the top 10 "
                     f"{value('top10_forms_coverage'):.3f}; success outside them {value('success_outside_top10'):.3f} "
                     f"of {value('questions_outside_top10')}")
            if value("pass_outside_top10") is not None:
                line += f" (any answer right: {value('pass_outside_top10'):.3f})"
        lines.append(line)
    return lines


def summarize(samples: list[dict], num_samples: int) -> dict[str, float]:
    successes = [tasks.is_success(s["reward_info"]) for s in samples]
    metrics = {
        "success_rate": sum(successes) / len(samples),
        "format_rate": sum(tasks.is_well_formatted(s["reward_info"]) for s in samples) / len(samples),
        "mean_reward": sum(s["reward"] for s in samples) / len(samples),
        "mean_response_length": sum(s["num_tokens"] for s in samples) / len(samples),
        "num_questions": len(samples) // num_samples,
    }
    if "try_reward" in samples[0]["reward_info"]:  # CountDown's: is the think's arithmetic real or made up?
        metrics["mean_try_reward"] = sum(s["reward_info"]["try_reward"] for s in samples) / len(samples)
    if num_samples > 1:
        per_question = [successes[i : i + num_samples] for i in range(0, len(successes), num_samples)]
        metrics[f"pass@{num_samples}"] = sum(any(group) for group in per_question) / len(per_question)
    return metrics


def main(argv: list[str] | None = None) -> None:
    log_to_console()
    try:
        args, config = COMMAND_LINE if argv is None and COMMAND_LINE else read_command_line(argv)
        run(config, args.split, args.out)
    except config_lib.InputError as error:
        config_lib.exit_on_input_error(error)
    except KeyboardInterrupt as stop:
        exit_on_interrupt(stop)



def run(config: EvaluateConfig, split: str, out_path: Path) -> None:
    device = distributed.rank_device(resolve_device(config.device))
    set_up_cpu(config.cpu_threads)
    tokenizer = Tokenizer(config.model.dir)
    dataset = tasks.load_dataset(config.task, tokenizer, split)
    # Forms are chosen on training rows, never on the scored ones (evaluating the train split: no baseline).
    baseline = split == "test" and tasks.shortcut_baseline(config.task, tasks.load_dataset(config.task, tokenizer, "train"))
    model = load_model(config.model, device)
    generator = torch.Generator(device=device).manual_seed(config.seed)
    metrics, samples = evaluate(model, tokenizer, dataset, reward=tasks.get(config.task).reward,
                                max_gen_len=config.eval.max_gen_len, config=config.eval, generator=generator,
                                progress=config.progress and distributed.is_main_process(), baseline=baseline)
    if not distributed.is_main_process():
        return
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w") as out:
        for sample in samples:
            out.write(json.dumps(sample) + "\n")
    for line in baseline_lines(metrics):  # the log, so that standard output stays the JSON
        logger.info(line)
    print(json.dumps(metrics, indent=2))
    print(f"wrote {len(samples)} samples to {out_path}")


if __name__ == "__main__":
    distributed.run_entry_point(main)
