"""Evaluate a model directory or training checkpoint on a task's held-out questions.

    uv run evaluate.py --model checkpoints/<run>/step_000100 [--config FILE] [--split test]
                       [--samples K] [--temperature T] [--out samples.jsonl]

Reports success rate (pass@1, and pass@k when K > 1), format rate and mean response length, and
writes every sample to JSONL. train.py's periodic evaluation calls the same `evaluate` function.
Under torchrun (`uv run torchrun --nproc_per_node N evaluate.py ...`) the questions are split over the
ranks and the samples gathered.
"""

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import config as config_lib
import distributed
import tasks
from data_types import QuestionBatch
from grpo import rollout
from runtime import ModelSetup, load_model, resolve_device
from tokenizer import Tokenizer

logger = logging.getLogger("evaluate")


@dataclass
class EvalConfig:
    interval: int = 10  # training steps between evaluations (0: never)
    max_questions: int | None = None  # null: the whole held-out split
    batch_size: int = 64  # questions generated at once
    num_samples: int = 1  # answers per question; pass@k is reported when > 1
    temperature: float = 0.0  # 0 is greedy decoding
    top_p: float = 1.0
    max_gen_len: int | None = None  # null: rollout.max_gen_len


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    dataset,
    reward_for_item,
    max_gen_len: int,
    config: EvalConfig,
    generator: torch.Generator | None = None,
    progress: bool = True,
) -> tuple[dict[str, float], list[dict]]:
    """Success, format and length metrics over the first `config.max_questions` items, and every sample.

    Each batch of questions is a GRPO rollout (sampled and scored the same way) with the eval settings.
    Data-parallel: each rank answers its share of the questions; every rank returns all samples.
    """
    from train import RolloutConfig  # here, not at the top: train.py imports this module

    sampling = RolloutConfig(num_answers_per_question=config.num_samples, max_gen_len=max_gen_len,
                             temperature=config.temperature, top_p=config.top_p)
    model.eval()
    num_questions = min(len(dataset), config.max_questions or len(dataset))
    questions = distributed.shard_range(num_questions)
    samples = []
    # Under FSDP, gathered once for the whole loop: ranks may run different numbers of batches.
    with distributed.full_parameters(model):
        for start in tqdm(range(0, len(questions), config.batch_size), desc="eval", disable=not progress, leave=False):
            question_indices = questions[start : start + config.batch_size]
            batch = QuestionBatch.of_items([dataset[i] for i in question_indices])
            # progress: the generation bar moves with every decoded token, not once per batch.
            for episode in rollout(model, tokenizer, batch, reward_for_item, sampling, generator, progress):
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
    samples = [sample for rank_samples in distributed.all_gather(samples) for sample in rank_samples]
    return summarize(samples, config.num_samples), samples


def run_evaluation(model, tokenizer, dataset, reward_for_item, max_gen_len: int, config: EvalConfig, seed: int,
                   run_logger, step: int, progress: bool) -> dict[str, float]:
    """evaluate() during training, sampling from `seed`; its metrics go to TensorBoard as eval/* at
    `step` (rank 0's run_logger) and to one console line."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    metrics, samples = evaluate(model, tokenizer, dataset, reward_for_item, max_gen_len, config, generator, progress)
    if run_logger:  # rank 0 only
        run_logger.scalars({f"eval/{key}": value for key, value in metrics.items()}, step)
        run_logger.text("eval/sample", f"{samples[0]['prompt']}{samples[0]['response']}", step)
    logger.info("eval step %d: success %.3f format %.3f (%d questions)", step, metrics["success_rate"],
                metrics["format_rate"], metrics["num_questions"])
    return metrics


def summarize(samples: list[dict], num_samples: int) -> dict[str, float]:
    successes = [tasks.is_success(s["reward_info"]) for s in samples]
    metrics = {
        "success_rate": sum(successes) / len(samples),
        "format_rate": sum(tasks.is_well_formatted(s["reward_info"]) for s in samples) / len(samples),
        "mean_reward": sum(s["reward"] for s in samples) / len(samples),
        "mean_response_length": sum(s["num_tokens"] for s in samples) / len(samples),
        "num_questions": len(samples) // num_samples,
    }
    if num_samples > 1:
        per_question = [successes[i : i + num_samples] for i in range(0, len(successes), num_samples)]
        metrics[f"pass@{num_samples}"] = sum(any(group) for group in per_question) / len(per_question)
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face model directory or a training checkpoint")
    parser.add_argument("--config", help="YAML with task/eval/model sections (default: the checkpoint's config.yaml, else config.yaml)")
    parser.add_argument("--split", default="test", choices=["train", "test"])
    parser.add_argument("--samples", type=int, help="answers per question (pass@k for k > 1)")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--max-questions", type=int)
    parser.add_argument("--out", help="JSONL of every sample (default: <model>/eval_<split>.jsonl)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)

    model_dir = Path(args.model)
    config_path = args.config or next((p for p in (model_dir / "config.yaml", Path("config.yaml")) if p.is_file()), None)
    values = config_lib.read_yaml(config_path) if config_path else {}
    for assignment in args.set:
        config_lib.apply_override(values, assignment)
    task_config = config_lib.build(tasks.TaskConfig, values.get("task"), "task")
    eval_config = config_lib.build(EvalConfig, values.get("eval"), "eval")
    for field, value in (("num_samples", args.samples), ("temperature", args.temperature), ("max_questions", args.max_questions)):
        if value is not None:
            setattr(eval_config, field, value)
    max_gen_len = eval_config.max_gen_len or values.get("rollout", {}).get("max_gen_len", 1024)
    model_setup = config_lib.build(ModelSetup, values.get("model"), "model")
    device = distributed.rank_device(resolve_device(values.get("device", "auto")))

    model = load_model(model_setup, device, model_dir)
    tokenizer = Tokenizer(model_dir)
    dataset = tasks.load_dataset(task_config, tokenizer, args.split)
    generator = torch.Generator(device=device).manual_seed(values.get("seed", 0))
    metrics, samples = evaluate(
        model, tokenizer, dataset, tasks.reward_function(task_config), max_gen_len, eval_config, generator
    )
    if not distributed.is_main_process():
        return
    out_path = Path(args.out or model_dir / f"eval_{args.split}.jsonl")
    with open(out_path, "w") as out:
        for sample in samples:
            out.write(json.dumps(sample) + "\n")
    print(json.dumps(metrics, indent=2))
    print(f"wrote {len(samples)} samples to {out_path}")


if __name__ == "__main__":
    distributed.run_entry_point(main)
