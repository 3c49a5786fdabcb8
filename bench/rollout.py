"""Rollout throughput: our engine vs transformers' generate() vs the simple reference path, same weights.

Random weights practically never emit eos, so every completion stops at a planted length drawn once
(seeded) from a spread like real answers, identically for every engine: all of them generate exactly
the same tokens count, and tokens/s compares like with like.

    uv run bench/rollout.py --model qwen2.5-0.5b          # random weights, real Qwen2.5-0.5B shape
    uv run bench/rollout.py --model path/to/Qwen2.5-3B-Instruct --device cuda --compile
"""

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from generation import generate  # noqa: E402
from qwen2_model import ModelConfig, Transformer, init_weights  # noqa: E402

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


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    num_answers_per_question: int
    stop_lengths: list[int]  # one per completion, prompt-major

    @property
    def generated_tokens(self) -> int:
        return sum(self.stop_lengths)


def build_workload(args, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    # Prompt lengths vary around the mean as rendered chat prompts do, so padding is exercised.
    spread = max(args.prompt_len // 10, 1)
    prompts = [
        [rng.randrange(vocab_size) for _ in range(rng.randint(args.prompt_len - spread, args.prompt_len + spread))]
        for _ in range(args.questions)
    ]
    stop_lengths = [rng.randint(args.min_gen_len, args.max_gen_len) for _ in range(args.questions * args.answers)]
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
        model, workload.prompts, workload.num_answers_per_question, max(workload.stop_lengths), NEVER_SAMPLED_EOS,
        temperature=args.temperature, top_p=args.top_p, generator=generator, stop_lengths=workload.stop_lengths,
        **flags,
    )
    assert [len(c.token_ids) for c in completions] == workload.stop_lengths


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
        stopping_criteria=StoppingCriteriaList([PlantedLengths()]), pad_token_id=0, eos_token_id=None,
    )
    assert output.shape[1] - width == max(workload.stop_lengths)


def timed(device: torch.device, run) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def engines(model: Transformer, model_dir: Path, args) -> dict:
    """name -> callable(workload); transformers reads the same weights back from model_dir."""
    runs = {
        "engine": lambda workload: run_engine(model, workload, args),
        "reference path": lambda workload: run_engine(
            model, workload, args, share_prompt_prefill=False, evict_finished=False
        ),
    }
    if args.compile:
        runs["engine, compiled decode"] = lambda workload: run_engine(model, workload, args, compile_decode=True)
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        dtype = model.embed_tokens.weight.dtype
        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(model.embed_tokens.weight.device)
        runs["transformers generate()"] = lambda workload: run_transformers(hf_model.eval(), workload, args)
    return runs


def measure(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(args.model, device, dtype)
    workload = build_workload(args, model.config.vocab_size)
    # A warm-up with the same shapes (so compiled graphs are captured) but only a few tokens per row.
    warmup = dataclasses.replace(workload, stop_lengths=[min(4, length) for length in workload.stop_lengths])
    results = {}
    with tempfile.TemporaryDirectory() as temp_dir:
        model_dir = Path(args.model) if args.model not in SHAPES else Path(temp_dir)
        if args.model in SHAPES and not args.skip_transformers:
            model.save_pretrained(model_dir)
        for name, run in engines(model, model_dir, args).items():
            if args.warmup or (args.warmup is None and device.type == "cuda"):
                run(warmup)
            seconds = timed(device, lambda: run(workload))
            results[name] = dict(seconds=seconds, tokens_per_second=workload.generated_tokens / seconds)
            print(f"  {name}: {seconds:.1f} s", file=sys.stderr)
    for name, result in results.items():
        for baseline in ("reference path", "transformers generate()"):
            if baseline in results:
                result[f"speedup_vs_{baseline.split()[0]}"] = result["tokens_per_second"] / results[baseline]["tokens_per_second"]
    return dict(
        model=args.model, device=str(device), dtype=str(dtype).removeprefix("torch."),
        torch_threads=torch.get_num_threads(), questions=args.questions, answers_per_question=args.answers,
        prompt_lengths=[len(p) for p in workload.prompts], gen_len_range=[args.min_gen_len, args.max_gen_len],
        generated_tokens=workload.generated_tokens, max_stop_length=max(workload.stop_lengths),
        temperature=args.temperature, top_p=args.top_p, engines=results,
    )


def print_table(report: dict) -> None:
    print(
        f"model {report['model']} on {report['device']} ({report['dtype']}, {report['torch_threads']} threads): "
        f"{report['questions']} questions x {report['answers_per_question']} answers, prompts "
        f"{min(report['prompt_lengths'])}-{max(report['prompt_lengths'])} tokens, planted lengths "
        f"{report['gen_len_range'][0]}-{report['gen_len_range'][1]} ({report['generated_tokens']} tokens)"
    )
    print(f"| {'engine':<26} | {'seconds':>8} | {'tokens/s':>9} | {'vs reference':>12} | {'vs transformers':>15} |")
    print(f"|{'-' * 28}|{'-' * 10}|{'-' * 11}|{'-' * 14}|{'-' * 17}|")
    for name, result in report["engines"].items():
        versus = [f"{result[key]:.2f}x" if key in result else "-" for key in ("speedup_vs_reference", "speedup_vs_transformers")]
        print(f"| {name:<26} | {result['seconds']:>8.2f} | {result['tokens_per_second']:>9.1f} | {versus[0]:>12} | {versus[1]:>15} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b", help=f"{' or '.join(SHAPES)} (random weights) or a model directory")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--answers", type=int, default=8, help="answers per question")
    parser.add_argument("--prompt-len", type=int, default=120, help="mean prompt length (+-10%%)")
    # Short by GRPO standards so the 0.5B-shaped CPU run takes minutes; gpu.sh plants 32-512.
    parser.add_argument("--min-gen-len", type=int, default=8, help="planted lengths are uniform in [min, max]")
    parser.add_argument("--max-gen-len", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--compile", action="store_true", help="also time the engine with compile_decode (CUDA)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None, help="default: on CUDA only")
    parser.add_argument("--json-out", type=Path, help="also write the JSON report here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = measure(args)
    print_table(report)
    print(json.dumps(report, indent=2))
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
