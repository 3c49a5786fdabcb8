"""The CPU demo, shortened: from nothing to an SFT model to GRPO that raises held-out success."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import config as config_lib
import train


@pytest.mark.slow
def test_shortened_demo_learns(tmp_path):
    """config_cpu.yaml on a smaller, 2-number task with shorter SFT and GRPO phases (~2.5 minutes)."""
    overrides = [
        f"task.data_dir={tmp_path / 'countdown'}", f"model.dir={tmp_path / 'sft-model'}",
        f"bootstrap.data_dir={tmp_path / 'countdown'}", f"bootstrap.model_dir={tmp_path / 'sft-model'}",
        f"logging.log_dir={tmp_path / 'logs'}", f"checkpoint.dir={tmp_path / 'checkpoints'}",
        "progress=false", "optim.num_steps=30", "eval.interval=30", "eval.max_questions=128", "task.test_size=128",
        "bootstrap.dataset_args=--size 12000 --seed 0 --min-numbers 2 --max-numbers 2 --max-number 20 --with-solutions",
        f"bootstrap.sft_overrides=[model.dir={tmp_path / 'base-model'}, logging.log_dir={tmp_path / 'logs'},"
        " optim.num_steps=300, eval.interval=0, progress=false]",
    ]
    config = config_lib.load(train.TrainConfig, "config_cpu.yaml", overrides)
    final = train.train(config)

    events = EventAccumulator(str(tmp_path / "logs" / "cpu-demo")).Reload()
    success = {event.step: event.value for event in events.Scalars("eval/success_rate")}
    assert sorted(success) == [0, 30]
    assert success[0] > 0.1, "the SFT warm-up should already solve some held-out questions"
    assert success[30] > success[0], f"GRPO did not raise held-out success: {success}"
    assert final["format_rate"] > 0.9
    assert (tmp_path / "checkpoints" / "cpu-demo" / "step_000030" / "model.safetensors").is_file()
