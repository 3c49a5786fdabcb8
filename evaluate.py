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
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import config as config_lib
import distributed
import tasks
from generation import generate
from runtime import ModelSetup, load_model, resolve_device
from tokenizer import Tokenizer


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

    Data-parallel: each rank answers its share of the questions; every rank returns all samples.
    """
    model.eval()
    num_questions = min(len(dataset), config.max_questions or len(dataset))
    questions = distributed.shard_range(num_questions)
    samples = []
    # Under FSDP, gathered once for the whole loop: ranks may run different numbers of batches.
    with distributed.full_parameters(model):
        for start in tqdm(range(0, len(questions), config.batch_size), desc="eval", disable=not progress, leave=False):
            question_indices = questions[start : start + config.batch_size]
            items = [dataset[i] for i in question_indices]
            completions = generate(
                model,
                [item["prompt_token_ids"] for item in items],
                num_samples_per_prompt=config.num_samples,
                max_gen_len=max_gen_len,
                eos_token_id=tokenizer.eos_token_id,
                temperature=config.temperature,
                top_p=config.top_p,
                generator=generator,
            )
            for index, completion in enumerate(completions):
                item = items[index // config.num_samples]
                response = tokenizer.decode(completion.token_ids)
                score = reward_for_item(response, item, tokenizer.eos_token)
                samples.append(
                    {
                        "question_index": question_indices[index // config.num_samples],
                        **{key: value for key, value in item.items() if key != "prompt_token_ids"},
                        "response": response,
                        "num_tokens": len(completion.token_ids),
                        "finished": completion.finished,
                        **score,
                    }
                )
    samples = [sample for rank_samples in distributed.all_gather(samples) for sample in rank_samples]
    return summarize(samples, config.num_samples), samples


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
