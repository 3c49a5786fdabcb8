"""Rollout speed: our engine vs a GRPO:Zero-style engine vs transformers' generate(), same weights.

Random weights practically never emit eos, so every completion stops at a planted length drawn once
(seeded) from a spread like real answers, identically for every engine: all of them generate exactly
the same number of tokens, and tokens/s compares like with like. Engines run in interleaved rounds
in one process (load on a shared machine hits all of them alike) after one warm-up each; the table
gives the median over rounds of both CPU time and wall time.

    uv run python -m bench.rollout                           # random weights, real Qwen2.5-0.5B shape
    uv run python -m bench.rollout --profile                 # where our engine's time goes
    uv run python -m bench.rollout --model path/to/Qwen2.5-3B-Instruct --device cuda --compile
"""

import argparse
import contextlib
import dataclasses
import functools
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also run as a file: uv run bench/rollout.py

import generation
from bench.report import emit_json
from generation import generate
from qwen2_model import ModelConfig, Transformer, init_weights

SHAPES = {
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=True,
    ),
}
# An id no model can sample: completions end only at their planted lengths.
NEVER_SAMPLED_EOS = -1
PAD = 0
ENGINE, REFERENCE, TRANSFORMERS = "engine", "GRPO:Zero-style", "transformers generate()"


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    num_answers_per_question: int
    stop_lengths: list[int]  # one per completion, prompt-major

    @property
    def generated_tokens(self) -> int:
        return sum(self.stop_lengths)


def build_workload(args, vocab_size: int) -> Workload:
    generator = torch.Generator().manual_seed(args.seed)
    draw = lambda low, high, count: torch.randint(low, high + 1, (count,), generator=generator).tolist()
    # Prompt lengths vary around the mean as rendered chat prompts do, so padding is exercised.
    spread = max(args.prompt_len // 10, 1)
    lengths = draw(args.prompt_len - spread, args.prompt_len + spread, args.questions)
    prompts = [draw(1, vocab_size - 1, length) for length in lengths]
    stop_lengths = draw(args.min_gen_len, args.max_gen_len, args.questions * args.answers)
    return Workload(prompts, args.answers, stop_lengths)


def load_model(name: str, device: torch.device, dtype: torch.dtype) -> Transformer:
    if name not in SHAPES:
        return Transformer.from_pretrained(name, device=device, dtype=dtype).eval()
    config = ModelConfig(**SHAPES[name])
    hf_config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu"}
    model = Transformer(config, hf_config | dataclasses.asdict(config))
    init_weights(model, seed=0)
    return model.to(device=device, dtype=dtype).eval()


def run_engine(model: Transformer, workload: Workload, args, **flags) -> None:
    generator = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(args.seed)
    completions = generate(
        model, workload.prompts, num_samples_per_prompt=workload.num_answers_per_question,
        max_gen_len=max(workload.stop_lengths), eos_token_id=NEVER_SAMPLED_EOS, temperature=args.temperature,
        top_p=args.top_p, generator=generator, stop_lengths=workload.stop_lengths, **flags,
    )
    assert [len(c.token_ids) for c in completions] == workload.stop_lengths


@torch.no_grad()
def run_grpo_zero_style(model: Transformer, workload: Workload, args) -> None:
    """GRPO:Zero's rollout loop, on our model: the engine most from-scratch GRPO repos start from.

    Every answer is its own row, so each prompt is prefilled once per answer; the prompts are fed
    together up to the shortest one, then one position per step for all rows (a row still inside its
    prompt takes its prompt token instead of the sample); every row steps until all rows are done.
    Like GRPO:Zero, attention covers the filled part of the cache, only each forward's last position
    is projected to the vocabulary, and sampling is softmax+multinomial (temperature only).
    """
    device = model.embed_tokens.weight.device
    generator = torch.Generator(device=device).manual_seed(args.seed)
    rows = [prompt for prompt in workload.prompts for _ in range(workload.num_answers_per_question)]
    prompt_lengths = torch.tensor([len(row) for row in rows], device=device)
    stop_lengths = torch.tensor(workload.stop_lengths, device=device)
    total_len = int((prompt_lengths + stop_lengths).max())
    tokens = torch.full((len(rows), total_len), PAD, device=device)
    for index, row in enumerate(rows):
        tokens[index, : len(row)] = torch.tensor(row, device=device)
    in_prompt = torch.arange(total_len, device=device) < prompt_lengths[:, None]
    kv_cache = model.new_kv_cache(len(rows), total_len)
    finished = torch.zeros(len(rows), dtype=torch.bool, device=device)
    previous = 0
    for current in range(min(len(row) for row in rows), total_len):
        filled = kv_cache.first_slots(current)
        positions = torch.arange(previous, current, device=device).expand(len(rows), -1)
        hidden = model.hidden_states(tokens[:, previous:current], positions, filled)
        probs = torch.softmax(model.lm_head(hidden[:, -1]).float() / args.temperature, dim=-1)
        sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        sampled = torch.where(in_prompt[:, current], tokens[:, current], sampled)
        tokens[:, current] = torch.where(finished, PAD, sampled)
        # The planted length stands in for sampling eos.
        finished |= ~in_prompt[:, current] & (current + 1 - prompt_lengths >= stop_lengths)
        previous = current
        if finished.all():
            break


def run_transformers(hf_model, workload: Workload, args) -> None:
    from transformers import StoppingCriteria, StoppingCriteriaList

    rows = [prompt for prompt in workload.prompts for _ in range(workload.num_answers_per_question)]
    width = max(len(row) for row in rows)
    device = hf_model.device
    # Left padding: transformers appends every row's new token at the same column.
    input_ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    attention_mask = torch.zeros_like(input_ids)
    for index, row in enumerate(rows):
        input_ids[index, width - len(row) :] = torch.tensor(row)
        attention_mask[index, width - len(row) :] = 1
    stop_lengths = torch.tensor(workload.stop_lengths, device=device)

    class PlantedLengths(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids.shape[1] - width >= stop_lengths

    output = hf_model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=max(workload.stop_lengths),
        do_sample=args.temperature > 0, temperature=args.temperature or None, top_p=args.top_p, top_k=0,
        stopping_criteria=StoppingCriteriaList([PlantedLengths()]), pad_token_id=PAD, eos_token_id=None,
    )
    assert output.shape[1] - width == max(workload.stop_lengths)


def timed(device: torch.device, run) -> dict:
    """Wall and process CPU seconds of run()."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return dict(wall_seconds=time.perf_counter() - wall, cpu_seconds=time.process_time() - cpu)


def engines(model: Transformer, model_dir: Path, args) -> dict:
    """name -> callable(workload); transformers reads the same weights back from model_dir."""
    runs = {
        ENGINE: lambda workload: run_engine(model, workload, args),
        REFERENCE: lambda workload: run_grpo_zero_style(model, workload, args),
    }
    if args.compile:
        runs["engine, compiled decode"] = lambda workload: run_engine(model, workload, args, compile_decode=True)
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        dtype = model.embed_tokens.weight.dtype
        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(model.embed_tokens.weight.device)
        runs[TRANSFORMERS] = lambda workload: run_transformers(hf_model.eval(), workload, args)
    return runs


def warmup_workload(workload: Workload, device: torch.device) -> Workload:
    """A few tokens per row: kernels, allocator and lazy imports ready, compiled graphs captured (CUDA)."""
    if device.type == "cuda":  # same batch shapes as the timed run, so the captured graphs are reused
        return dataclasses.replace(workload, stop_lengths=[min(4, n) for n in workload.stop_lengths])
    return Workload(workload.prompts[:1], 2, [min(4, n) for n in workload.stop_lengths[:2]])


def setup(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(args.model, device, dtype)
    return device, dtype, model, build_workload(args, model.config.vocab_size)


def measure(args) -> dict:
    device, dtype, model, workload = setup(args)
    rounds = defaultdict(list)
    with tempfile.TemporaryDirectory() as temp_dir:
        model_dir = Path(args.model) if args.model not in SHAPES else Path(temp_dir)
        if args.model in SHAPES and not args.skip_transformers:
            model.save_pretrained(model_dir)
        runs = engines(model, model_dir, args)
        for run in runs.values():
            run(warmup_workload(workload, device))
        names = list(runs)
        for round_number in range(args.rounds):
            # Rotate the order so no engine always runs first (or right after the same neighbour).
            for name in names[round_number % len(names) :] + names[: round_number % len(names)]:
                rounds[name].append(timed(device, lambda: runs[name](workload)))
                print(f"  round {round_number + 1} {name}: {rounds[name][-1]}", file=sys.stderr)
    results = {}
    for name, times in rounds.items():
        medians = {key: statistics.median(t[key] for t in times) for key in ("wall_seconds", "cpu_seconds")}
        results[name] = medians | dict(rounds=times, tokens_per_cpu_second=workload.generated_tokens / medians["cpu_seconds"])
    for result in results.values():
        for baseline, short in ((REFERENCE, "reference"), (TRANSFORMERS, "transformers")):
            if baseline in results:
                for key in ("wall_seconds", "cpu_seconds"):
                    result[f"{key.split('_')[0]}_speedup_vs_{short}"] = results[baseline][key] / result[key]
    return report_header(args, device, dtype, workload) | dict(rounds=args.rounds, engines=results)


def report_header(args, device, dtype, workload: Workload) -> dict:
    return dict(
        model=args.model, device=str(device), dtype=str(dtype).removeprefix("torch."),
        torch_threads=torch.get_num_threads(), questions=args.questions, answers_per_question=args.answers,
        prompt_lengths=[len(p) for p in workload.prompts], gen_len_range=[args.min_gen_len, args.max_gen_len],
        generated_tokens=workload.generated_tokens, max_stop_length=max(workload.stop_lengths),
        temperature=args.temperature, top_p=args.top_p, load_average=load_average(),
    )


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def print_table(report: dict) -> None:
    print(
        f"model {report['model']} on {report['device']} ({report['dtype']}, {report['torch_threads']} threads): "
        f"{report['questions']} questions x {report['answers_per_question']} answers, prompts "
        f"{min(report['prompt_lengths'])}-{max(report['prompt_lengths'])} tokens, planted lengths "
        f"{report['gen_len_range'][0]}-{report['gen_len_range'][1]} ({report['generated_tokens']} tokens); "
        f"median of {report['rounds']} interleaved rounds; load average {report['load_average']}"
    )
    header = ["engine", "CPU s", "wall s", "tokens/CPU s", "vs GRPO:Zero (CPU, wall)", "vs transformers (CPU, wall)"]
    print("| " + " | ".join(header) + " |\n|" + "|".join("-" * (len(h) + 2) for h in header) + "|")
    for name, result in report["engines"].items():
        versus = [
            f"{result[f'cpu_speedup_vs_{short}']:.2f}x, {result[f'wall_speedup_vs_{short}']:.2f}x"
            if f"cpu_speedup_vs_{short}" in result else "-"
            for short in ("reference", "transformers")
        ]
        cells = [name, f"{result['cpu_seconds']:.2f}", f"{result['wall_seconds']:.2f}", f"{result['tokens_per_cpu_second']:.1f}", *versus]
        print("| " + " | ".join(cells) + " |")


# --profile: where the engine's time goes. Generation functions timed as one part each (the
# profiler sees their calls through these labels), then torch ops by name, innermost first.
FUNCTION_PARTS = {
    "prefill": "prefill (one forward over the prompts)",
    "copy_prompt_cache_to_rows": "prompt cache -> per-answer rows copy",
    "sample_and_score": "sampling (log-softmax, CDF, search) and the tokens' log-probs and entropies",
    "keep_rows_in_place": "cache compaction (evicting finished rows)",
}
OP_PARTS = {
    "aten::scaled_dot_product_attention": "decode: attention over the cache",
    "aten::index_put_": "decode: cache writes",
    "aten::linear": "decode: layer matmuls (all layers)",
    "mkldnn::_linear_pointwise": "decode: layer matmuls (all layers)",  # by a packed weight (generation.packed_weights)
    "aten::_local_scalar_dense": "host syncs (reading flags)",
}
LM_HEAD = "decode: lm_head"
LINEAR_OPS = {"aten::linear", "mkldnn::_linear_pointwise"}
OTHER_OPS = "decode: other ops (norms, rotary, residuals, indexing)"
OUTSIDE_OPS = "outside torch ops (Python, dispatch, profiler; on CUDA: device idle)"


@contextlib.contextmanager
def labelled_generation_functions():
    """Wrap generation's functions in profiler labels for the duration (generate looks them up per call)."""
    originals = {name: getattr(generation, name) for name in FUNCTION_PARTS}

    def labelled(name, function):
        @functools.wraps(function)
        def run(*args, **kwargs):
            with torch.profiler.record_function(name):
                return function(*args, **kwargs)

        return run

    try:
        for name, function in originals.items():
            setattr(generation, name, labelled(name, function))
        yield
    finally:
        for name, function in originals.items():
            setattr(generation, name, function)


def event_part(event, lm_head_shape: list[int]) -> str:
    ancestors = []
    while event is not None:
        ancestors.append(event)
        event = event.cpu_parent
    labelled = [e.name for e in ancestors if e.name in FUNCTION_PARTS]
    if labelled:
        return FUNCTION_PARTS[labelled[-1]]  # the outermost: all of prefill is prefill
    for e in ancestors:
        if e.name in LINEAR_OPS and lm_head_shape in e.input_shapes:
            return LM_HEAD
        if e.name in OP_PARTS:
            return OP_PARTS[e.name]
    return OTHER_OPS


def profile(args) -> dict:
    """One rollout of our engine under torch.profiler, its time split into parts (self time per op)."""
    device, dtype, model, workload = setup(args)
    run_engine(model, warmup_workload(workload, device), args)
    plain = timed(device, lambda: run_engine(model, workload, args))
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with labelled_generation_functions(), torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        profiled = timed(device, lambda: run_engine(model, workload, args))
    # On CUDA the device time per op is what matters; on CPU the op's own (self) CPU time.
    self_time = (lambda e: e.self_device_time_total) if device.type == "cuda" else (lambda e: e.self_cpu_time_total)
    lm_head_shape = list(model.lm_head.weight.shape)
    parts = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CPU:  # ops; their kernels' time is in self_time
            parts[event_part(event, lm_head_shape)] += self_time(event) / 1e6
    parts[OUTSIDE_OPS] = max(profiled["wall_seconds"] - sum(parts.values()), 0.0)
    parts["decode: layer matmuls, per layer"] = parts[OP_PARTS["aten::linear"]] / model.config.num_hidden_layers
    return report_header(args, device, dtype, workload) | dict(
        unprofiled=plain, profiled=profiled, parts=dict(sorted(parts.items(), key=lambda item: -item[1]))
    )


def print_profile(report: dict) -> None:
    total = report["profiled"]["wall_seconds"]
    print(
        f"profile of one rollout, model {report['model']} on {report['device']} ({report['dtype']}, "
        f"{report['torch_threads']} threads): {report['questions']} questions x {report['answers_per_question']} answers, "
        f"planted lengths {report['gen_len_range'][0]}-{report['gen_len_range'][1]} ({report['generated_tokens']} tokens); "
        f"{total:.2f} s profiled, {report['unprofiled']['wall_seconds']:.2f} s without the profiler; "
        f"load average {report['load_average']}"
    )
    print("| part | seconds | share |\n|---|---|---|")
    for part, seconds in report["parts"].items():
        share = "-" if part.endswith("per layer") else f"{100 * seconds / total:.1f}%"
        print(f"| {part} | {seconds:.3f} | {share} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b", help=f"{' or '.join(SHAPES)} (random weights) or a model directory")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--answers", type=int, default=8, help="answers per question")
    parser.add_argument("--prompt-len", type=int, default=120, help="mean prompt length (+-10%%)")
    parser.add_argument("--min-gen-len", type=int, default=16, help="planted lengths are uniform in [min, max]")
    parser.add_argument("--max-gen-len", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for torch (0: torch's choice)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds; the table shows medians")
    parser.add_argument("--compile", action="store_true", help="also time the engine with compile_decode (CUDA)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--profile", action="store_true", help="profile our engine instead of comparing engines")
    parser.add_argument("--json-out", type=Path, help="also write the JSON report here")
    args = parser.parse_args(argv)
    if args.temperature <= 0:
        parser.error("--temperature must be > 0: the GRPO:Zero-style engine samples")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = profile(args) if args.profile else measure(args)
    (print_profile if args.profile else print_table)(report)
    emit_json(report, args.json_out)
    return report


if __name__ == "__main__":
    main()
