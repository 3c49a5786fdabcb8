"""GSM8K end to end on the tiny fixture and the committed sample of real GSM8K rows: GRPO from
configs/gsm8k.yaml, the SFT warm-up from configs/gsm8k_sft.yaml, and the Weights & Biases path (offline)."""

import json
import struct
from pathlib import Path

import pytest
import torch
import wandb
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM
from wandb.proto import wandb_internal_pb2

import config as config_lib
import gsm8k_task
import tasks
import train
import train_sft
from qwen2_model import Transformer
from tokenizer import Tokenizer

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def grpo_config(tmp_path, model_dir, data_dir, *overrides) -> train.TrainConfig:
    """configs/gsm8k.yaml shrunk to a few tiny steps: every other key is the real config's."""
    return config_lib.load(train.TrainConfig, CONFIGS / "gsm8k.yaml", [
        f"model.dir={model_dir}", "model.dtype=float32", "model.gradient_checkpointing=false", "device=cpu",
        "progress=false", f"task.data_dir={data_dir}", "rollout.episodes_per_step=4",
        "rollout.num_answers_per_question=2", "rollout.max_prompt_len=1024", "rollout.max_gen_len=8",
        "optim.num_steps=2", "optim.micro_batch_size=4", "eval.interval=2", "eval.max_questions=3",
        f"logging.log_dir={tmp_path / 'logs'}", f"checkpoint.dir={tmp_path / 'checkpoints'}", *overrides,
    ])


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0}).Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def gsm8k_rows(data_dir, split) -> list[dict]:
    return [json.loads(line) for line in (Path(data_dir) / f"{split}.jsonl").read_text().splitlines()]


def test_configs_are_the_documents_setup():
    grpo = config_lib.load(train.TrainConfig, CONFIGS / "gsm8k.yaml")
    assert (grpo.model.dir, grpo.task.name, grpo.task.data_dir) == ("Qwen/Qwen2.5-Math-1.5B", "gsm8k", "openai/gsm8k")
    assert (grpo.rollout.num_answers_per_question, grpo.rollout.episodes_per_step) == (8, 256)
    assert (grpo.optim.learning_rate, grpo.optim.betas, grpo.optim.max_grad_norm) == (1e-5, (0.9, 0.95), 1.0)
    assert grpo.eval.interval == 10
    assert (grpo.loss.std_normalization, grpo.loss.std_estimator) == (True, "sample")  # torch.std, as the document
    assert config_lib.load(train.TrainConfig, CONFIGS.parent / "config.yaml").loss.std_estimator == "population"
    with pytest.raises(config_lib.ConfigError, match="loss.std_estimator: 'unbiased' is not allowed; use one of"):
        config_lib.load(train.TrainConfig, CONFIGS / "gsm8k.yaml", ["loss.std_estimator=unbiased"])
    sft = config_lib.load(train_sft.SFTConfig, CONFIGS / "gsm8k_sft.yaml")
    assert sft.model.dir == grpo.model.dir and sft.task == grpo.task  # SFT teaches the prompt GRPO trains on
    assert (sft.optim.betas, sft.eval.max_gen_len) == (grpo.optim.betas, grpo.rollout.max_gen_len)


@pytest.fixture
def recorded_rewards(monkeypatch) -> list[dict]:
    """Every call of the real GSM8K reward during a run, in order."""
    calls = []
    real_reward = gsm8k_task.reward

    def recording_reward(response, item, end_token):
        score = real_reward(response, item, end_token)
        calls.append({"item": item, **score})
        return score

    monkeypatch.setattr(gsm8k_task, "reward", recording_reward)
    return calls


@pytest.mark.slow
def test_grpo_run_grades_gsm8k_logs_evaluations_and_saves_a_checkpoint(tmp_path, tiny_model_dir, gsm8k_sample_dir,
                                                                        recorded_rewards):
    metrics = train.train(grpo_config(tmp_path, tiny_model_dir, gsm8k_sample_dir))

    # Call order: eval at step 0 (3 questions), rollouts of steps 1 and 2 (2 questions x 2 answers), eval at step 2.
    assert len(recorded_rewards) == 3 + 4 + 4 + 3
    first_eval, rollouts, last_eval = recorded_rewards[:3], recorded_rewards[3:11], recorded_rewards[11:]
    test_rows = gsm8k_rows(gsm8k_sample_dir, "test")
    train_questions = {row["question"] for row in gsm8k_rows(gsm8k_sample_dir, "train")}
    template = (CONFIGS / "prompts" / "reasoning.txt").read_text().removesuffix("\n")
    for call, row in zip(last_eval, test_rows):
        assert call["item"]["prompt"] == template.replace("{question}", row["question"])
        assert call["item"]["answer"] == row["answer"].rpartition("####")[2].strip().replace(",", "")
    assert [c["item"]["question"] for c in first_eval] == [c["item"]["question"] for c in last_eval]
    assert all(call["item"]["question"] in train_questions for call in rollouts)

    scalars = read_scalars(tmp_path / "logs" / "gsm8k")
    assert [step for step, _ in scalars["eval/success_rate"]] == [0, 2]
    assert [step for step, _ in scalars["reward/mean"]] == [1, 2]
    for step, calls in ((1, rollouts[:4]), (2, rollouts[4:])):
        assert dict(scalars["reward/mean"])[step] == pytest.approx(sum(c["reward"] for c in calls) / 4)
    last_eval_success = sum(c["reward_info"]["answer_reward"] > 0 for c in last_eval) / 3
    last_eval_format = sum(c["reward_info"]["format_reward"] > 0 for c in last_eval) / 3
    assert dict(scalars["eval/success_rate"])[2] == pytest.approx(last_eval_success) == metrics["success_rate"]
    assert dict(scalars["eval/format_rate"])[2] == pytest.approx(last_eval_format)
    assert metrics["num_questions"] == 3

    run_dir = tmp_path / "checkpoints" / "gsm8k"
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "finished", "step_000002"]
    saved_config = config_lib.load(train.TrainConfig, run_dir / "step_000002" / "config.yaml")
    assert (saved_config.task.name, saved_config.task.prompt_template) == ("gsm8k", "reasoning")
    tokens = torch.randint(0, 400, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = Transformer.from_pretrained(run_dir / "step_000002", dtype=torch.float32)(tokens)
        theirs = AutoModelForCausalLM.from_pretrained(run_dir / "step_000002", dtype=torch.float32)(tokens).logits
    assert (ours - theirs).abs().max() <= 1e-4


def sft_config(tmp_path, model_dir, data_dir, *overrides) -> train_sft.SFTConfig:
    """configs/gsm8k_sft.yaml shrunk to a few tiny steps: every other key is the real config's."""
    return config_lib.load(train_sft.SFTConfig, CONFIGS / "gsm8k_sft.yaml", [
        f"model.dir={model_dir}", "model.dtype=float32", "model.gradient_checkpointing=false", "device=cpu",
        "progress=false", f"task.data_dir={data_dir}", f"output_dir={tmp_path / 'sft-model'}", "data.eval_size=8",
        "optim.num_steps=4", "optim.batch_size=4", "optim.micro_batch_size=4", "optim.learning_rate=3e-3",
        "optim.warmup_steps=0", "eval.interval=4", "eval.max_questions=2", "eval.max_gen_len=8",
        f"logging.log_dir={tmp_path / 'logs'}", *overrides,
    ])


@pytest.mark.slow
def test_sft_on_gsm8k_pairs_lowers_held_out_loss(tmp_path, tiny_model_dir, gsm8k_sample_dir, monkeypatch):
    tokenized = []  # what train_sft.py trains and evaluates on: (train examples, held-out examples)
    real_tokenize_pairs = train_sft.tokenize_pairs

    def recording_tokenize_pairs(*args):
        tokenized.append(real_tokenize_pairs(*args))
        return tokenized[-1]

    monkeypatch.setattr(train_sft, "tokenize_pairs", recording_tokenize_pairs)
    config = sft_config(tmp_path, tiny_model_dir, gsm8k_sample_dir, "data.max_seq_len=2048")  # tiny BPE: more tokens
    metrics = train_sft.train_sft(config)

    (train_examples, eval_examples) = tokenized
    rows = gsm8k_rows(gsm8k_sample_dir, "train")
    assert (len(train_examples), len(eval_examples)) == (len(rows) - 8, 8)  # none left out
    tokenizer = Tokenizer(tiny_model_dir)
    ids, prompt_length = eval_examples[-1]  # the last training problem, held out
    answer = rows[-1]["answer"].rpartition("####")[2].strip().replace(",", "")
    assert tokenizer.decode(ids[:prompt_length]).endswith(f"User: {rows[-1]['question']}\nAssistant: <think>")
    assert tokenizer.decode(ids[prompt_length:]).endswith(f"</think> <answer> {answer} </answer><|im_end|>")

    held_out_loss = dict(read_scalars(tmp_path / "logs" / "gsm8k-sft")["eval/loss"])
    assert held_out_loss[4] < held_out_loss[0] - 0.5
    assert metrics["eval/loss"] == pytest.approx(held_out_loss[4]) and metrics["eval/num_questions"] == 2
    assert Tokenizer(tmp_path / "sft-model").eos_token == "<|im_end|>"


@pytest.mark.slow
def test_sft_data_jsonl_holds_the_pairs_the_task_gives(tmp_path, tiny_model_dir, gsm8k_sample_dir):
    gsm8k_task.main(["sft-data", "--data", str(gsm8k_sample_dir), "--out", str(tmp_path / "sft.jsonl")])
    config = sft_config(tmp_path, tiny_model_dir, gsm8k_sample_dir)
    assert train_sft.read_pairs(tmp_path / "sft.jsonl") == tasks.sft_pairs(config.task, Tokenizer(tiny_model_dir))


def read_wandb_history(run_file: Path) -> tuple[list, list[dict]]:
    """The records of an offline W&B run file, and its history rows as {key: value}.

    The file is the LevelDB log format (32 KiB blocks of [crc32, length, type] chunks) after a 7-byte
    header, each record one protobuf `Record`.
    """
    data, block_size = run_file.read_bytes(), 32768
    assert data[:4] == b":W&B", "not an offline W&B run file"
    position, pending, records = 7, b"", []
    while position + 7 <= len(data):
        if block_size - position % block_size < 7:  # a block's tail too short for a header is padding
            position += block_size - position % block_size
            continue
        _, length, chunk_type = struct.unpack("<IHB", data[position : position + 7])
        if chunk_type == 0:
            break
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if chunk_type in (1, 4):  # FULL or LAST chunk: a record is complete
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
               for record in records if record.WhichOneof("record_type") == "history"]
    return records, history


@pytest.mark.slow
def test_wandb_offline_records_every_scalar_at_its_step(tmp_path, tiny_model_dir, gsm8k_sample_dir, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    train.train(grpo_config(tmp_path, tiny_model_dir, gsm8k_sample_dir, "logging.wandb=true", "optim.num_steps=1",
                            "eval.interval=1", "eval.max_questions=2"))
    wandb.teardown()  # the W&B service writes the run file in the background; this waits until it is done

    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records, history = read_wandb_history(run_file)
    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run_record.display_name == "gsm8k"
    logged_config = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert logged_config["task"]["name"] == "gsm8k" and logged_config["optim"]["betas"] == [0.9, 0.95]
    # The step-0 evaluation comes after the config text of step 1: it must not be dropped.
    for tag, values in read_scalars(tmp_path / "logs" / "gsm8k").items():
        logged = [(row["step"], row[tag]) for row in history if tag in row]
        assert [step for step, _ in logged] == [step for step, _ in values], tag
        assert [value for _, value in logged] == pytest.approx([value for _, value in values], rel=1e-6), tag
    assert any("eval/sample" in row for row in history)
