"""Held-out success curves of one or more train.py runs, read from their TensorBoard logs, on one plot.

    uv run bench/plot_curves.py --logdir logs/cpu-demo [--logdir ...] --out docs/cpu_demo_curves.png
                                [--tag eval/3_numbers/success]

bench/learning_cpu.py draws the README's figure with it: every seed's curve, the SFT start marked.
"""

import argparse
import logging

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

SUCCESS_TAG = "eval/success_rate"
# Its directory watcher logs "No path found after <events file>" at INFO, which the benches' console shows.
logging.getLogger("tensorboard").setLevel(logging.WARNING)


def read_scalars(logdir: str) -> dict[str, tuple[list[int], list[float]]]:
    """Every scalar of a run directory: tag -> (steps, values)."""
    events = EventAccumulator(logdir, size_guidance={"scalars": 0}).Reload()
    series = {}
    for tag in events.Tags()["scalars"]:
        points = events.Scalars(tag)
        series[tag] = ([p.step for p in points], [p.value for p in points])
    return series


def success_curve(logdir: str, tag: str = SUCCESS_TAG) -> tuple[list[int], list[float]]:
    series = read_scalars(logdir)
    if tag not in series:
        raise SystemExit(f"{logdir} has no {tag} scalars; is it a train.py run directory with evaluations?")
    return series[tag]


def plot_success_curves(curves: dict[str, tuple[list[int], list[float]]], out: str, title: str) -> None:
    """One line per run (label -> (steps, success)); step 0, the SFT model GRPO starts from, is marked."""
    figure, axis = plt.subplots(figsize=(7, 4.2))
    for label, (steps, values) in curves.items():
        line, = axis.plot(steps, [100 * v for v in values], marker="o", markersize=3, label=label)
        if steps and steps[0] == 0:
            axis.plot([0], [100 * values[0]], marker="s", markersize=8, color=line.get_color(), fillstyle="none")
    axis.axvline(0, color="grey", linestyle=":", linewidth=1)
    axis.annotate("SFT start (squares)", xy=(0, axis.get_ylim()[0]), xytext=(4, 6), textcoords="offset points",
                  color="grey", fontsize=8)
    axis.set_xlabel("GRPO step")
    axis.set_ylabel("held-out success, T=1 (%)")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logdir", action="append", required=True, help="a run's TensorBoard directory (repeatable)")
    parser.add_argument("--out", default="docs/cpu_demo_curves.png")
    parser.add_argument("--title", default="CPU demo: GRPO on CountDown after the SFT warm-up")
    parser.add_argument("--tag", default=SUCCESS_TAG, help="the scalar to draw, e.g. eval/3_numbers/success")
    args = parser.parse_args()
    plot_success_curves({logdir: success_curve(logdir, args.tag) for logdir in args.logdir}, args.out, args.title)


if __name__ == "__main__":
    main()
