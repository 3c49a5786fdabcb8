"""Supervised fine-tuning on prompt/response pairs: the warm-up stage before GRPO.

    uv run train_sft.py --config FILE [--set section.key=value ...] [--overwrite]
    uv run train_sft.py --resume CHECKPOINT_OR_RUN_DIR [--set section.key=value ...]
    uv run torchrun --nproc_per_node N train_sft.py --config FILE   # data-parallel (see distributed.py)

Pairs come from a JSONL file of {"prompt", "response"} lines, or from the task's own training split
with its reference solutions (CountDown generated with --with-solutions, GSM8K worked solutions).
The loss is the NLL of response tokens only (eos included, so the model learns to stop), averaged
over every response token of the optimizer step. The result is a Hugging Face model directory.
Evaluations score the held-out loss and success on held-out training questions (the test split stays
unseen); optim.stop_at_success ends the warm-up once that success reaches a target. Checkpoints to
resume from go to <checkpoint.dir>/<run_name>/step_NNNNNN every checkpoint.interval steps and when
the run is stopped by Ctrl-C or SIGTERM.
"""

import functools
import json
import logging
import math
import time
from pathlib import Path

import checkpoint
import config as config_lib
import inputs
from config import SFTConfig, SFTOptimConfig

# ----------------------------------------------------------------------------- command line
# Read and validated before the imports below load torch (seconds): --help and a config error answer at once.


def read_command_line(argv: list[str] | None = None) -> checkpoint.RunPlan:
    """The run's plan, from the arguments and the config, every input checked that can be before torch loads."""
    config, args, checkpoint_dir = checkpoint.read_run_command_line(SFTConfig, "sft", __doc__, None, argv)
    return plan_run(config, args.resume, args.overwrite, checkpoint_dir)


def plan_run(config: SFTConfig, resume: str | None = None, overwrite: bool = False,
             checkpoint_dir: Path | None = None) -> checkpoint.RunPlan:
    """The one plan of a start (checkpoint.RunPlan), from the command line or from train_sft(config, ...)."""
    config_lib.check_device_usable(config.device)
    checkpoint.plan_resume(config, resume, checkpoint_dir, run_name_prefix="sft-")
    check_inputs(config, resuming=checkpoint_dir is not None)
    check_output_outside(config.output_dir, Path(config.checkpoint.dir) / config.run_name)
    return checkpoint.RunPlan(config, resume, checkpoint_dir, overwrite, lengths_checked=False)


def check_inputs(config: SFTConfig, resuming: bool = False) -> None:
    """The model (resuming: the checkpoint is the model, except that a LoRA run's adapters go on model.dir), the
    pairs' files or the task's data, and the directories written, before torch loads."""
    # The pairs come from the JSONL files or from the task's training split (then with its reference solutions);
    # the evaluations may answer the task's questions. Hub ids are fetched here.
    splits = (() if config.data.train_jsonl else ("train",)) + (
        ("test",) if answers_task_questions(config) and (config.data.train_jsonl or config.data.eval_jsonl) else ())
    model = None if resuming and not config.model.lora.enabled else config.model
    inputs.check_model_and_data(config.task if splits else None, model, splits=splits,
                                with_solutions=not config.data.train_jsonl)
    if model:
        config.model.lora.check_width(inputs.read_hf_config(Path(model.dir)))
    for key in ("train_jsonl", "eval_jsonl"):
        if getattr(config.data, key):
            with inputs.named(f"data.{key}"):
                read_pairs(getattr(config.data, key))
    inputs.check_writable("output_dir", config.output_dir)
    for key, directory in (("checkpoint.dir", config.checkpoint.dir), ("logging.log_dir", config.logging.log_dir)):
        inputs.check_writable(key, Path(directory) / config.run_name)


def check_output_outside(output_dir: str, run_directory: Path) -> None:
    """The fine-tuned model replaces output_dir as a whole: the run's checkpoints must not be inside it."""
    output, run = Path(output_dir).resolve(), run_directory.resolve()
    if output == run or output in run.parents:
        raise config_lib.ConfigError(f"output_dir: must not hold the run's checkpoint directory {run_directory} "
                                     f"(checkpoint.dir/run_name); change output_dir, checkpoint.dir or run_name, "
                                     f"got {output_dir!r}")


def answers_task_questions(config: SFTConfig) -> bool:
    """Whether the evaluations answer the task's questions (task_eval_set), beside the held-out loss."""
    return bool(config.eval.interval) and config.eval.max_questions != 0


def read_pairs(path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise config_lib.MissingInputError(f"SFT data file '{path}' does not exist (JSONL with \"prompt\" and "
                                           "\"response\" keys)")
    # Iterate over the file's lines, not str.splitlines(): that also splits at U+2028, which GSM8K contains.
    pairs = []
    with path.open(encoding="utf-8-sig") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                pair = json.loads(line)
            except json.JSONDecodeError as error:
                raise config_lib.DataError(f"{path} line {number}: not JSON ({error.msg} at column {error.colno})") from None
            if not isinstance(pair, dict) or not isinstance(pair.get("prompt"), str) or not isinstance(
                    pair.get("response"), str):
                raise config_lib.DataError(f"{path} line {number}: every line must be a JSON object with string "
                                           f"\"prompt\" and \"response\" keys, got {line.strip()[:100]}")
            pairs.append(pair)
    if not pairs:
        raise config_lib.DataError(f"{path}: no pairs (JSONL with \"prompt\" and \"response\" keys)")
    return pairs


# As a script: --help and bad input answered before torch loads; main() goes on with this plan.
COMMAND_LINE = config_lib.check_command_line(__name__, read_command_line)

import torch

import distributed
import tasks
from evaluate import run_evaluation
from logprobs import answer_batch, answer_log_probs
from optimizer import new_adamw
from run_logging import log_to_console, progress_bar
from runtime import load_policy, step_indices
from training_run import RunStopped, TrainingRun, exit_on_interrupt
from tokenizer import Tokenizer

logger = logging.getLogger("train_sft")
TOKENIZE_BATCH = 1024  # pairs per encode_batch call; progress is reported between them

# ----------------------------------------------------------------------------- data and loss


def tokenize_pairs(pairs: list[dict], tokenizer, max_seq_len: int, progress: bool = False) -> list[tuple[list[int], int]]:
    """(token ids, number of prompt tokens) per pair that fits max_seq_len; the response ends with eos. Prompt
    and response are encoded apart (as the prompt alone is at generation), in batches: encode_batch runs on
    every core."""
    examples, shortest = [], None
    bar = progress_bar(desc="tokenizing", total=len(pairs), unit="pair", enabled=progress)
    for start in range(0, len(pairs), TOKENIZE_BATCH):
        batch = pairs[start : start + TOKENIZE_BATCH]
        prompts = tokenizer.encode_batch([pair["prompt"] for pair in batch])
        responses = tokenizer.encode_batch([pair["response"] for pair in batch])
        for prompt_ids, response_ids in zip(prompts, responses):
            ids = prompt_ids + response_ids + [tokenizer.eos_token_id]
            shortest = len(ids) if shortest is None else min(shortest, len(ids))
            if len(ids) <= max_seq_len:
                examples.append((ids, len(prompt_ids)))
        bar.update(len(batch))
    bar.close()
    config_lib.check(bool(examples), "data.max_seq_len", f"no SFT example fits (the shortest has {shortest} "
                     f"tokens): raise it to at least {shortest}", max_seq_len)
    return examples


def with_responses(pairs: list[dict], config: SFTConfig) -> list[dict]:
    """The pairs that have a response: a full search leaves out the questions it needs too many tries for."""
    kept = [pair for pair in pairs if pair["response"] is not None]
    config_lib.check(bool(kept), "data.search_max_tries", "the search solves none of these questions within "
                     "that many tries: raise it", config.data.search_max_tries)
    if len(kept) < len(pairs):
        logger.info("data.response full_search: %d of %d questions solved within %d tries; the rest left out",
                    len(kept), len(pairs), config.data.search_max_tries)
    return kept


def load_examples(config: SFTConfig, tokenizer):
    if config.data.train_jsonl:
        train_pairs = read_pairs(config.data.train_jsonl)
    else:
        train_pairs = tasks.sft_pairs(config.task, tokenizer, config.data)
    if config.data.eval_jsonl:
        eval_pairs = read_pairs(config.data.eval_jsonl)
    else:
        config_lib.check(config.data.eval_size < len(train_pairs), "data.eval_size", f"must leave training pairs: "
                         f"below the {len(train_pairs)} pairs there are", config.data.eval_size)
        # Split by row before leaving any out, so the held-out pairs stay those of task_eval_set's questions.
        eval_pairs, train_pairs = train_pairs[-config.data.eval_size :], train_pairs[: -config.data.eval_size]
    train_pairs, eval_pairs = with_responses(train_pairs, config), with_responses(eval_pairs, config)
    progress = config.progress and distributed.is_main_process()
    return (tokenize_pairs(train_pairs, tokenizer, config.data.max_seq_len, progress),
            tokenize_pairs(eval_pairs, tokenizer, config.data.max_seq_len, progress))


def response_nll(model, examples, pad_token_id: int, chunk_size: int) -> tuple[torch.Tensor, int]:
    """Summed NLL of the response tokens of `examples`, and how many tokens that is."""
    scored = answer_batch([ids for ids, _ in examples], [prompt_length for _, prompt_length in examples],
                          pad_token_id, next(model.parameters()).device)
    log_probs, _ = answer_log_probs(model, scored, chunk_size, with_entropy=False)
    mask = scored.mask
    # The count from the host's lists: reading mask.sum() would wait for the device.
    return -(log_probs * mask).sum(), sum(len(ids) - prompt_length for ids, prompt_length in examples)


@torch.no_grad()
def held_out_loss(model, examples, config: SFTConfig, pad_token_id: int) -> float:
    """Mean response-token NLL; each rank scores its share of the examples."""
    model.eval()
    examples = [examples[i] for i in distributed.shard_range(len(examples))]
    # float64 on the device, read once: the same sum as Python floats, without a wait per micro-batch.
    total_nll, num_tokens = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device), 0
    # Under FSDP, gathered once: the ranks' shares may take different numbers of forwards.
    with distributed.full_parameters(model):
        for start in range(0, len(examples), config.optim.micro_batch_size):
            nll, tokens = response_nll(model, examples[start : start + config.optim.micro_batch_size], pad_token_id,
                                       config.optim.logprob_chunk_size)
            total_nll, num_tokens = total_nll + nll.double(), num_tokens + tokens
    totals = distributed.global_sums({"nll": total_nll.item(), "tokens": num_tokens})
    return totals["nll"] / totals["tokens"]


def learning_rate(step: int, config: SFTOptimConfig) -> float:
    """Linear warm-up, then cosine decay to min_learning_rate_ratio x learning_rate."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.num_steps - config.warmup_steps)
    floor = config.min_learning_rate_ratio
    return config.learning_rate * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def task_eval_set(config: SFTConfig, tokenizer) -> torch.utils.data.Dataset:
    """The questions whose success SFT reports: those of the held-out pairs when the pairs come from the task's
    training split (never trained on, and the test split stays unseen until GRPO), else the test split."""
    if config.data.train_jsonl or config.data.eval_jsonl:
        return tasks.load_dataset(config.task, tokenizer, "test")
    train_set = tasks.load_dataset(config.task, tokenizer, "train")
    return torch.utils.data.Subset(train_set, range(max(0, len(train_set) - config.data.eval_size), len(train_set)))


def evaluate_sft(model, tokenizer, *, eval_examples, eval_set, config: SFTConfig, run_logger, step: int) -> dict:
    """The held-out loss, then (unless eval.max_questions is 0) success on `eval_set`, as eval/* metrics."""
    metrics = {"eval/loss": held_out_loss(model, eval_examples, config, tokenizer.pad_token_id)}
    if run_logger:  # rank 0 only
        run_logger.scalars(metrics, step)
    logger.info("eval step %d: held-out loss %.4g", step, metrics["eval/loss"])
    if config.eval.max_questions != 0:
        task_metrics = run_evaluation(model, tokenizer, eval_set, reward=tasks.get(config.task).reward,
                                      max_gen_len=config.eval.max_gen_len or config.data.max_seq_len,
                                      config=config.eval, seed=config.seed, run_logger=run_logger, step=step,
                                      progress=config.progress and distributed.is_main_process())
        metrics.update({f"eval/{key}": value for key, value in task_metrics.items()})
    return metrics


def reached_target(metrics: dict, config: SFTOptimConfig) -> bool:
    return config.stop_at_success is not None and metrics.get("eval/success_rate", 0.0) >= config.stop_at_success


def train_sft(config: SFTConfig, resume: str | None = None, overwrite: bool = False) -> dict:
    """Fine-tune config.model.dir into config.output_dir, its inputs checked first as on the command line;
    returns the last evaluation's metrics and the steps run.

    Every checkpoint.interval steps, and when stopped by Ctrl-C or SIGTERM, the run writes a checkpoint to
    <checkpoint.dir>/<run_name>/step_NNNNNN; `resume` (one, or its run directory) continues from it exactly.
    """
    return train_sft_from(plan_run(config, resume, overwrite, checkpoint.find(resume)))


def train_sft_from(plan: checkpoint.RunPlan) -> dict:
    """Fine-tune as planned (plan_run); returns the last evaluation's metrics and the steps run."""
    config = plan.config
    run = TrainingRun(plan, script="train_sft.py",  # training_run.py: the life of a run, as train.py's
                      checkpoint_last_step=False)  # the last step goes to output_dir
    run.claim()
    with run.loading():
        tokenizer = Tokenizer(run.model_dir)  # the data before the model: a data error comes before minutes of loading
        train_examples, eval_examples = load_examples(config, tokenizer)
        eval_set = task_eval_set(config, tokenizer) if answers_task_questions(config) else None
        model, policy = load_policy(config.model, run.model_dir, run.device, config.distributed.fsdp,
                                    adapter_dir=run.adapter_dir, seed=config.seed)
        optimizer = new_adamw(model.parameters(), config.optim)
        optimizer_step = distributed.OptimizerStep(policy, optimizer, config.optim.max_grad_norm)
        metrics = run.restore(model, optimizer).get("metrics", {})
    run_logger = run.open_logger()  # rank 0 only
    logger.info("SFT %s on %s: %d train / %d held-out pairs, logs in %s", config.run_name, run.device,
                len(train_examples), len(eval_examples), run.log_directory)

    evaluation = functools.partial(evaluate_sft, model, tokenizer, eval_examples=eval_examples, eval_set=eval_set,
                                   config=config, run_logger=run_logger)
    if config.eval.interval and run.start_step == 0:
        metrics = evaluation(step=0)
    optim = config.optim
    for step in run.steps(optim.num_steps, desc="sft"):
        if reached_target(metrics, optim):
            break
        step_metrics = sft_step(policy, optimizer_step, train_examples, step=step, config=config,
                                pad_token_id=tokenizer.pad_token_id)
        if run_logger:
            run_logger.scalars(step_metrics, step)
        run.bar.set_postfix(loss=f"{step_metrics['train/loss']:.3f}", grad=f"{step_metrics['train/grad_norm']:.3f}",
                            lr=f"{step_metrics['train/learning_rate']:.2e}")
        if config.eval.interval and (step % config.eval.interval == 0 or step == optim.num_steps):
            metrics = evaluation(step=step)
        run.end_step(step, model, optimizer, extra_state={"metrics": metrics}, done=reached_target(metrics, optim))
    if reached_target(metrics, optim):
        logger.info("held-out success %.3f >= optim.stop_at_success %g after %d steps: stopping",
                    metrics["eval/success_rate"], optim.stop_at_success, run.last_step)
    if not run.stopping:
        savable = distributed.savable_model(model)  # every rank takes part: FSDP gathers the shards
        if distributed.is_main_process():
            saved = checkpoint.save(config.output_dir, savable, run.model_dir, run_config=config)
            logger.info("saved the fine-tuned model to %s", saved)
        distributed.barrier()  # no rank goes on (and may read it) before the model is complete
    run.finish()
    return {**metrics, "steps": run.last_step}


def sft_step(policy, optimizer_step, train_examples, *, step: int, config: SFTConfig,
             pad_token_id: int) -> dict[str, float]:
    """Optimizer step `step` (1, 2, ...) on its batch of training pairs; returns its train/* metrics."""
    start = time.perf_counter()
    optim = config.optim
    policy.train()
    indices = step_indices(step - 1, optim.batch_size, len(train_examples), config.seed)
    batch = [train_examples[indices[i]] for i in distributed.shard_range(optim.batch_size)]
    batch.sort(key=lambda example: len(example[0]))  # similar lengths per micro-batch: less padding
    # Divided by the step's token count over all ranks, so the summed gradients are the single-process ones.
    num_tokens = distributed.global_sum(sum(len(ids) - prompt_length for ids, prompt_length in batch))
    # Summed on the device and read once per step: a host read per micro-batch stalls the device.
    total_nll = torch.zeros((), dtype=torch.float64, device=next(policy.parameters()).device)
    starts = range(0, len(batch), optim.micro_batch_size)
    for start_index in starts:
        with optimizer_step.micro_batch(last=start_index == starts[-1]):
            nll, _ = response_nll(policy, batch[start_index : start_index + optim.micro_batch_size], pad_token_id,
                                  optim.logprob_chunk_size)
            (nll / num_tokens).backward()
        total_nll += nll.detach().double()
    total_nll = distributed.global_sum(total_nll.item())
    optimizer = optimizer_step.optimizer
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step - 1, optim)
    grad_norm = optimizer_step()
    return {"train/loss": total_nll / num_tokens, "train/grad_norm": grad_norm,
            "train/learning_rate": optimizer.param_groups[0]["lr"],
            "train/tokens_per_second": num_tokens / (time.perf_counter() - start)}


def main(argv: list[str] | None = None) -> None:
    log_to_console(logging.INFO if distributed.is_main_process() else logging.WARNING)
    try:
        train_sft_from(COMMAND_LINE if argv is None and COMMAND_LINE else read_command_line(argv))
    except config_lib.InputError as error:  # config or data: one line, exit code 2
        config_lib.exit_on_input_error(error)
    except (RunStopped, KeyboardInterrupt) as stop:  # Ctrl-C or SIGTERM: one line, exit code 128 + signal
        exit_on_interrupt(stop)


if __name__ == "__main__":
    distributed.run_entry_point(main)
