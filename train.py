"""GRPO training: one loop of sample -> score -> update, with evaluation, logging and checkpoints.

    uv run train.py [--config config.yaml ...] [--set section.key=value ...] [--resume CHECKPOINT_OR_RUN_DIR | --overwrite]
    uv run torchrun --nproc_per_node N train.py ...   # data-parallel over N GPUs (see distributed.py)
"""

import functools
import logging
from pathlib import Path

import bootstrap
import checkpoint
import config as config_lib
import inputs
from config import TrainConfig

# ----------------------------------------------------------------------------- command line
# Read and validated before the imports below load torch (seconds): --help and a config error answer at once.


def read_command_line(argv: list[str] | None = None) -> checkpoint.RunPlan:
    """The run's plan, from the arguments and the config, every input checked that can be before torch loads."""
    config, args, checkpoint_dir = checkpoint.read_run_command_line(TrainConfig, "grpo", __doc__, "config.yaml", argv)
    return plan_run(config, args.resume, args.overwrite, checkpoint_dir)


def plan_run(config: TrainConfig, resume: str | None = None, overwrite: bool = False,
             checkpoint_dir: Path | None = None) -> checkpoint.RunPlan:
    """The one plan of a start (checkpoint.RunPlan), from the command line or from train(config, ...)."""
    config_lib.check_device_usable(config.device)
    checkpoint.plan_resume(config, resume, checkpoint_dir)
    return checkpoint.RunPlan(config, resume, checkpoint_dir, overwrite, check_inputs(config, checkpoint_dir))


def check_inputs(config: TrainConfig, checkpoint_dir: Path | None) -> bool:
    """Model, data, the directories the run writes and the lengths the model allows, checked before torch loads:
    a mistake is answered at once and creates nothing. Returns whether the lengths could be checked (a model the
    bootstrap builds is checked as it loads)."""
    # Resuming, the checkpoint is the model; a LoRA run's holds only its adapters, which go on model.dir.
    from_checkpoint = checkpoint_dir and not config.model.lora.enabled
    inputs.check_model_and_data(config.task, None if from_checkpoint else config.model, bootstrap=config.bootstrap)
    model_dir = Path(checkpoint_dir if from_checkpoint else config.model.dir)
    if not model_dir.exists():  # check_model_and_data: the bootstrap builds it; its warm-up's config, now
        config_lib.warm_up_config(config.bootstrap, config.task, config.model.dir)
    hf_config = inputs.read_hf_config(model_dir) if model_dir.is_dir() else {}
    if hf_config:
        config.model.lora.check_width(hf_config)
    if "max_position_embeddings" in hf_config:
        config.validate_for_model(hf_config["max_position_embeddings"])
    for key, directory in (("checkpoint.dir", config.checkpoint.dir), ("logging.log_dir", config.logging.log_dir)):
        inputs.check_writable(key, Path(directory) / config.run_name)
    return "max_position_embeddings" in hf_config


# As a script: --help and bad input answered before torch loads; main() goes on with this plan.
COMMAND_LINE = config_lib.check_command_line(__name__, read_command_line)

import torch

import distributed
import tasks
from data_types import Episode, QuestionBatch
from evaluate import run_evaluation
from grpo import compute_advantages, overlong_penalty, rollout, sample_step, shape_rewards, update_policy
from optimizer import new_adamw
from qwen2_model import WithoutAdapters
from run_logging import log_to_console
from runtime import load_model, load_policy, release_freed_cpu_memory, step_indices
from training_run import RunStopped, TrainingRun, exit_on_interrupt
from tokenizer import Tokenizer

logger = logging.getLogger("train")


# ----------------------------------------------------------------------------- data order


PROMPTS_CHECKED = 64  # prompts check_prompts_fit tokenizes: enough to find one that fits, few enough to be instant


def check_prompts_fit(dataset, max_prompt_len: int) -> None:
    """Refuse a rollout.max_prompt_len that none of the first training prompts fits: make_batch would leave out
    (nearly) every question, and searching all of CountDown's 490k rows for one that fits takes minutes."""
    shortest = min(len(dataset[index]["prompt_token_ids"]) for index in range(min(len(dataset), PROMPTS_CHECKED)))
    config_lib.check(shortest <= max_prompt_len, "rollout.max_prompt_len", f"none of the first {PROMPTS_CHECKED} "
                     f"training prompts fits (the shortest has {shortest} tokens): raise it to at least {shortest}",
                     max_prompt_len)


def make_batch(dataset, indices: list[int], max_prompt_len: int) -> QuestionBatch:
    """The items at `indices`; a prompt over max_prompt_len is replaced by the next one that fits.

    Checking lazily keeps start-up instant on the 490k-row CountDown set; the replacement is still
    a fixed function of the index, so runs stay reproducible and resumable.
    """
    items = []
    for index in indices:
        for candidate in range(index, index + len(dataset)):
            item = dataset[candidate % len(dataset)]
            if len(item["prompt_token_ids"]) <= max_prompt_len:
                break
        else:
            raise ValueError(f"no prompt in the training set fits rollout.max_prompt_len={max_prompt_len}; raise it.")
        items.append(item)
    return QuestionBatch.of_items(items)


# ----------------------------------------------------------------------------- the loop


def episode_metrics(episodes: list[Episode], num_answers_per_question: int) -> dict[str, float]:
    rewards = torch.tensor([e.reward for e in episodes])
    lengths = torch.tensor([e.num_generated_tokens for e in episodes], dtype=torch.float)
    grouped = rewards.view(-1, num_answers_per_question)
    metrics = {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std(correction=0).item(),
        "reward/format": sum(e.reward_info["format_reward"] for e in episodes) / len(episodes),
        "reward/answer": sum(e.reward_info["answer_reward"] for e in episodes) / len(episodes),
        "train/success_rate": sum(tasks.is_success(e.reward_info) for e in episodes) / len(episodes),
        # The share of well-formatted answers, as evaluate.py's format_rate (reward/format is the mean reward).
        "train/format_rate": sum(tasks.is_well_formatted(e.reward_info) for e in episodes) / len(episodes),
        "train/zero_spread_group_fraction": (grouped.max(1).values == grouped.min(1).values).float().mean().item(),
        "train/finished_episodes": float(sum(e.is_finished for e in episodes)),
        "response_length/mean": lengths.mean().item(),
        "response_length/min": lengths.min().item(),
        "response_length/max": lengths.max().item(),
    }
    if "try_reward" in episodes[0].reward_info:  # CountDown's: the share of the think's tries that are exact
        metrics["reward/tries"] = sum(e.reward_info["try_reward"] for e in episodes) / len(episodes)
        metrics["reward/distinct_tries"] = sum(e.reward_info["distinct_try_reward"] for e in episodes) / len(episodes)
    return metrics


def format_episode(episode: Episode) -> str:
    return (f"reward {episode.reward:.2f} {episode.reward_info}  finished={episode.is_finished}\n"
            f"--- prompt ---\n{episode.prompt}\n--- response ---\n{episode.text}")


def train(config: TrainConfig, resume: str | None = None, overwrite: bool = False) -> dict:
    """Run GRPO as configured, its inputs checked first as on the command line; returns the last evaluation's
    metrics (empty if none ran)."""
    return train_from(plan_run(config, resume, overwrite, checkpoint.find(resume)))


def train_from(plan: checkpoint.RunPlan) -> dict:
    """Run GRPO as planned (plan_run); returns the last evaluation's metrics (empty if none ran)."""
    config = plan.config
    run = TrainingRun(plan, script="train.py")  # training_run.py: the life of a run, as train_sft.py's
    run.claim()
    with run.loading():
        if distributed.world_size() == 1:  # ranks would race to write the same files: bootstrap single-process
            base_model = None if run.checkpoint_dir else config.model  # resuming, the checkpoint is the model
            bootstrap.prepare_missing_inputs(config.bootstrap, config.task, base_model, config.rollout.max_prompt_len)
        tokenizer = Tokenizer(run.model_dir)
        train_set, test_set = (tasks.load_dataset(config.task, tokenizer, split) for split in ("train", "test"))
        check_prompts_fit(train_set, config.rollout.max_prompt_len)
        # CountDown's (config.py checked): the questions GRPO asks, then those it asks more often
        asked_set = train_set if config.rollout.train_number_counts is None else train_set.with_number_counts(
            config.rollout.train_number_counts)
        repeated_set = asked_set if config.rollout.outside_forms_repeat == 1 else asked_set.with_outside_forms_repeated(
            config.rollout.outside_forms_repeat, config.rollout.outside_forms_numbers)
        reward = tasks.get(config.task).reward
        if not plan.lengths_checked:  # a model the bootstrap just built
            config.model.lora.check_width(inputs.read_hf_config(run.model_dir))
        model, policy = load_policy(config.model, run.model_dir, run.device, config.distributed.fsdp,
                                    adapter_dir=run.adapter_dir, seed=config.seed)
        if not plan.lengths_checked:
            config.validate_for_model(model.config.max_position_embeddings)
        reference_model = None
        if config.loss.kl_beta:  # the KL anchor: the initial policy (model.dir, also on resume), frozen, same dtype;
            # with LoRA that is the model with its adapters off: no second copy of the weights
            reference_model = (WithoutAdapters(model) if config.model.lora.enabled
                               else load_model(config.model, run.device).requires_grad_(False).eval())
        optimizer = new_adamw(model.parameters(), config.optim)
        optimizer_step = distributed.OptimizerStep(policy, optimizer, config.optim.max_grad_norm)
        generator = torch.Generator(device=run.device).manual_seed(config.seed + distributed.rank())
        run.restore(model, optimizer, generator)
    run_logger = run.open_logger()  # rank 0 only
    logger.info("run %s on %s: %d train / %d test questions, logs in %s", config.run_name, run.device, len(train_set),
                len(test_set), run.log_directory)

    evaluation = functools.partial(run_evaluation, model, tokenizer, test_set, reward=reward,
                                   max_gen_len=config.eval.max_gen_len or config.rollout.max_gen_len, config=config.eval,
                                   seed=config.seed, run_logger=run_logger, progress=run.progress,
                                   baseline=tasks.shortcut_baseline(config.task, train_set))
    eval_metrics = evaluation(step=0) if config.eval.interval and run.start_step == 0 else {}

    def sample_round(step: int, round_index: int) -> list[Episode]:  # this rank's share of a round's questions
        questions = repeated_set if step > config.rollout.outside_forms_repeat_after else asked_set
        batch = question_batch(questions, step, config, round_index)
        return rollout(model, tokenizer, batch, reward, config=config.rollout, generator=generator,
                       progress=run.progress)

    zero_reward_steps = 0  # consecutive steps in which no episode earned any reward
    for step in run.steps(config.optim.num_steps, desc="grpo"):
        if config.rollout.release_cpu_memory:  # what the last update freed, before the rollout's KV cache is mapped
            release_freed_cpu_memory(run.device)
        episodes, kept, sampling = sample_step(model, functools.partial(sample_round, step), config.rollout)
        train_episodes = episodes_to_train(kept, config)
        advantages = compute_advantages(train_episodes, config.loss)
        update = update_policy(policy, optimizer_step, train_episodes, advantages, config=config.loss,
                               optim=config.optim, max_gen_len=config.rollout.max_gen_len,
                               pad_token_id=tokenizer.pad_token_id, reference_model=reference_model,
                               progress=run.progress)
        metrics, all_episodes = step_metrics(episodes, update=update, sampling=sampling,
                                             learning_rate=optimizer.param_groups[0]["lr"], config=config)
        log_step(run_logger, step, metrics, episodes=all_episodes, config=config)
        zero_reward_steps = 0 if any(e.reward > 0 for e in all_episodes) else zero_reward_steps + 1
        if zero_reward_steps and zero_reward_steps == config.optim.warn_after_zero_reward_steps:
            warn_no_reward(config, zero_reward_steps)
        if config.eval.interval and step % config.eval.interval == 0:
            eval_metrics = evaluation(step=step)
        run.end_step(step, model, optimizer, generator=generator)
    run.finish()
    return eval_metrics


# ----------------------------------------------------------------------------- per step


def question_batch(train_set, step: int, config: TrainConfig, round_index: int = 0) -> QuestionBatch:
    """This rank's share of a rollout round's questions (a fixed function of step and round, so runs resume
    exactly).

    Round 0 draws from one shuffle of the training set; dynamic sampling's extra rounds (round_index >= 1)
    from a second. Without rollout.dynamic_sampling_questions_per_round, round 0 asks the same questions as
    a run without dynamic sampling.
    """
    count = config.rollout.questions_per_round
    if round_index == 0:
        indices = step_indices(step - 1, count, len(train_set), config.seed)
    else:
        extra_round = (step - 1) * (config.rollout.dynamic_sampling_max_rounds - 1) + round_index - 1
        indices = step_indices(extra_round, count, len(train_set), config.seed + 1)
    share = count // distributed.world_size()
    return make_batch(train_set, indices[distributed.rank() * share : (distributed.rank() + 1) * share],
                      config.rollout.max_prompt_len)


def episodes_to_train(episodes: list[Episode], config: TrainConfig) -> list[Episode]:
    """The step's episodes as the update sees them: the format and try rewards weighted and DAPO's overlong
    penalty shaped into the reward (the logged rewards stay the task's; dynamic sampling, as DAPO's, judges groups by
    them too), and unfinished ones left out with optim.skip_unfinished_episodes."""
    episodes = shape_rewards(episodes, config.rollout.max_gen_len, config.loss)
    if config.optim.skip_unfinished_episodes:
        episodes = [e for e in episodes if e.is_finished]
    return episodes


def step_metrics(episodes: list[Episode], *, update: dict[str, float], sampling: dict[str, float],
                 learning_rate: float, config: TrainConfig) -> tuple[dict[str, float], list[Episode]]:
    """The step's metrics over every rank's episodes (`update`'s are already every rank's), and those episodes."""
    episodes = distributed.all_ranks(episodes)
    rollout_seconds = sampling["time/rollout_seconds"]
    metrics = {
        **episode_metrics(episodes, config.rollout.num_answers_per_question),
        **{f"train/{key}": value for key, value in update.items()},
        "train/update_skipped": float(not update),
        "train/learning_rate": learning_rate,
        **sampling,  # time/rollout_seconds, and dynamic sampling's rounds
        "time/generated_tokens_per_second": sum(e.num_generated_tokens for e in episodes) / rollout_seconds,
    }
    if config.loss.overlong_buffer_fraction:  # over every sampled answer, as the other reward metrics
        metrics["reward/overlong_penalty"] = sum(overlong_penalty(e.num_generated_tokens, config.rollout.max_gen_len,
                                                                  config.loss) for e in episodes) / len(episodes)
    return metrics, episodes


def log_step(run_logger, step: int, metrics: dict[str, float], *, episodes: list[Episode], config: TrainConfig) -> None:
    """The step's metrics into the console line and TensorBoard, and some of its episodes as text (rank 0 writes)."""
    if not run_logger:
        return
    run_logger.scalars(metrics, step)
    head = (f"step {step} | reward {metrics['reward/mean']:.3f} | success {metrics['train/success_rate']:.3f} | "
            f"format {metrics['train/format_rate']:.3f} | flat groups {metrics['train/zero_spread_group_fraction']:.2f}")
    rollout = (f"len {metrics['response_length/mean']:.0f} | rollout {metrics['time/rollout_seconds']:.1f}s "
               f"({metrics['time/generated_tokens_per_second']:.0f} tok/s)")
    if not metrics["train/update_skipped"]:
        logger.info("%s | loss %.4f | grad %.3f | entropy %.3f | %s | update %.1fs", head, metrics["train/loss"],
                    metrics["train/grad_norm"], metrics["train/entropy"], rollout, metrics["train/update_seconds"])
    else:  # no episode has a nonzero advantage (or none is left): the gradient would be exactly 0
        logger.info("%s | update skipped: no reward spread in any group | %s", head, rollout)
    if config.logging.sample_interval and step % config.logging.sample_interval == 0:
        for index, episode in enumerate(episodes[: config.logging.num_samples]):
            run_logger.text(f"episodes/{index}", format_episode(episode), step)


def warn_no_reward(config: TrainConfig, steps: int) -> None:
    if not distributed.is_main_process():
        return
    logger.warning(
        "no episode has earned any reward for %d steps in a row. The model (%s) does not yet write the answer "
        "format the %s reward checks, so every group has zero reward spread, every advantage is 0 and GRPO has "
        "nothing to learn from (these updates are skipped). A small or base model needs the SFT warm-up on the "
        "task's reference solutions first:\n"
        "    uv run train_sft.py --config %s --set model.dir=%s --set task.data_dir=%s --set output_dir=%s-sft\n"
        "(a pretrained model wants a small rate, e.g. --set optim.learning_rate=1e-5), then train from it with "
        "--set model.dir=%s-sft. optim.warn_after_zero_reward_steps sets when this warning appears (0: never).",
        steps, config.model.dir, config.task.name, tasks.sft_config_of(config.task) or "FILE", config.model.dir,
        config.task.data_dir, config.model.dir, config.model.dir)


def main(argv: list[str] | None = None) -> None:
    log_to_console(logging.INFO if distributed.is_main_process() else logging.WARNING)
    try:
        train_from(COMMAND_LINE if argv is None and COMMAND_LINE else read_command_line(argv))
    except config_lib.InputError as error:  # config, data, run directory or checkpoint: one line, exit code 2
        config_lib.exit_on_input_error(error)
    except (RunStopped, KeyboardInterrupt) as stop:  # Ctrl-C or SIGTERM: one line, exit code 128 + signal
        exit_on_interrupt(stop)


if __name__ == "__main__":
    distributed.run_entry_point(main)
