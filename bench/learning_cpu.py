"""Run the CPU demo from scratch and report how much GRPO learned, and how long each phase took.

    uv run bench/learning_cpu.py [--config config_cpu.yaml] [--workdir DIR] [--set section.key=value ...]

Everything the demo creates (dataset, base model, SFT model, logs, checkpoints) goes to a fresh
--workdir, so nothing cached from an earlier run is reused. Prints a table and JSON: held-out success
after SFT (GRPO step 0) and at every evaluation, the final value, the gain, the final format rate,
and the wall time of each phase.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import config as config_lib  # noqa: E402
import tiny_model  # noqa: E402
import train  # noqa: E402
from bootstrap import BootstrapConfig, prepare_missing_inputs  # noqa: E402
from docs.plot_curves import read_scalars  # noqa: E402


def timed(function, *args, **kwargs) -> float:
    start = time.perf_counter()
    function(*args, **kwargs)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="config_cpu.yaml")
    parser.add_argument("--workdir", help="where the run's files go (default: a new temporary directory)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--json-out", help="also write the JSON result here")
    args = parser.parse_args()

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="learning_cpu_"))
    relocate = [f"task.data_dir={workdir / 'countdown'}", f"model.dir={workdir / 'sft-model'}",
                f"bootstrap.data_dir={workdir / 'countdown'}", f"bootstrap.model_dir={workdir / 'sft-model'}",
                f"logging.log_dir={workdir / 'logs'}", f"checkpoint.dir={workdir / 'checkpoints'}"]
    config = config_lib.load(train.TrainConfig, args.config, relocate + args.set)
    base_model_dir = workdir / "base-model"
    config.bootstrap.sft_overrides += [f"model.dir={base_model_dir}", f"logging.log_dir={workdir / 'logs'}"]

    phases = {}
    phases["dataset_seconds"] = timed(prepare_missing_inputs, BootstrapConfig(data_dir=config.task.data_dir,
                                                                     dataset_args=config.bootstrap.dataset_args),
                                      config.task, None)
    phases["base_model_seconds"] = timed(tiny_model.main, ["--out", str(base_model_dir), *config.bootstrap.base_model_args.split()])
    phases["sft_seconds"] = timed(prepare_missing_inputs, config.bootstrap, config.task, config.model.dir)
    phases["grpo_seconds"] = timed(train.train, config)
    phases["total_seconds"] = sum(phases.values())

    scalars = read_scalars(str(workdir / "logs" / config.run_name))
    steps, success = scalars["eval/success_rate"]
    result = {
        "config": args.config,
        "workdir": str(workdir),
        "eval_questions": int(scalars["eval/num_questions"][1][0]),
        "eval_success_by_step": dict(zip(steps, [round(value, 4) for value in success])),
        "sft_starting_point": round(success[0], 4),
        "final_success": round(success[-1], 4),
        "gain_percentage_points": round(100 * (success[-1] - success[0]), 1),
        "final_format_rate": round(scalars["eval/format_rate"][1][-1], 4),
        "final_mean_format_reward": round(scalars["reward/format"][1][-1], 4),
        **{key: round(value, 1) for key, value in phases.items()},
    }
    print(f"{'GRPO step':>10} {'held-out success':>17}")
    for step, value in result["eval_success_by_step"].items():
        print(f"{step:>10} {value:>17.3f}")
    print(f"gain {result['gain_percentage_points']:+.1f} pp; phases (s): "
          + ", ".join(f"{key.removesuffix('_seconds')} {value:.0f}" for key, value in phases.items()))
    print(json.dumps(result, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
