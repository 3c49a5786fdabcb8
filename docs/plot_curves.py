"""Plot a run's curves from its TensorBoard logs into a PNG (the README's figure).

    uv run docs/plot_curves.py --logdir logs/cpu-demo --out docs/cpu_demo_curves.png
"""

import argparse

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

PANELS = [("eval/success_rate", "held-out success rate"), ("reward/mean", "mean training reward")]


def read_scalars(logdir: str) -> dict[str, tuple[list[int], list[float]]]:
    events = EventAccumulator(logdir, size_guidance={"scalars": 0}).Reload()
    series = {}
    for tag in events.Tags()["scalars"]:
        points = events.Scalars(tag)
        series[tag] = ([p.step for p in points], [p.value for p in points])
    return series


def moving_average(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def plot(logdir: str, out: str, title: str) -> None:
    series = read_scalars(logdir)
    missing = [tag for tag, _ in PANELS if tag not in series]
    if missing:
        raise SystemExit(f"{logdir} has no {missing} scalars; is it a train.py run directory?")
    figure, axes = plt.subplots(1, len(PANELS), figsize=(10, 3.8))
    for axis, (tag, label) in zip(axes, PANELS):
        steps, values = series[tag]
        if tag.startswith("eval/"):
            axis.plot(steps, values, marker="o", markersize=3)
        else:  # 16 questions a step make a noisy curve: show it light, with its moving average
            axis.plot(steps, values, alpha=0.3)
            axis.plot(steps, moving_average(values, window=10), label="10-step average")
            axis.legend()
        axis.set_xlabel("GRPO step")
        axis.set_title(label)
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logdir", default="logs/cpu-demo")
    parser.add_argument("--out", default="docs/cpu_demo_curves.png")
    parser.add_argument("--title", default="CPU demo: GRPO on CountDown after the SFT warm-up")
    args = parser.parse_args()
    plot(args.logdir, args.out, args.title)


if __name__ == "__main__":
    main()
