"""Data-parallel and FSDP2 training on CPU with gloo, launched by the real launcher (torchrun, 2 processes).

The reference is always a plain single-process run of the same code on the same inputs. This file
is also the ranks' program; all the multi-process work happens in one launch (`ranks_output`),
because each rank takes tens of seconds just to import torch on a small CI machine.
"""

import copy
import itertools
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import config as config_lib  # noqa: E402
import countdown_task  # noqa: E402
import distributed  # noqa: E402
import train  # noqa: E402
import train_sft  # noqa: E402
from data_types import Episode  # noqa: E402
from grpo import LossConfig, compute_advantages, update_policy  # noqa: E402
from qwen2_model import Transformer  # noqa: E402

NUM_RANKS = 2
LEARNING_RATE = 0.1
# Clipping would hide a gradient off by a constant factor, so one case runs unclipped; in the other
# the limit is below the tiny model's gradient norm, so the global norm and the clipping are exercised.
MAX_GRAD_NORM = {"token": 1e9, "sequence": 0.05}


# ----------------------------------------------------------------------------- shared by both sides


def group_episodes() -> list[list[Episode]]:
    """Four groups of three answers with different prompt and answer lengths."""
    generator = torch.Generator().manual_seed(0)
    groups = []
    for question in range(4):
        group = []
        for _ in range(3):
            prompt_length, answer_length = torch.randint(2, 12, (2,), generator=generator).tolist()
            tokens = torch.randint(1, 400, (prompt_length + answer_length,), generator=generator).tolist()
            reward = torch.rand((), generator=generator).item()
            group.append(Episode(question, "", tokens[:prompt_length], tokens[prompt_length:], "", True, reward,
                                 {"format_reward": 0.0, "answer_reward": 0.0}))
        groups.append(group)
    return groups


def sgd_update(model, episodes: list[Episode], aggregation: str, fsdp: bool = False) -> dict[str, float]:
    """One update as train.py runs it: DDP (or FSDP) under torchrun, the plain model otherwise."""
    policy = distributed.training_model(model, torch.device("cpu"), fsdp)
    optimizer = torch.optim.SGD([param for param in model.parameters() if param.requires_grad], lr=LEARNING_RATE)
    loss_config = LossConfig(aggregation=aggregation)
    advantages = compute_advantages(episodes, loss_config)
    return update_policy(policy, distributed.OptimizerStep(policy, optimizer, MAX_GRAD_NORM[aggregation]), episodes,
                         advantages, config=loss_config, optim=config_lib.OptimConfig(micro_batch_size=2, logprob_chunk_size=4),
                         max_gen_len=16, pad_token_id=0)


def shared_prompt_groups() -> list[list[Episode]]:
    """Four groups of three answers to one prompt each (as GRPO's), the prompts of different lengths: one group per
    micro-batch of three, the same micro-batches on a rank as in one process."""
    generator = torch.Generator().manual_seed(2)
    groups = []
    for question, prompt_length in enumerate((4, 6, 9, 11)):
        prompt = torch.randint(1, 400, (prompt_length,), generator=generator).tolist()
        groups.append([Episode(question, "", prompt, torch.randint(1, 400, (int(length),), generator=generator).tolist(),
                               "", True, torch.rand((), generator=generator).item(),
                               {"format_reward": 0.0, "answer_reward": 0.0})
                       for length in torch.randint(2, 12, (3,), generator=generator)])
    return groups


def master_weights_update(model, episodes: list[Episode]) -> dict:
    """One AdamW step of a bf16 model through float32 master weights (optim.master_weights): its masters."""
    from optimizer import MemoryEfficientAdamW

    policy = distributed.training_model(model, torch.device("cpu"), fsdp=False)
    optimizer = MemoryEfficientAdamW(model.parameters(), lr=1e-3, enabled=False, master_weights=True)
    loss_config = LossConfig()
    update_policy(policy, distributed.OptimizerStep(policy, optimizer, 0.05), episodes,
                  compute_advantages(episodes, loss_config), config=loss_config,
                  optim=config_lib.OptimConfig(micro_batch_size=3, logprob_chunk_size=4), max_gen_len=16, pad_token_id=0)
    return {name: optimizer.state[param]["master"].clone() for name, param in model.named_parameters()}


def digit_reward(response, item, end_token):
    """A random tiny model never solves CountDown (no reward, no gradient), so reward digits instead."""
    digits = sum(character.isdigit() for character in response) / max(len(response), 1)
    return {"reward": digits, "reward_info": {"format_reward": 0.0, "answer_reward": float(digits > 0.3)}}


# ----------------------------------------------------------------------------- what each rank runs


def with_adapters(model: Transformer) -> Transformer:
    """LoRA adapters on every layer, B moved off zero (as after some training) so that A has a gradient too."""
    model.add_adapters(2, 4.0, seed=5)
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for layer in model.adapted_layers().values():
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=generator) * 0.1)
    return model


def rank_updates(model_dir: str, out_file: str) -> None:
    """One update of each kind from this rank's groups; rank 0 saves the gathered parameters and metrics."""
    groups = group_episodes()
    # Data parallel gets uneven shares (3 groups and 1; 4 and none, as when filtering leaves a rank
    # nothing): the global normalisation must still make it exact. FSDP runs its collectives in every
    # forward, so every rank needs as many micro-batches: 2 groups and 2. The _lora modes train adapters only.
    shares = {"data_parallel": [groups[:3], groups[3:]], "data_parallel_empty_rank": [groups, []],
              "fsdp": [groups[:2], groups[2:]]}
    shares |= {"data_parallel_lora": shares["data_parallel"], "fsdp_lora": shares["fsdp"]}
    results = {}
    for mode, rank_groups in shares.items():
        for aggregation in MAX_GRAD_NORM:
            model = Transformer.from_pretrained(model_dir, dtype=torch.float32)
            if mode.endswith("_lora"):
                with_adapters(model)
            episodes = [episode for group in rank_groups[distributed.rank()] for episode in group]
            metrics = sgd_update(model, episodes, aggregation, fsdp=mode.startswith("fsdp"))
            savable = distributed.savable_model(model)
            if distributed.is_main_process():
                results[mode, aggregation] = ({name: p.detach().clone() for name, p in savable.named_parameters()},
                                              metrics)
    # bf16 weights through float32 masters: each rank sums its micro-batches in float32, the ranks sum those.
    bf16 = Transformer.from_pretrained(model_dir, dtype=torch.bfloat16)
    shared = shared_prompt_groups()
    masters = master_weights_update(bf16, [e for group in (shared[:3], shared[3:])[distributed.rank()] for e in group])
    if distributed.is_main_process():
        results["master_weights"] = masters
        torch.save(results, out_file)


def rank_main(model_dir: str, out_dir: str) -> None:
    """The updates, then each command line of <out_dir>/runs.txt ("train ..." or "sft ...") in turn."""
    rank_updates(model_dir, str(Path(out_dir) / "updates.pt"))
    countdown_task.reward = digit_reward
    for line in (Path(out_dir) / "runs.txt").read_text().splitlines():
        program, *argv = shlex.split(line)
        {"train": train.main, "sft": train_sft.main}[program](argv)


if __name__ == "__main__":
    torch.set_num_threads(1)
    distributed.init_from_env()
    try:
        rank_main(*sys.argv[1:])
    finally:
        distributed.shutdown()


# ----------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def countdown_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("countdown")
    countdown_task.main(["generate", "--out", str(out), "--size", "80", "--seed", "0", "--max-number", "20",
                         "--with-solutions"])
    return out


def grpo_config(out_dir: Path, name: str, model_dir, data_dir, fsdp: bool) -> Path:
    path = out_dir / f"{name}.yaml"
    path.write_text(f"""
run_name: tiny
device: cpu
progress: false
model: {{dir: {model_dir}, dtype: float32, gradient_checkpointing: false}}
task: {{data_dir: {data_dir}, test_size: 5}}
rollout: {{episodes_per_step: 12, num_answers_per_question: 3, max_gen_len: 10}}
optim: {{num_steps: 2, learning_rate: 1.0e-3, micro_batch_size: 3}}
eval: {{interval: 2, max_questions: 5, max_gen_len: 6}}
logging: {{log_dir: {out_dir / name / 'logs'}, sample_interval: 1, num_samples: 2}}
checkpoint: {{dir: {out_dir / name / 'checkpoints'}, interval: 0}}
distributed: {{fsdp: {str(fsdp).lower()}}}
""")
    return path


def sft_config(out_dir: Path, model_dir, data_dir) -> Path:
    path = out_dir / "sft.yaml"
    path.write_text(f"""
output_dir: {out_dir / 'sft' / 'model'}
run_name: sft
device: cpu
progress: false
model: {{dir: {model_dir}, dtype: float32, gradient_checkpointing: false}}
task: {{data_dir: {data_dir}, test_size: 8}}
data: {{eval_size: 15}}
optim: {{num_steps: 2, batch_size: 8, micro_batch_size: 2, learning_rate: 1.0e-3}}
eval: {{interval: 2, max_questions: 3, max_gen_len: 6}}
logging: {{log_dir: {out_dir / 'sft' / 'logs'}}}
checkpoint: {{dir: {out_dir / 'sft' / 'checkpoints'}}}
""")
    return path


@pytest.fixture(scope="module")
def ranks_output(tmp_path_factory, tiny_model_dir, countdown_dir) -> Path:
    """One two-process launch: the updates, GRPO runs with and without FSDP, an FSDP run cut after
    one step and resumed, and an SFT run."""
    out = tmp_path_factory.mktemp("ranks")
    for name, fsdp in (("data_parallel", False), ("fsdp", True), ("fsdp_resumed", True), ("fsdp_lora", True)):
        grpo_config(out, name, tiny_model_dir, countdown_dir, fsdp)
    runs = [
        f"train --config {out / 'data_parallel.yaml'}",
        f"train --config {out / 'fsdp.yaml'}",
        f"train --config {out / 'fsdp_lora.yaml'} --set model.lora.rank=2 --set optim.learning_rate=0.05",
        f"train --config {out / 'fsdp_resumed.yaml'} --set optim.num_steps=1",
        f"train --config {out / 'fsdp_resumed.yaml'} --resume {out / 'fsdp_resumed' / 'checkpoints' / 'tiny'}",
        f"sft --config {sft_config(out, tiny_model_dir, countdown_dir)}",
    ]
    (out / "runs.txt").write_text("\n".join(runs) + "\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NUM_RANKS}",
               str(Path(__file__)), str(tiny_model_dir), str(out)]
    result = subprocess.run(command, cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return out


@pytest.mark.slow
def test_two_rank_update_equals_single_process(ranks_output, tiny_model_dir):
    """Data parallel (DDP, summing gradients) and FSDP2 (fully_shard per block) both run on CPU with gloo."""
    results = torch.load(ranks_output / "updates.pt")
    initial = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32)
    all_episodes = [episode for group in group_episodes() for episode in group]
    for aggregation, lora in itertools.product(MAX_GRAD_NORM, (False, True)):
        expected = with_adapters(copy.deepcopy(initial)) if lora else copy.deepcopy(initial)
        expected_metrics = sgd_update(expected, all_episodes, aggregation)
        assert expected_metrics["grad_norm"] > MAX_GRAD_NORM["sequence"]
        modes = ("data_parallel_lora", "fsdp_lora") if lora else ("data_parallel", "data_parallel_empty_rank", "fsdp")
        for mode in modes:
            parameters, metrics = results[mode, aggregation]
            for name, param in expected.named_parameters():
                assert torch.allclose(parameters[name], param, rtol=0, atol=1e-6), (mode, aggregation, name)
            for key in ("loss", "grad_norm", "entropy", "advantage_abs_mean"):  # the loss is ~0 on-policy: abs
                assert metrics[key] == pytest.approx(expected_metrics[key], rel=1e-5, abs=1e-6), (mode, key)
        moved = max((p - q).abs().max().item() for p, q in zip(expected.state_dict().values(),
                                                               with_adapters(copy.deepcopy(initial)).state_dict().values()
                                                               if lora else initial.state_dict().values()))
        assert moved > 1e-4  # the update did something to compare


@pytest.mark.slow
def test_two_rank_master_weights_update_equals_single_process(ranks_output, tiny_model_dir):
    results = torch.load(ranks_output / "updates.pt")
    expected = master_weights_update(Transformer.from_pretrained(tiny_model_dir, dtype=torch.bfloat16),
                                     [episode for group in shared_prompt_groups() for episode in group])
    initial = Transformer.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).state_dict()
    for name, master in expected.items():
        assert torch.allclose(results["master_weights"][name], master, rtol=0, atol=1e-6), name
    assert max((master - initial[name].float()).abs().max() for name, master in expected.items()) > 5e-4  # moved


@pytest.mark.slow
@pytest.mark.parametrize("run", ["data_parallel", "fsdp"])
def test_two_rank_training_run_logs_once_and_writes_one_loadable_checkpoint(ranks_output, tiny_model_dir, run):
    # Imported here, not at the top: the ranks run this file too, and start faster without them.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM

    event_files = list((ranks_output / run / "logs").rglob("events.out.tfevents.*"))
    assert len(event_files) == 1, event_files
    events = EventAccumulator(str(event_files[0].parent), size_guidance={"scalars": 0}).Reload()
    assert [event.step for event in events.Scalars("reward/mean")] == [1, 2]  # (a flat step logs no loss)
    assert [event.step for event in events.Scalars("eval/success_rate")] == [0, 2]
    assert events.Scalars("eval/num_questions")[-1].value == 5  # both ranks' shares (3 and 2), gathered

    run_dir = ranks_output / run / "checkpoints" / "tiny"
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "finished", "step_000002"]
    checkpoint_dir = run_dir / "step_000002"
    ours = Transformer.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()
    initial = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, 400, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max() <= 1e-4
        assert (ours(tokens) - initial(tokens)).abs().max() > 1e-4  # training changed the policy
    trainer_state = torch.load(checkpoint_dir / "trainer_state.pt", weights_only=False)
    generators = [rank_state["generator"] for rank_state in trainer_state["rng_per_rank"]]
    assert len(generators) == NUM_RANKS and not torch.equal(*generators)  # each rank's own sampling state
    assert len(trainer_state["optimizer"]["state"]) == len(list(ours.parameters()))  # whole, not one shard


@pytest.mark.slow
def test_fsdp_lora_run_writes_its_adapter_and_the_merged_model(ranks_output, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    last = ranks_output / "fsdp_lora" / "checkpoints" / "tiny" / "step_000002"
    merged = AutoModelForCausalLM.from_pretrained(last, dtype=torch.float32)
    by_hand = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32)
    by_hand.add_adapters(2, 32.0)
    by_hand.load_adapter(last / "adapter")  # gathered from the shards: whole
    tokens = torch.randint(0, 400, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (merged(tokens).logits - by_hand(tokens)).abs().max() <= 1e-4
        assert max(layer.lora_B.weight.abs().max() for layer in by_hand.adapted_layers().values()) > 0  # trained
    trainer_state = torch.load(last / "trainer_state.pt", weights_only=False)
    assert len(trainer_state["optimizer"]["state"]) == 2 * 7 * 2  # the adapters' moments only


@pytest.mark.slow
def test_fsdp_resume_equals_uninterrupted_run(ranks_output):
    uninterrupted = ranks_output / "fsdp" / "checkpoints" / "tiny" / "step_000002"
    resumed = ranks_output / "fsdp_resumed" / "checkpoints" / "tiny" / "step_000002"
    assert (ranks_output / "fsdp_resumed" / "checkpoints" / "tiny" / "step_000001").is_dir()
    full = Transformer.from_pretrained(uninterrupted, dtype=torch.float32)
    cut = Transformer.from_pretrained(resumed, dtype=torch.float32)
    for (name, a), b in zip(full.named_parameters(), cut.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_two_rank_sft_equals_single_process(ranks_output, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = config_lib.load(train_sft.SFTConfig, ranks_output / "sft.yaml",
                             [f"output_dir={tmp_path / 'model'}", f"logging.log_dir={tmp_path / 'logs'}",
                              f"checkpoint.dir={tmp_path / 'checkpoints'}"])
    metrics = train_sft.train_sft(config)
    expected = Transformer.from_pretrained(tmp_path / "model", dtype=torch.float32)
    two_ranks = Transformer.from_pretrained(ranks_output / "sft" / "model", dtype=torch.float32)
    # AdamW divides by the gradient's size, so the float32 rounding of a different summation order can
    # move a near-zero coordinate by ~1e-6; a wrong normalisation would move them by ~lr (1e-3).
    for (name, a), b in zip(expected.named_parameters(), two_ranks.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-5), name
    assert len(list((ranks_output / "sft" / "logs").rglob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(ranks_output / "sft" / "logs" / "sft")).Reload()
    assert events.Scalars("eval/loss")[-1].value == pytest.approx(metrics["eval/loss"], rel=1e-6)


def test_resume_with_another_world_size_is_refused(tmp_path, tiny_model_dir, countdown_dir):
    config = grpo_config(tmp_path, "single", tiny_model_dir, countdown_dir, fsdp=False)
    train.train(config_lib.load(train.TrainConfig, config, ["optim.num_steps=1", "eval.interval=0"]))
    # Pretend the checkpoint came from two ranks.
    state_file = tmp_path / "single" / "checkpoints" / "tiny" / "step_000001" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=False)
    torch.save({**state, "rng_per_rank": state["rng_per_rank"] * 2}, state_file)
    with pytest.raises(ValueError, match="written by 2 ranks; resume it with as many"):
        train.train(config_lib.load(train.TrainConfig, config, ["eval.interval=0"]),
                    resume=str(tmp_path / "single" / "checkpoints" / "tiny"))


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.memory_efficient_adamw=true", "fsdp already shards AdamW's state.*memory_efficient_adamw: false"),
        ("optim.skip_unfinished_episodes=true", "episodes on every rank; set optim.skip_unfinished_episodes: false"),
        ("model.dtype=bfloat16", r"optim.master_weights: float32 master weights of bfloat16 weights are not supported "
                                 r"with distributed.fsdp yet; set model.dtype: float32 .* or optim.master_weights: null"),
    ],
)
def test_fsdp_config_conflicts_name_the_fix(tmp_path, override, message):
    config = grpo_config(tmp_path, "conflict", "model", "data", fsdp=True)
    with pytest.raises(config_lib.ConfigError, match=message):
        config_lib.load(train.TrainConfig, config, [override])
    config_lib.load(train.TrainConfig, config, ["model.dtype=bfloat16", "optim.master_weights=null"])  # the fix
    config_lib.load(train.TrainConfig, config, ["model.dtype=bfloat16", "model.lora.rank=2"])  # float32 adapters


def test_single_process_helpers_are_identities(tiny_model_dir):
    """A plain run creates no process group, and every helper falls back to the one-process answer."""
    model = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert not distributed.is_initialized() and distributed.world_size() == 1
    assert distributed.shard_range(5) == range(5)
    assert distributed.global_sums({"tokens": 3, "loss": 0.5}) == {"tokens": 3, "loss": 0.5}
    assert distributed.all_gather("x") == ["x"]
    assert distributed.savable_model(model) is model and not distributed.is_sharded(model)
    assert distributed.training_model(model, torch.device("cpu"), fsdp=True) is model
