"""The SFT warm-up, then GRPO, through the command-line entry points on a tiny model of each architecture.

Each tiny model has its family's tokenizer and chat template (ChatML for Qwen2/Qwen3, the Llama 3
header format with pad == eos for Llama), so this is the path a user bringing their own checkpoint takes.
"""

import json
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM, AutoTokenizer

import countdown_task
import tasks
import train
import train_sft
from config import ModelSetup, SFTDataConfig
from qwen2_model import Transformer
from tiny_model import build_tiny_model
from tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
ARCHS = ["qwen2", "qwen3", "llama"]


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request, tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), arch=request.param, seed=2)


@pytest.fixture(scope="module")
def countdown_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("countdown-solutions")
    countdown_task.main(["generate", "--out", str(out), "--size", "80", "--seed", "3", "--max-number", "20",
                         "--with-solutions"])
    return out


def scalars(log_dir) -> dict[str, dict[int, float]]:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0}).Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def assert_loads_in_transformers_with_our_logits(model_dir: Path) -> Transformer:
    ours = Transformer.from_pretrained(model_dir, dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, 400, (2, 15), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max().item() <= 1e-4
    return ours


def assert_prompts_follow_the_chat_template(model_dir: Path, examples, prompt_messages, prefill: str) -> None:
    """The SFT pairs' token ids equal transformers' apply_chat_template + prefill, then response + eos."""
    reference = AutoTokenizer.from_pretrained(model_dir)
    ids, prompt_length = examples[0]
    expected_prompt = reference.apply_chat_template(prompt_messages, add_generation_prompt=True, tokenize=False)
    assert Tokenizer(model_dir).decode(ids[:prompt_length]) == expected_prompt + prefill
    assert ids[-1] == reference.convert_tokens_to_ids(reference.eos_token)


def test_tiny_model_is_in_the_hub_layout_transformers_writes(tmp_path, model_dir):
    """config.json equals what transformers 5 saves for the same model; the chat template renders the same."""
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference.save_pretrained(tmp_path)
    theirs = json.loads((tmp_path / "config.json").read_text())
    theirs.pop("transformers_version")
    assert json.loads((model_dir / "config.json").read_text()) == theirs
    assert_loads_in_transformers_with_our_logits(model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 7?"}]
    expected = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(messages, add_generation_prompt=True,
                                                                             tokenize=False)
    assert Tokenizer(model_dir).render_chat(messages) == expected


@pytest.mark.slow
def test_countdown_sft_then_grpo(tmp_path, model_dir, countdown_dir, monkeypatch):
    sft_dir, logs = tmp_path / "sft-model", tmp_path / "logs"
    # The shipped real-model configs, shrunk to seconds (a tiny random model also needs a large learning rate).
    train_sft.main(["--config", str(REPO / "configs" / "countdown_sft.yaml"), *sum((["--set", s] for s in [
        f"model.dir={model_dir}", "model.dtype=float32", f"output_dir={sft_dir}", "run_name=sft", "progress=false",
        "device=cpu", f"task.data_dir={countdown_dir}", "task.test_size=8", "data.eval_size=16", "optim.num_steps=10",
        "optim.batch_size=8", "optim.micro_batch_size=4", "optim.learning_rate=3e-3", "optim.warmup_steps=0",
        "eval.interval=10", "eval.max_questions=4", "eval.batch_size=4", "eval.max_gen_len=16",
        f"logging.log_dir={logs}", f"checkpoint.dir={tmp_path / 'checkpoints'}"]), [])])
    held_out = scalars(logs / "sft")["eval/loss"]
    assert held_out[10] < held_out[0] - 0.5
    assert_loads_in_transformers_with_our_logits(sft_dir)
    config = train_sft.SFTConfig(model=ModelSetup(dir=str(sft_dir)),
                                 task=tasks.TaskConfig(data_dir=str(countdown_dir), test_size=8),
                                 data=SFTDataConfig(eval_size=16))
    train_examples, _ = train_sft.load_examples(config, Tokenizer(sft_dir))
    item = tasks.load_dataset(config.task, Tokenizer(sft_dir), "train")[len(train_examples) - 1]
    messages = [{"role": "system", "content": countdown_task.SYSTEM_MESSAGE},
                {"role": "user", "content": countdown_task.USER_TEMPLATE.format(numbers=item["nums"], target=item["target"])}]
    assert_prompts_follow_the_chat_template(sft_dir, train_examples[-1:], messages, countdown_task.RESPONSE_PREFILL)

    # A few SFT steps rarely earn CountDown reward, so GRPO here rewards digits: every step has a gradient.
    def digit_reward(response, item, end_token):
        share = sum(character.isdigit() for character in response) / max(len(response), 1)
        return {"reward": share, "reward_info": {"format_reward": 0.0, "answer_reward": float(share > 0.3)}}

    monkeypatch.setattr(countdown_task, "reward", digit_reward)
    train.main(["--config", str(REPO / "config.yaml"), *sum((["--set", s] for s in [
        f"model.dir={sft_dir}", "model.dtype=float32", "run_name=grpo", "progress=false", "device=cpu",
        f"task.data_dir={countdown_dir}",
        "task.test_size=8", "rollout.episodes_per_step=8", "rollout.num_answers_per_question=4",
        "rollout.max_gen_len=16", "optim.num_steps=2", "optim.micro_batch_size=4", "optim.learning_rate=1e-3",
        "eval.interval=2", "eval.max_questions=4", "eval.max_gen_len=8", f"logging.log_dir={logs}",
        f"checkpoint.dir={tmp_path / 'checkpoints'}", "checkpoint.interval=2"]), [])])
    assert sorted(scalars(logs / "grpo")["train/loss"]) == [1, 2]
    after = assert_loads_in_transformers_with_our_logits(tmp_path / "checkpoints" / "grpo" / "step_000002")
    before = Transformer.from_pretrained(sft_dir, dtype=torch.float32)
    assert not torch.equal(after.layers[0].self_attn.q_proj.weight, before.layers[0].self_attn.q_proj.weight)
    assert (tmp_path / "checkpoints" / "grpo" / "step_000002" / "tokenizer_config.json").is_file()


@pytest.fixture(scope="module")
def gsm8k_head(gsm8k_sample_dir, tmp_path_factory) -> Path:
    """The first 40 rows of the committed GSM8K training sample."""
    out = tmp_path_factory.mktemp("gsm8k-head")
    with (gsm8k_sample_dir / "train.jsonl").open(encoding="utf-8") as rows:
        (out / "train.jsonl").write_text("".join(next(rows) for _ in range(40)), encoding="utf-8")
    return out


@pytest.mark.slow
def test_gsm8k_sft_on_each_architecture(tmp_path, model_dir, gsm8k_head):
    logs, gsm8k_data_dir = tmp_path / "logs", gsm8k_head
    train_sft.main(["--config", str(REPO / "configs" / "gsm8k_sft.yaml"), *sum((["--set", s] for s in [
        f"model.dir={model_dir}", "model.dtype=float32", "model.gradient_checkpointing=false", "device=cpu",
        "progress=false", f"task.data_dir={gsm8k_data_dir}", f"output_dir={tmp_path / 'sft-model'}",
        "data.max_seq_len=2048", "data.eval_size=8", "optim.num_steps=2", "optim.batch_size=4",
        "optim.micro_batch_size=4", "optim.warmup_steps=0", "eval.interval=2", "eval.max_questions=0",
        f"logging.log_dir={logs}", f"checkpoint.dir={tmp_path / 'checkpoints'}", "run_name=sft"]), [])])
    assert sorted(scalars(logs / "sft")["eval/loss"]) == [0, 2]
    assert_loads_in_transformers_with_our_logits(tmp_path / "sft-model")
    # GSM8K prompts are plain text (configs/prompts/reasoning.txt), so any tokenizer takes them; the response ends with eos.
    config = train_sft.SFTConfig(task=tasks.TaskConfig(name="gsm8k", data_dir=str(gsm8k_data_dir)),
                                 data=SFTDataConfig(max_seq_len=4096, eval_size=8))
    train_examples, _ = train_sft.load_examples(config, Tokenizer(model_dir))
    ids, prompt_length = train_examples[0]
    question = json.loads((gsm8k_data_dir / "train.jsonl").open().readline())["question"]
    template = (REPO / "configs" / "prompts" / "reasoning.txt").read_text().removesuffix("\n")
    reference = AutoTokenizer.from_pretrained(model_dir)
    assert ids[:prompt_length] == reference.encode(template.replace("{question}", question), add_special_tokens=False)
    assert ids[-1] == reference.convert_tokens_to_ids(reference.eos_token)
