"""LoRA: the adapter layer against PEFT on transformers' model, the update against a hand gradient, and GRPO and
SFT runs that checkpoint, resume and export adapters (PEFT's layout) and merged models (transformers')."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

import config as config_lib
import train
import train_sft
from grpo import LossConfig, compute_advantages, update_policy
from optimizer import new_adamw
from qwen2_model import Transformer, WithoutAdapters
from runtime import load_model
from test_grpo import LEARNING_RATE, PAD, TOKEN, hand_loss, sample_episodes
from test_train import countdown_dir, digit_reward, read_scalars, tiny_config  # noqa: F401 (fixtures)
from test_train_sft import countdown_with_solutions, sft_config  # noqa: F401 (fixture)

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENS = torch.randint(0, 400, (2, 11), generator=torch.Generator().manual_seed(0))


def adapted(model_dir, rank=4, alpha=8.0, layers=None, seed=3, trained=True) -> Transformer:
    """The tiny model with adapters; `trained`: B moved off zero, as training would, so the adapters change outputs."""
    model = Transformer.from_pretrained(model_dir, dtype=torch.float32)
    model.add_adapters(rank, alpha, *([layers] if layers else []), seed=seed)
    if trained:
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for layer in model.adapted_layers().values():
                layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=generator) * 0.05)
    return model


def test_new_adapters_change_nothing_and_only_they_train(tiny_model_dir):
    base = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = adapted(tiny_model_dir, trained=False)
    assert torch.equal(model(TOKENS), base(TOKENS))  # B starts at 0
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert len(trainable) == 2 * 7 * model.config.num_hidden_layers  # every linear layer of every block
    log_probs, _ = model(TOKENS, targets=TOKENS)
    log_probs.sum().backward()
    assert all((param.grad is not None) == param.requires_grad for param in model.parameters())  # the head too
    assert len(new_adamw(model.parameters(), config_lib.OptimConfig()).param_groups[0]["params"]) == len(trainable)


def test_adapters_compute_what_peft_computes_on_transformers_model(tiny_model_dir, tmp_path):
    model = adapted(tiny_model_dir, layers=["q_proj", "v_proj", "down_proj"])
    model.save_adapter(tmp_path / "adapter", base_model=str(tiny_model_dir))
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                          tmp_path / "adapter").eval()
    with torch.no_grad():
        ours, theirs = model(TOKENS), reference(TOKENS).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)(TOKENS).logits
        assert (ours - theirs).abs().max() <= 1e-5
        assert (ours - base).abs().max() > 1e-2  # the adapters matter in this comparison
        with model.adapters_disabled():
            assert (model(TOKENS) - base).abs().max() <= 1e-5  # off, the base model: LoRA's KL reference
        assert torch.equal(WithoutAdapters(model)(TOKENS), model.adapters_disabled().__enter__()(TOKENS))
    # PEFT's adapter loads back into ours, and the merged model is transformers' own class with the same logits.
    again = adapted(tiny_model_dir, layers=["q_proj", "v_proj", "down_proj"], seed=9)
    again.load_adapter(tmp_path / "adapter")
    model.save_pretrained(tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(again(TOKENS), ours)
        assert (merged(TOKENS).logits - ours).abs().max() <= 1e-5
    assert not any("lora" in key for key in json.dumps(sorted(merged.state_dict())).split('"'))


def test_adapter_of_other_settings_is_refused_by_name(tiny_model_dir, tmp_path):
    adapted(tiny_model_dir, rank=4).save_adapter(tmp_path / "adapter", base_model=str(tiny_model_dir))
    with pytest.raises(ValueError, match=r"rank 4, alpha 8.0.*this model's adapters: \{'rank': 2"):
        adapted(tiny_model_dir, rank=2).load_adapter(tmp_path / "adapter")


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_update_of_the_adapters_equals_the_hand_gradient(tiny_model_dir, gradient_checkpointing):
    """GRPO's update on a LoRA model: SGD on the adapters by the hand-computed token-level loss, the weights untouched."""
    from distributed import OptimizerStep

    model = adapted(tiny_model_dir)
    model.gradient_checkpointing = gradient_checkpointing
    episodes = sample_episodes()
    config = LossConfig()
    advantages = compute_advantages(episodes, config)
    updated = copy.deepcopy(model)
    optimizer = torch.optim.SGD([p for p in updated.parameters() if p.requires_grad], lr=LEARNING_RATE)
    update_policy(updated, OptimizerStep(updated, optimizer, max_grad_norm=1e9), episodes, advantages, config=config,
                  optim=config_lib.OptimConfig(micro_batch_size=2, logprob_chunk_size=4), max_gen_len=16,
                  pad_token_id=PAD)
    expected = copy.deepcopy(model)
    hand_loss(expected, episodes, advantages, TOKEN).backward()
    with torch.no_grad():
        for param in expected.parameters():
            if param.requires_grad:
                param -= LEARNING_RATE * param.grad
    for (name, a), b, before in zip(updated.named_parameters(), expected.parameters(), model.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
        assert torch.equal(a, before) == (not a.requires_grad), name  # the adapters move, nothing else


def lora_run_config(tmp_path, model_dir, data_dir, *overrides):
    return tiny_config(tmp_path, model_dir, data_dir, "model.lora.rank=2", "loss.kl_beta=0.1", "optim.memory_efficient_adamw=true",
                       "optim.learning_rate=5e-2", *overrides)


@pytest.mark.slow
def test_grpo_lora_run_checkpoints_adapters_resumes_exactly_and_exports_both(tmp_path, tiny_model_dir, countdown_dir,
                                                                            digit_reward):
    full, cut = tmp_path / "full", tmp_path / "cut"
    train.train(lora_run_config(full, tiny_model_dir, countdown_dir, "optim.num_steps=4"))
    train.train(lora_run_config(cut, tiny_model_dir, countdown_dir, "optim.num_steps=2"))
    train.train(lora_run_config(cut, tiny_model_dir, countdown_dir, "optim.num_steps=4"),
                resume=str(cut / "checkpoints" / "tiny"))
    run_dir = full / "checkpoints" / "tiny"
    before_end, last = run_dir / "step_000002", run_dir / "step_000004"
    # Before the last step, the adapters alone (small); after it, the merged model beside them.
    assert sorted(p.name for p in before_end.iterdir()) == ["adapter", "config.yaml", "tokenizer.json",
                                                            "tokenizer_config.json", "trainer_state.pt"]
    assert (last / "model.safetensors").is_file() and (last / "adapter" / "adapter_model.safetensors").is_file()
    state = torch.load(before_end / "trainer_state.pt", weights_only=False)
    assert len(state["optimizer"]["state"]) == 2 * 7 * 2  # AdamW's moments: the adapters' only
    # The resumed run's adapters and metrics are the uninterrupted run's.
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (last / "adapter" / name).read_bytes() == (cut / "checkpoints/tiny/step_000004/adapter" / name).read_bytes()
    kl = [value for _, value in read_scalars(full / "logs" / "tiny")["train/kl"]]
    assert kl[0] == 0.0 and kl[-1] > 0  # the reference is the model with its adapters off: the start
    # The merged model is transformers' and PEFT's adapter on transformers' base model computes the same.
    merged = AutoModelForCausalLM.from_pretrained(last, dtype=torch.float32)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                     last / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        assert (merged(TOKENS).logits - peft(TOKENS).logits).abs().max() <= 1e-5
        assert (merged(TOKENS).logits - base(TOKENS).logits).abs().max() > 1e-4  # training moved the adapters
    # model.dir and evaluate.py take an adapter-only checkpoint as the model it stands for: base + adapter.
    setup = config_lib.ModelSetup(dir=str(before_end), dtype="float32")
    from_adapter = load_model(setup, torch.device("cpu"))
    by_hand = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32)
    by_hand.add_adapters(2, 32.0)
    by_hand.load_adapter(before_end / "adapter")
    with torch.no_grad():
        assert (from_adapter(TOKENS) - by_hand(TOKENS)).abs().max() <= 1e-4  # merged: float32 rounding
    assert not from_adapter.adapted_layers() and all(p.requires_grad for p in from_adapter.parameters())
    result = subprocess.run([sys.executable, "evaluate.py", "--model", str(before_end), "--max-questions", "2",
                             "--out", str(tmp_path / "samples.jsonl")], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout[: result.stdout.rindex("}") + 1])["num_questions"] == 2


@pytest.mark.slow
def test_sft_lora_writes_the_merged_model_and_its_adapter(tmp_path, tiny_model_dir, countdown_with_solutions):
    config = sft_config(tmp_path, tiny_model_dir, countdown_with_solutions, "model.lora.rank=3",
                        "model.lora.layers=[q_proj, up_proj]", "optim.num_steps=3", "eval.interval=0")
    train_sft.train_sft(config)
    out = tmp_path / "sft-out"
    saved = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"], sorted(saved["target_modules"])) == (3, 32.0, ["q_proj", "up_proj"])
    assert saved["base_model_name_or_path"] == str(Path(tiny_model_dir).resolve())
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                     out / "adapter")
    base = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ours = Transformer.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert (merged(TOKENS).logits - peft(TOKENS).logits).abs().max() <= 1e-5
    changed = {name for (name, a), b in zip(ours.named_parameters(), base.parameters()) if not torch.equal(a, b)}
    assert changed and all(name.endswith(("q_proj.weight", "up_proj.weight")) for name in changed)


@pytest.mark.parametrize("override, message", [
    ("model.lora.rank=0", "config error: model.lora.rank: must be >= 1, got 0"),
    ("model.lora.alpha=0", "config error: model.lora.alpha: must be in (0, 1000000.0], got 0.0"),
    ("model.lora.layers=[q_proj, lm_head]", "config error: model.lora.layers: must be distinct names among q_proj"),
    ("model.lora.layers=[]", "config error: model.lora.layers: must be distinct names"),
    # The tiny model's k/v projections are 32 wide (2 heads of 16): refused from config.json, no weight loaded.
    ("model.lora.rank=40", "config error: model.lora.rank: must be <= 32, the width of this model's k_proj"),
])
def test_bad_lora_settings_stop_before_any_weight_loads(tmp_path, tiny_model_dir, countdown_dir, override, message,
                                                       capsys):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for file in Path(tiny_model_dir).iterdir():
        (model_dir / file.name).write_bytes(file.read_bytes())
    (model_dir / "model.safetensors").write_bytes(b"not weights: reading them would fail")
    config = tiny_config(tmp_path, model_dir, countdown_dir)
    config_lib.dump(config, tmp_path / "config.yaml")
    with pytest.raises(SystemExit) as stopped:
        train.main(["--config", str(tmp_path / "config.yaml"), "--set", override])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.parametrize("first, then", [("model.lora.rank=2", "model.lora.rank=null"),
                                         ("model.lora.rank=null", "model.lora.rank=2"),
                                         ("model.lora.rank=2", "model.lora.rank=4")])
def test_resume_with_other_lora_settings_is_refused_by_name(tmp_path, tiny_model_dir, countdown_dir, digit_reward,
                                                            first, then, capsys):
    train.train(tiny_config(tmp_path, tiny_model_dir, countdown_dir, first, "optim.num_steps=2", "eval.interval=0"))
    run_dir = tmp_path / "checkpoints" / "tiny"
    with pytest.raises(SystemExit) as stopped:
        train.main(["--resume", str(run_dir), "--set", then, "--set", "optim.num_steps=3"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert f"--resume {run_dir}" in error and "model.lora" in error
    assert ("full fine-tuning" in error) == ("null" in first + then)
