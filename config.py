"""Every config section as a dataclass with its allowed ranges, and the YAML loading that fills them.

A config file is nested sections of plain keys. Unknown keys, wrong types, values outside a
`Literal`, a float that is not finite (inf, nan) and values outside a key's range (each section's
`validate()`, built from the checks below) stop the run before any work, with
`config error: <key>: <what is allowed>, got <value>`.
`--set section.key=value` overrides any key (the value is parsed as YAML); several config files
merge in order, later files winning.

This module imports nothing heavy (no torch), so an entry point reads and checks its command line
before it loads torch: --help and a config error answer at once (see check_command_line).
"""

import dataclasses
import importlib.util
import math
import os
import re
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

Config = TypeVar("Config")


class InputError(ValueError):
    """A problem with what the user gave: reported as one line (no traceback) and exit code 2."""

    label = "error"


class ConfigError(InputError):
    label = "config error"


class DataError(InputError):
    label = "data error"


class MissingInputError(InputError, FileNotFoundError):
    label = "missing input"


def exit_on_input_error(error: InputError) -> typing.NoReturn:
    """What every entry point does with an InputError: `<label>: <message>` on stderr, one line (a library's
    message quoted in it may span several), exit code 2."""
    message = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    print(f"{error.label}: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_command_line(module_name: str, read_command_line: Callable[[list[str] | None], object]) -> object:
    """When the entry point runs as a script (`module_name` is its `__name__`, "__main__"), read and validate
    its command line (arguments, config files, --set) and return what `read_command_line` returns, exiting on
    --help, a usage error or an input error; else, or when it is imported (tests, ablate.py), return None.

    Entry points call it at the top of the file, before their heavy imports: torch alone takes seconds
    to load, and --help or a config error should not wait for it. `read_command_line` imports nothing
    heavy; the file's one `if __name__ == "__main__":` block, at its end, runs main(), which goes on with
    what this returned (a main() given its own arguments reads them itself).
    """
    if module_name != "__main__":
        return None
    try:
        return read_command_line(None)
    except InputError as error:
        exit_on_input_error(error)


# ----------------------------------------------------------------------------- range checks for validate()
# Each takes the section and a field name, so a check is one line next to the fields it guards;
# build() puts the section in front of the key. None (an optional key left unset) always passes.


def check(ok: bool, key: str, allowed: str, value) -> None:
    if not ok:
        raise ConfigError(f"{key}: {allowed}, got {value!r}")


def at_least(section, name: str, minimum: float) -> None:
    value = getattr(section, name)
    check(value is None or value >= minimum, name, f"must be >= {minimum}", value)


def within(section, name: str, low: float, high: float, closed: str = "[]") -> None:
    """`closed` says which ends are included: "[]", "[)", "(]" or "()"."""
    value = getattr(section, name)
    ok = value is None or ((low <= value) if closed[0] == "[" else (low < value)) and (
        (value <= high) if closed[1] == "]" else (value < high))
    check(ok, name, f"must be in {closed[0]}{low}, {high}{closed[1]}", value)


def betas(section, name: str = "betas") -> None:
    value = getattr(section, name)
    check(all(0 <= beta < 1 for beta in value), name, "each must be in [0, 1)", list(value))


DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def device(section, name: str = "device") -> None:
    check(bool(DEVICE.fullmatch(getattr(section, name))), name, "must be auto, cpu, cuda, cuda:N or mps",
          getattr(section, name))


def check_device_usable(name: str) -> None:
    """A GPU asked for by name (device: cuda, cuda:N, mps) must be usable: checked once a config is read, before
    anything is downloaded or loaded. It loads torch, which only such a request pays for before its run."""
    if name not in ("auto", "cpu"):
        import runtime

        runtime.resolve_device(name)


def plain_name(section, name: str) -> None:
    """A name that becomes one directory level (run_name): no separators, no '..', not empty."""
    value = getattr(section, name)
    check(value is None or (value.strip() and value not in (".", "..") and not re.search(r"[/\\]|\.\.", value)),
          name, "must be a plain name (no '/', '\\' or '..'; it names one directory)", value)


def expand_path(path) -> str:
    return os.path.expandvars(os.path.expanduser(str(path)))


def paths(section, *names: str) -> None:
    """Expand `~` and $VARIABLES in path keys (in place); an empty path is an error."""
    for name in names:
        value = getattr(section, name)
        if value is not None:
            check(bool(value.strip()), name, "must be a non-empty path", value)
            setattr(section, name, expand_path(value))


# numpy's global generator takes seeds in [0, 2**32); torch's and Python's take more.
MAX_SEED = 2**32 - 1
# torch.set_num_threads(100000) tries to start that many threads; no machine has more than ~1000 cores.
MAX_CPU_THREADS = 1024


def process_keys(section) -> None:
    """The keys of every entry point's top level: how its process is set up."""
    within(section, "seed", 0, MAX_SEED)
    device(section)
    within(section, "cpu_threads", 1, MAX_CPU_THREADS)


def common_run_keys(section) -> None:
    """The keys the training entry points' top level shares."""
    plain_name(section, "run_name")
    process_keys(section)


def check_fsdp_master_weights(config) -> None:
    """FSDP shards the weights it is given: float32 master copies of bf16 weights are not built under it."""
    if config.distributed.fsdp and config.optim.master_weights and config.model.dtype != "float32" and (
            config.model.lora.rank is None):
        raise ConfigError(f"optim.master_weights: float32 master weights of {config.model.dtype} weights are not "
                          "supported with distributed.fsdp yet; set model.dtype: float32 (FSDP then shards float32 "
                          "weights), or optim.master_weights: null")


def world_size() -> int:
    """The number of ranks torchrun started (its WORLD_SIZE variable; 1 in a plain run): what
    distributed.world_size() reports once the process group is up, readable here before torch loads."""
    return int(os.environ.get("WORLD_SIZE", 1))


# ----------------------------------------------------------------------------- the sections
# Every key a config file can set, with its default, why it exists and its allowed range (validate()).
# TrainConfig is train.py's whole config, SFTConfig train_sft.py's and EvaluateConfig evaluate.py's;
# ablate.py runs TrainConfigs. The code that reads a section imports it from here.


# The linear layers of a block that LoRA can adapt (qwen2_model.ADAPTER_LAYERS; torch is not loaded here).
LORA_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRAConfig:
    # LoRA: train a rank-`rank` adapter beside each `layers` weight of every block and freeze the model (embeddings
    # and output head included). null: full fine-tuning. LoRA Without Regret (Schulman et al. 2025): in RL rank 1
    # matches full fine-tuning when every layer is adapted, at ~10x its learning rate (docs/lora.md)
    rank: int | None = None
    alpha: float = 32.0  # the adapter's output is scaled by alpha / rank: the best learning rate hardly moves with rank
    layers: list[str] = field(default_factory=lambda: list(LORA_LAYERS))

    def validate(self) -> None:
        at_least(self, "rank", 1)
        within(self, "alpha", 0, 1e6, "(]")
        check(bool(self.layers) and set(self.layers) <= set(LORA_LAYERS) and len(set(self.layers)) == len(self.layers),
              "layers", f"must be distinct names among {', '.join(LORA_LAYERS)}", self.layers)

    def check_width(self, hf_config: dict) -> None:
        """A rank above a layer's smaller side adds nothing a full update would not: refused with the model's
        widths, read from its config.json before any weight loads."""
        if self.rank is None:
            return
        hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
        head_dim = hf_config.get("head_dim") or hidden // heads
        query, key_value = heads * head_dim, hf_config.get("num_key_value_heads", heads) * head_dim
        sides = {"q_proj": query, "k_proj": key_value, "v_proj": key_value, "o_proj": query,
                 "gate_proj": hf_config["intermediate_size"], "up_proj": hf_config["intermediate_size"],
                 "down_proj": hf_config["intermediate_size"]}
        narrowest = min(self.layers, key=lambda layer: min(hidden, sides[layer]))
        width = min(hidden, sides[narrowest])
        check(self.rank <= width, "model.lora.rank", f"must be <= {width}, the width of this model's "
              f"{narrowest} (a rank that large already changes the whole weight)", self.rank)

    @property
    def enabled(self) -> bool:
        return self.rank is not None


@dataclass
class ModelSetup:
    dir: str = "Qwen/Qwen2.5-3B-Instruct"  # a Hugging Face model directory or Hub id (hub.py)
    # auto: bfloat16 on a GPU and on a CPU with bf16 matrix instructions (avx512_bf16, AMX), float32 elsewhere
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = "bfloat16"
    gradient_checkpointing: bool = True
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def validate(self) -> None:
        paths(self, "dir")


@dataclass
class TaskConfig:
    # countdown, gsm8k, or the import path of a task module of your own (tasks.py: the interface; an example:
    # examples/sum_task.py, task.name=examples.sum_task), importable from the repository root or PYTHONPATH
    name: str = "countdown"
    data_dir: str = "Jiayi-Pan/Countdown-Tasks-3to4"  # a data directory or Hub id (hub.py)
    test_size: int = 128  # countdown: the last rows held out for evaluation
    prompt_template: str = "reasoning"  # gsm8k: configs/prompts/<name>.txt or a file path
    # countdown: the question after GRPO:Zero's instructions (same words), so every prompt starts with the same
    # ~110 tokens, which generation and the update run once per batch
    question_last: bool = False

    def validate(self) -> None:
        paths(self, "data_dir", "prompt_template")
        at_least(self, "test_size", 1)  # an empty test split would make every evaluation 0/0
        check(self.is_builtin or MODULE_PATH.fullmatch(self.name), "name", f"must be {' or '.join(BUILTIN_TASKS)}, or the "
              "import path of a task module (e.g. my_tasks.sudoku)", self.name)
        check(self.is_builtin or module_exists(self.name), "name", "no such module: put your task module where "
              "Python finds it (the repository root, or a directory on PYTHONPATH) and name it by its import path",
              self.name)
        if not self.is_builtin:
            check_task_module(self.name)

    @property
    def is_builtin(self) -> bool:
        """CountDown or GSM8K, whose data files the entry points check before torch loads (a module of your own
        checks its own, as it loads them)."""
        return self.name in BUILTIN_TASKS


BUILTIN_TASKS = ("countdown", "gsm8k")
FORM_NUMBER_COUNTS = (2, 3, 4)  # the counts countdown_forms.py scores (MAX_FORM_NUMBERS)
MODULE_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


TASK_FUNCTIONS = ("load_dataset", "reward")  # what every task module defines (tasks.py: the interface)


def check_task_module(name: str) -> None:
    """Import a task module of yours (it may load torch) and check that it defines TASK_FUNCTIONS: found now,
    not after a warm-up or a model load."""
    try:
        module = importlib.import_module(name)
    except Exception as error:  # the module's own code failed: say where, as one line
        raise ConfigError(f"task.name: importing {name} failed: {type(error).__name__}: {error}") from None
    missing = [function for function in TASK_FUNCTIONS if not callable(getattr(module, function, None))]
    if missing:
        raise ConfigError(f"task.name: the module {name} ({module.__file__}) has no {' and no '.join(missing)}: a "
                          "task module defines the functions tasks.py lists")


def has_sft_response(name: str) -> bool:
    return callable(getattr(importlib.import_module(name), "sft_response", None))


def module_exists(name: str) -> bool:
    """Whether `name` can be imported, found without running the module (it may import torch)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that is missing
        return False


# Above this, sampling is all but uniform over the vocabulary: noise, not a policy.
MAX_TEMPERATURE = 10


@dataclass
class RolloutConfig:
    episodes_per_step: int = 256  # questions per step = episodes_per_step / num_answers_per_question
    num_answers_per_question: int = 8
    max_prompt_len: int = 256  # longer prompts are left out of the training set
    max_gen_len: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    compile_decode: bool = False  # CUDA only: capture the decode step with torch.compile
    dynamic_sampling: bool = False  # DAPO: replace groups whose rewards are all equal with new questions
    dynamic_sampling_max_rounds: int = 3  # rollout rounds per step at most; then train on the groups found
    # Questions asked in each round (null: a step's, episodes_per_step / num_answers_per_question). A round
    # has a fixed cost (its longest answer's decode steps), so a few larger rounds cost less than many.
    dynamic_sampling_questions_per_round: int | None = None
    # Answers decoded at once at most (whole groups), each batch with a KV cache of its own size: the cache's
    # memory bound (bench/memory_plan.py). null: all of a round's at once. Same answers for a seed either way.
    max_decode_rows: int | None = None
    # CPU: give the system back, before each rollout, the heap pages glibc keeps for what the last update freed.
    # Lowers the peak where the rollout's KV cache would be mapped on top of them (SmolLM2 LoRA: 2.7 -> 2.4 GiB);
    # each step then maps those pages anew, ~0.5 s per 600 MiB (the demo: 12% slower, same peak).
    release_cpu_memory: bool = False
    # countdown: each training question of these number counts that none of the 10 best fixed answer forms solves
    # (countdown_forms.py, forms chosen on the training rows) is drawn this many times per pass over the data.
    # GRPO otherwise spends most groups on questions a template answers and unlearns the * and / the rest need
    # (docs/cpu_demo.md). 1: every question once. The warm-up and the held-out questions are not affected.
    outside_forms_repeat: int = 1
    outside_forms_numbers: list[int] = field(default_factory=lambda: [3])
    outside_forms_repeat_after: int = 0  # steps 1..N draw every question once; the repeat starts at step N+1
    # countdown: GRPO asks only the training questions with these many numbers (null: all); the held-out questions
    # and the shortcut baseline's forms are not affected. On the demo, [3, 4] left 3-number success within noise
    # and the untrained 2-number questions fell 2-6 points (docs/cpu_demo.md), so the demo asks every count.
    train_number_counts: list[int] | None = None

    def validate(self) -> None:
        for name in ("episodes_per_step", "num_answers_per_question", "max_prompt_len", "max_gen_len",
                     "dynamic_sampling_max_rounds", "dynamic_sampling_questions_per_round"):
            at_least(self, name, 1)
        within(self, "outside_forms_repeat", 1, 100)
        at_least(self, "outside_forms_repeat_after", 0)
        check(bool(self.outside_forms_numbers) and set(self.outside_forms_numbers) <= set(FORM_NUMBER_COUNTS),
              "outside_forms_numbers", f"must be number counts among {list(FORM_NUMBER_COUNTS)}",
              self.outside_forms_numbers)
        counts = self.train_number_counts
        check(counts is None or (bool(counts) and min(counts) >= 1), "train_number_counts",
              "must be null (every question) or a non-empty list of number counts >= 1", counts)
        check(self.max_decode_rows is None or self.max_decode_rows >= self.num_answers_per_question,
              "max_decode_rows", f"must be >= num_answers_per_question ({self.num_answers_per_question}): a "
              "question's answers decode together, on its prompt's cache", self.max_decode_rows)
        within(self, "temperature", 0, MAX_TEMPERATURE, "(]")  # 0 would make every group's answers equal: no signal
        within(self, "top_p", 0, 1, "(]")

    @property
    def questions_per_step(self) -> int:
        return self.episodes_per_step // self.num_answers_per_question

    @property
    def questions_per_round(self) -> int:
        """Questions each rollout round asks: a step's, or with dynamic sampling as configured."""
        if self.dynamic_sampling and self.dynamic_sampling_questions_per_round:
            return self.dynamic_sampling_questions_per_round
        return self.questions_per_step


@dataclass
class AdamWConfig:
    """The optim keys train.py and train_sft.py share: steps, AdamW, clipping and micro-batch shape."""

    num_steps: int = 1000
    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    micro_batch_size: int = 2
    max_grad_norm: float = 1.0
    memory_efficient_adamw: bool = False  # keep AdamW's moments (and master weights) in CPU memory
    logprob_chunk_size: int = 256  # sequence positions per lm_head chunk in the update
    # float32: weights below float32 (bf16) train through float32 master copies, their gradients summed in float32
    # (small updates do not round away: optimizer.py); null: AdamW updates the weights in their own dtype
    master_weights: Literal["float32"] | None = "float32"

    def validate(self) -> None:
        for name in ("num_steps", "micro_batch_size", "logprob_chunk_size"):
            at_least(self, name, 1)
        within(self, "learning_rate", 0, 1, "(]")
        within(self, "weight_decay", 0, 1)  # AdamW shrinks weights by learning_rate x weight_decay per step
        betas(self)
        within(self, "eps", 0, 1, "()")
        # < 0 reverses the update, 0 zeroes it; a gradient norm above 1e4 has diverged, so larger never clips
        within(self, "max_grad_norm", 0, 10_000, "(]")


@dataclass
class OptimConfig(AdamWConfig):
    skip_unfinished_episodes: bool = False  # leave out of the loss episodes that hit max_gen_len
    warn_after_zero_reward_steps: int = 5  # consecutive steps without any reward before a warning (0: never)

    def validate(self) -> None:
        super().validate()
        at_least(self, "warn_after_zero_reward_steps", 0)


@dataclass
class LossConfig:
    # group_mean: GRPO's; leave_one_out: RLOO's mean of the other G - 1 answers; none: REINFORCE on raw rewards
    baseline: Literal["group_mean", "leave_one_out", "none"] = "group_mean"
    std_normalization: bool = True  # divide by the group's reward std
    std_estimator: Literal["population", "sample"] = "population"  # divide by G (GRPO:Zero) or G - 1 (torch.std)
    advantage_eps: float = 1e-4  # added to the std so all-equal groups give 0, never NaN
    aggregation: Literal["token", "sequence", "constant"] = "token"
    aggregation_constant: int | None = None  # tokens per sequence for "constant"; null = max_gen_len
    epochs_per_rollout: int = 1  # K optimizer steps on each rollout batch
    # How the importance ratio is bounded: none; ppo (PPO's clipped objective); cispo (MiniMax-M1: the detached
    # weight min(ratio, 1 + clip_range_high) times log p, no token loses its gradient); sapo (a sigmoid gate)
    clip: Literal["none", "ppo", "cispo", "sapo"] = "none"
    clip_range: float = 0.2  # ppo: the ratio is clipped to [1 - clip_range, 1 + clip_range_high]
    # The variants that followed DeepSeek-R1 (docs/variants.md); each default leaves the loss as above.
    clip_range_high: float | None = None  # DAPO's clip-higher: a wider upper range; null = clip_range
    importance_sampling: Literal["token", "sequence"] = "token"  # sequence: GSPO's per-sequence ratio
    std_scope: Literal["group", "batch"] = "group"  # whose reward std divides the advantages
    overlong_buffer_fraction: float = 0.0  # DAPO's soft overlong penalty ramps over this last part of max_gen_len
    overlong_penalty_factor: float = 1.0  # the reward taken off an answer of max_gen_len tokens
    # The share of the task's format reward the update sees (the logged rewards stay the task's). 0 once an SFT
    # warm-up has taught the format: a group whose answers differ only in format then teaches nothing, where
    # AdamW would otherwise take a full-sized step towards formatted guesses
    format_reward_weight: float = 1.0
    # countdown: the weight of the share of the think's tries that are exact computations over every number
    # (countdown_task.try_reward), added to the rewards the update sees: made-up arithmetic then costs reward
    try_reward_weight: float = 0.0
    try_reward_distinct: bool = False  # a try written twice counts as not exact the second time: it searches nothing
    kl_beta: float = 0.0  # weight of the k3 KL to the frozen initial policy; 0: no reference model
    sapo_tau_positive: float = 1.0  # SAPO's gate temperature for answers with advantage > 0 (larger: a narrower gate)
    sapo_tau_negative: float = 1.05  # and for the others
    whiten_advantages: bool = False  # REINFORCE++: shift and scale the advantages to mean 0, std 1 over the batch
    top_entropy_fraction: float | None = None  # train only on this fraction of the batch's highest-entropy tokens
    sampler_is_cap: float | None = None  # C: weight token losses by min(p_train / p_sampler, C); null: off

    def validate(self) -> None:
        within(self, "advantage_eps", 0, 1, "(]")  # < 0 can flip advantage signs; 0 gives 0/0 in equal groups
        at_least(self, "aggregation_constant", 1)
        at_least(self, "epochs_per_rollout", 1)
        within(self, "clip_range", 0, 1, "()")
        within(self, "clip_range_high", 0, 10, "()")
        check(self.clip_range_high is None or self.clip in ("ppo", "cispo"), "clip_range_high",
              "needs loss.clip: ppo or cispo (elsewhere it does nothing)", self.clip_range_high)
        within(self, "overlong_buffer_fraction", 0, 1, "[)")
        within(self, "overlong_penalty_factor", 0, 10, "(]")  # rewards are at most ~1: 10 x that is already absurd
        within(self, "format_reward_weight", 0, 1)  # above 1 the format would outweigh what it is for
        within(self, "try_reward_weight", 0, 1)  # above 1 exact tries would outweigh a right answer
        check(not self.try_reward_distinct or self.try_reward_weight > 0, "try_reward_distinct",
              "needs loss.try_reward_weight > 0 (without the try reward it does nothing)", self.try_reward_distinct)
        within(self, "kl_beta", 0, 10)  # 0: no KL term, no reference model; 10 already pins the policy
        within(self, "sapo_tau_positive", 0, 100, "(]")
        within(self, "sapo_tau_negative", 0, 100, "(]")
        within(self, "top_entropy_fraction", 0, 1, "(]")
        # < 1 would down-weight even tokens both engines agree on; a ratio above 100 (log-probs 4.6 apart) means
        # the engines disagree outright, so a larger cap truncates nothing
        within(self, "sampler_is_cap", 1, 100)


@dataclass
class EvalConfig:
    interval: int = 10  # training steps between evaluations (0: never)
    max_questions: int | None = None  # null: the whole held-out split
    batch_size: int = 64  # questions generated at once
    num_samples: int = 1  # answers per question; pass@k is reported when > 1
    temperature: float = 0.0  # 0 is greedy decoding
    top_p: float = 1.0
    max_gen_len: int | None = None  # null: rollout.max_gen_len

    def validate(self) -> None:
        at_least(self, "interval", 0)
        at_least(self, "max_questions", 0)  # 0: train_sft.py scores only the held-out loss
        for name in ("batch_size", "num_samples", "max_gen_len"):
            at_least(self, name, 1)
        within(self, "temperature", 0, MAX_TEMPERATURE)
        within(self, "top_p", 0, 1, "(]")


@dataclass
class LoggingConfig:
    log_dir: str = "logs"  # TensorBoard events go to <log_dir>/<run_name>
    sample_interval: int = 10  # steps between sample episodes written as text
    num_samples: int = 4
    wandb: bool = False  # also log to Weights & Biases (uv sync --extra wandb)
    wandb_project: str = "grpo-zero"

    def validate(self) -> None:
        paths(self, "log_dir")
        at_least(self, "sample_interval", 0)
        at_least(self, "num_samples", 0)


@dataclass
class CheckpointConfig:
    dir: str = "checkpoints"  # checkpoints go to <dir>/<run_name>/step_NNNNNN
    interval: int = 100  # steps between checkpoints (0: only at the end)
    keep_last: int | None = 3  # keep the newest K checkpoints of the run (and the newest resumable one); null: all
    optimizer_state: bool = True  # false: steps before the last save weights only (~1/3 the disk), not resumable

    def validate(self) -> None:
        paths(self, "dir")
        at_least(self, "interval", 0)
        at_least(self, "keep_last", 1)


@dataclass
class BootstrapConfig:
    """The CPU demo's missing inputs and the commands that make them (see bootstrap.py)."""

    data_dir: str | None = None  # the one task.data_dir this bootstrap may create (CountDown only)
    model_dir: str | None = None  # the one model.dir this bootstrap may create (by SFT)
    dataset_args: str | None = None  # `countdown_task.py generate` arguments for a missing data_dir
    base_model_args: str | None = None  # `tiny_model.py` arguments for a missing SFT base model
    sft_config: str | None = None  # train_sft.py config that produces a missing model_dir
    sft_overrides: list[str] = field(default_factory=list)  # `section.key=value` changes to sft_config

    def validate(self) -> None:
        paths(self, "data_dir", "model_dir", "sft_config")
        check(not self.dataset_args or self.data_dir, "data_dir", "must name the directory that "
              "dataset_args generates", self.data_dir)
        check(not self.sft_config or self.model_dir, "model_dir", "must name the directory that "
              "sft_config trains", self.model_dir)

    def builds_data(self, task: "TaskConfig") -> bool:
        """Whether this bootstrap generates task.data_dir when it is missing (CountDown only)."""
        return bool(self.dataset_args) and task.name == "countdown" and _same_path(self.data_dir, task.data_dir)

    def builds_model(self, model_dir: str) -> bool:
        """Whether this bootstrap trains `model_dir` by SFT when it is missing."""
        return bool(self.sft_config) and _same_path(self.model_dir, model_dir)


def _same_path(path: str | None, other: str) -> bool:
    return path is not None and Path(path).resolve() == Path(other).resolve()


@dataclass
class DistributedConfig:
    # Under torchrun: shard parameters, gradients and optimizer state over the ranks (FSDP2) for models
    # whose training state does not fit one device. Ignored in a single-process run.
    fsdp: bool = False


@dataclass
class TrainConfig:
    run_name: str | None = None  # null: a timestamp
    seed: int = 1337
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    cpu_threads: int | None = None  # torch CPU threads; null: torch's default (all cores)
    progress: bool = True  # long stages: bars on a terminal, else a log line every 30 s (run_logging.progress_bar)
    model: ModelSetup = field(default_factory=ModelSetup)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def validate(self) -> None:
        common_run_keys(self)
        check(self.eval.max_questions != 0, "eval.max_questions", "must be >= 1 or null (all); "
              "eval.interval: 0 turns evaluation off", self.eval.max_questions)
        rollout = self.rollout
        if rollout.episodes_per_step % rollout.num_answers_per_question:
            raise ConfigError(
                f"rollout.episodes_per_step ({rollout.episodes_per_step}) must be divisible by "
                f"rollout.num_answers_per_question ({rollout.num_answers_per_question})"
            )
        if rollout.num_answers_per_question < 2 and self.loss.baseline != "none":
            raise ConfigError(f"rollout.num_answers_per_question must be >= 2 for the {self.loss.baseline} baseline")
        if rollout.questions_per_step % world_size():
            raise ConfigError(f"the {rollout.questions_per_step} questions per step must split evenly over "
                              f"{world_size()} ranks")
        if rollout.questions_per_round % world_size():
            raise ConfigError(f"rollout.dynamic_sampling_questions_per_round ({rollout.questions_per_round}) must "
                              f"split evenly over {world_size()} ranks")
        task = self.task.name
        for key, value, unset, why in (  # CountDown's own keys: another task must leave them unset
                ("rollout.outside_forms_repeat", rollout.outside_forms_repeat, 1,
                 f"only countdown has answer forms, not {task}"),
                ("rollout.train_number_counts", rollout.train_number_counts, None,
                 f"only countdown's questions have a number count, not {task}'s"),
                ("loss.try_reward_weight", self.loss.try_reward_weight, 0,
                 f"only countdown's reward checks written tries, not {task}'s")):
            check(value == unset or task == "countdown", key, f"{why}; set it to {'null' if unset is None else unset}",
                  value)
        if self.distributed.fsdp and self.optim.memory_efficient_adamw:
            raise ConfigError("distributed.fsdp already shards AdamW's state over the GPUs; "
                              "set optim.memory_efficient_adamw: false")
        check_fsdp_master_weights(self)
        if self.distributed.fsdp and self.optim.skip_unfinished_episodes:
            # FSDP gathers parameters in every forward and backward, a collective all ranks must join,
            # but filtering leaves ranks with different numbers of micro-batches.
            raise ConfigError("distributed.fsdp needs the same number of episodes on every rank; "
                              "set optim.skip_unfinished_episodes: false")
        if self.distributed.fsdp and rollout.dynamic_sampling:  # rounds and kept groups differ between ranks
            raise ConfigError("distributed.fsdp needs the same rollouts on every rank; "
                              "set rollout.dynamic_sampling: false")
        if self.distributed.fsdp and self.loss.kl_beta:
            raise ConfigError("loss.kl_beta > 0 (a reference model) is not supported with distributed.fsdp "
                              "yet; set loss.kl_beta: 0")

    def validate_for_model(self, max_position_embeddings: int) -> None:
        """What only the loaded model can tell: prompt plus answer must fit its positions."""
        for key, gen_len in (("rollout.max_gen_len", self.rollout.max_gen_len), ("eval.max_gen_len", self.eval.max_gen_len)):
            total = self.rollout.max_prompt_len + (gen_len or 0)  # eval.max_gen_len null: the rollout's, checked
            check(total <= max_position_embeddings, f"rollout.max_prompt_len + {key}",
                  f"must be <= the model's max_position_embeddings ({max_position_embeddings})", total)


@dataclass
class SFTDataConfig:
    train_jsonl: str | None = None  # {"prompt", "response"} lines; null: the task's training split
    eval_jsonl: str | None = None  # held-out pairs for the loss; null: the last eval_size training pairs
    eval_size: int = 200
    max_seq_len: int = 1024  # longer pairs are left out
    # The task's reference responses: "solution" (its steps, then the answer); CountDown also "search" (a
    # search's first failed tries, then the solution it finds: countdown_task.sft_search_response) and
    # "full_search" (every try in the search's order; questions it needs more than search_max_tries for are
    # left out of training: countdown_task.sft_full_search_response).
    response: Literal["solution", "search", "full_search"] = "solution"
    search_max_tries: int = 6  # full_search: 3-number questions take ~2 tries on average, 4-number ones ~20
    # search: as many failed tries as fit in this many response tokens (the end token included, as
    # max_gen_len counts), in the search's order; null: the first two (countdown_task.SEARCH_DEAD_ENDS)
    search_max_tokens: int | None = None

    def validate(self) -> None:
        paths(self, "train_jsonl", "eval_jsonl")
        at_least(self, "eval_size", 1)
        at_least(self, "max_seq_len", 2)
        within(self, "search_max_tries", 1, 1000)
        check(self.search_max_tokens is None or self.response == "search", "search_max_tokens",
              "is read by data.response: search only; remove it or set that", self.search_max_tokens)
        within(self, "search_max_tokens", 1, self.max_seq_len)


@dataclass
class SFTOptimConfig(AdamWConfig):
    batch_size: int = 32  # pairs per optimizer step
    micro_batch_size: int = 8
    min_learning_rate_ratio: float = 0.1  # cosine decay to learning_rate x this
    warmup_steps: int = 0
    betas: tuple[float, float] = (0.9, 0.95)
    # End before num_steps at the first evaluation whose success rate (on held-out training questions, not
    # the test split) reaches this; null: always run num_steps. GRPO then starts every seed equally able.
    stop_at_success: float | None = None

    def validate(self) -> None:
        super().validate()
        at_least(self, "batch_size", 1)
        within(self, "min_learning_rate_ratio", 0, 1)
        at_least(self, "warmup_steps", 0)
        within(self, "stop_at_success", 0, 1, "(]")


@dataclass
class SFTConfig:
    output_dir: str = "sft_model"  # the fine-tuned model, in the Hugging Face layout
    run_name: str | None = None
    seed: int = 1337
    device: str = "auto"
    cpu_threads: int | None = None  # torch CPU threads; null: torch's default (all cores)
    progress: bool = True
    model: ModelSetup = field(default_factory=ModelSetup)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    optim: SFTOptimConfig = field(default_factory=SFTOptimConfig)
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(interval=100, max_questions=200, max_gen_len=256))
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # Steps to resume from (<dir>/<run_name>/step_NNNNNN) every `interval` steps (0: none) and on Ctrl-C or
    # SIGTERM; the fine-tuned model itself goes to output_dir.
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def validate(self) -> None:
        common_run_keys(self)
        paths(self, "output_dir")
        check(self.data.response == "solution" or self.task.name == "countdown", "data.response",
              f"{self.data.response!r} is a CountDown response; task.name {self.task.name!r} has 'solution' only",
              self.data.response)
        check(bool(self.data.train_jsonl) or self.task.is_builtin or has_sft_response(self.task.name), "task.name",
              "SFT learns the task's reference responses and this module has no sft_response(item): add one, or "
              "give pairs in data.train_jsonl", self.task.name)
        if self.optim.stop_at_success is not None:
            check(bool(self.eval.interval and self.eval.max_questions != 0), "optim.stop_at_success",
                  "needs evaluations: eval.interval >= 1 and eval.max_questions >= 1 or null", self.optim.stop_at_success)
            check(not (self.data.train_jsonl or self.data.eval_jsonl), "optim.stop_at_success", "needs held-out "
                  "questions from the task's training split (never the test split): set data.train_jsonl and "
                  "data.eval_jsonl to null, or optim.stop_at_success to null", self.optim.stop_at_success)
        if self.optim.batch_size % self.optim.micro_batch_size:
            raise ConfigError(
                f"optim.batch_size ({self.optim.batch_size}) must be divisible by optim.micro_batch_size "
                f"({self.optim.micro_batch_size})"
            )
        if self.optim.batch_size % world_size():
            raise ConfigError(f"optim.batch_size ({self.optim.batch_size}) must split evenly over {world_size()} ranks")
        if self.distributed.fsdp and self.optim.memory_efficient_adamw:
            raise ConfigError("distributed.fsdp already shards AdamW's state over the GPUs; "
                              "set optim.memory_efficient_adamw: false")
        check_fsdp_master_weights(self)


@dataclass
class EvaluateConfig:
    """What evaluate.py reads: a --config file may hold only these keys (anything else would be ignored).
    A training checkpoint's own config.yaml comes first (its dtype, task and answer length); a plain
    model directory gets these defaults: float32, answers of up to 1024 tokens (config.yaml's rollout)."""

    seed: int = 0
    device: str = "auto"
    cpu_threads: int | None = None  # torch CPU threads; null: torch's default (all cores)
    progress: bool = True
    model: ModelSetup = field(default_factory=lambda: ModelSetup(dtype="float32", gradient_checkpointing=False))
    task: TaskConfig = field(default_factory=TaskConfig)
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(max_gen_len=1024))

    def validate(self) -> None:
        check(self.eval.max_gen_len is not None, "eval.max_gen_len", "must be set for evaluate.py",
              self.eval.max_gen_len)
        process_keys(self)


def _describe(kind) -> str:
    if typing.get_origin(kind) is Literal:
        return "one of " + ", ".join(repr(choice) for choice in typing.get_args(kind))
    return getattr(kind, "__name__", str(kind))


def _coerce(value: Any, kind, key: str) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (arg for arg in args if arg is not type(None)):
            try:
                return _coerce(value, option, key)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} is not {kind}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not allowed; use {_describe(kind)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if origin is tuple and args[-1] is not Ellipsis:  # fixed length, e.g. betas: tuple[float, float]
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} values, got {value!r}")
            return tuple(_coerce(v, k, key) for v, k in zip(value, args))
        items = [_coerce(v, args[0], key) for v in value]
        return tuple(items) if origin is tuple else items
    if dataclasses.is_dataclass(kind):
        return build(kind, value, prefix=key)
    if kind is float and not isinstance(value, bool):
        return _finite(value, key)
    if kind is Any or (isinstance(value, kind) and not (kind is int and isinstance(value, bool))):
        return value
    raise ConfigError(f"{key}: expected {_describe(kind)}, got {value!r}")


def _finite(value: Any, key: str) -> float:
    """A float key's value: a number, or a string PyYAML did not read as one (it reads 1e-5, no dot, as a
    string). Every float key must be finite: inf or nan would train silently wrong, then crash."""
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        number = math.inf
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected float, got {value!r}") from None
    if not math.isfinite(number):
        raise ConfigError(f"{key}: must be a finite number, got {value!r}")
    return number


def build(schema: type[Config], values: dict | None, prefix: str = "") -> Config:
    """Validate a (nested) dict into the dataclass `schema`."""
    values = values or {}
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a section of keys, got {values!r}")
    hints = typing.get_type_hints(schema)
    names = [field.name for field in dataclasses.fields(schema)]
    unknown = [key for key in values if key not in names]
    if unknown:
        where = f"section '{prefix}'" if prefix else "the top level"
        raise ConfigError(f"unknown key '{_join(prefix, unknown[0])}' in {where}; valid keys: {', '.join(names)}")
    kwargs = {}
    for schema_field in dataclasses.fields(schema):
        key = _join(prefix, schema_field.name)
        if schema_field.name in values:
            value = values[schema_field.name]
            if schema_field.default_factory is not dataclasses.MISSING and isinstance(value, dict):
                # A section given in part keeps its own defaults for the rest: EvaluateConfig's float32 model,
                # SFTConfig's eval lengths (a default_factory's, not the section class's).
                value = merge(to_dict(schema_field.default_factory()), value)
            kwargs[schema_field.name] = _coerce(value, hints[schema_field.name], key)
        elif schema_field.default is dataclasses.MISSING and schema_field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required key '{key}'")
    config = schema(**kwargs)
    if hasattr(config, "validate"):
        try:
            config.validate()
        except ConfigError as error:  # a section names its own keys; the full key adds the section
            message = str(error)
            raise ConfigError(message if not prefix or message.startswith(prefix + ".") else _join(prefix, message)) from None
    return config


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def apply_override(values: dict, assignment: str) -> None:
    """Apply one `section.key=value` to a nested dict in place."""
    if "=" not in assignment:
        raise ConfigError(f"--set expects section.key=value, got {assignment!r}")
    dotted, raw = assignment.split("=", 1)
    *sections, key = dotted.strip().split(".")
    node = values
    for section in sections:
        node = node.setdefault(section, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: '{section}' is not a section")
    try:
        node[key] = yaml.safe_load(raw)
    except yaml.YAMLError as error:
        raise ConfigError(f"--set {dotted}: the value is not valid YAML ({_yaml_problem(error)})") from None


def merge(base: dict, override: dict) -> dict:
    """Recursive dict merge: sections merge, plain keys in `override` win."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else problem


def read_yaml(path) -> dict:
    path = Path(expand_path(path))
    if path.is_dir():
        raise ConfigError(f"config file '{path}' is a directory; pass a YAML file in it, e.g. '{path / 'config.yaml'}'")
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # a BOM is fine; UTF-16 or binary is not
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        column = error.start - (raw.rfind(b"\n", 0, error.start) + 1) + 1
        raise ConfigError(f"{path}: line {line}, column {column}: not UTF-8 text (save the config as UTF-8)") from None
    if "\0" in text:
        raise ConfigError(f"{path}: line {text[: text.index(chr(0))].count(chr(10)) + 1}: a NUL byte; "
                          f"this is not a YAML text file") from None
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: {_yaml_problem(error)}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return values


def load(schema: type[Config], paths=None, overrides: list[str] = (), base: dict | None = None) -> Config:
    """Read the YAML file(s) in `paths` (one path or a list; later files win, on top of `base`),
    apply --set overrides, validate into `schema`."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    values = base or {}
    for path in paths or []:
        values = merge(values, read_yaml(path))
    for assignment in overrides:
        apply_override(values, assignment)
    return build(schema, values)


def warm_up_config(bootstrap: BootstrapConfig, task: TaskConfig, model_dir: str) -> SFTConfig:
    """The SFT warm-up that trains a missing model_dir: bootstrap.sft_config and its overrides, writing
    model_dir, on the task GRPO trains on (the same data), validated with that task."""
    values = read_yaml(bootstrap.sft_config)
    for assignment in [*bootstrap.sft_overrides, f"output_dir={model_dir}"]:
        apply_override(values, assignment)
    values["task"] = to_dict(task)
    try:
        return build(SFTConfig, values)
    except ConfigError as error:
        raise ConfigError(f"bootstrap.sft_config: the warm-up {bootstrap.sft_config} on task.name {task.name!r}: "
                          f"{error}; change the warm-up with bootstrap.sft_overrides") from None


def to_dict(config) -> dict:
    return dataclasses.asdict(config)


def to_yaml(config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def dump(config, path) -> None:
    Path(path).write_text(to_yaml(config))
