"""Smoke runs of the benchmark scripts at tiny sizes, through their command lines."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import matmul_dtype, memory_plan, resume_memory

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_bench(module: str, tmp_path: Path, *args: str) -> tuple[dict, str]:
    """Run `python -m bench.<module>` from the repository root, as the docs say to."""
    json_path = tmp_path / "report.json"
    completed = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args, "--json-out", str(json_path)],
        capture_output=True, text=True, check=True, cwd=REPO_ROOT,
    )
    return json.loads(json_path.read_text()), completed.stdout


TINY_ROLLOUT = ["--model", "tiny", "--device", "cpu", "--questions", "2", "--answers", "3", "--prompt-len", "10",
                "--min-gen-len", "2", "--max-gen-len", "20"]


@pytest.mark.slow
def test_rollout_bench_runs_every_engine_on_the_planted_lengths(tmp_path):
    report, stdout = run_bench("rollout", tmp_path, *TINY_ROLLOUT, "--rounds", "3")
    assert set(report["engines"]) == {"engine", "GRPO:Zero-style", "transformers generate()"}
    assert 2 * 3 * 2 <= report["generated_tokens"] <= 2 * 3 * 20
    for name, result in report["engines"].items():
        assert len(result["rounds"]) == 3
        for clock in ("wall_seconds", "cpu_seconds"):
            assert result[clock] == sorted(r[clock] for r in result["rounds"])[1]  # the median
        assert result["tokens_per_cpu_second"] == pytest.approx(report["generated_tokens"] / result["cpu_seconds"])
        assert f"| {name}" in stdout
    reference = report["engines"]["GRPO:Zero-style"]
    assert reference["cpu_speedup_vs_reference"] == reference["wall_speedup_vs_reference"] == 1.0


@pytest.mark.slow
def test_rollout_profile_splits_the_whole_rollout_into_parts(tmp_path):
    report, stdout = run_bench("rollout", tmp_path, *TINY_ROLLOUT, "--profile")
    parts = report["parts"]
    for part in ("prefill (one forward over the prompts)", "decode: lm_head", "decode: layer matmuls (all layers)",
                 "decode: attention over the cache",
                 "sampling (log-softmax, CDF, search) and the tokens' log-probs and entropies"):
        assert parts[part] > 0, part
    # The parts (less the per-layer figure, a share of the matmuls) add up to the profiled wall time.
    total = sum(seconds for part, seconds in parts.items() if not part.endswith("per layer"))
    assert total == pytest.approx(report["profiled"]["wall_seconds"], rel=0.05)
    assert "| decode: lm_head |" in stdout


@pytest.mark.slow
def test_step_bench_worker_reports_each_step_when_told(tmp_path):
    """Our side of bench/step_vs_trl.py on its own (no TRL needed): one JSON line per 'go'."""
    from bench import step_vs_trl

    args = step_vs_trl.parse_args(["--questions", "2", "--answers", "2", "--max-gen-len", "4", "--micro-batch-size", "2",
                                   "--rounds", "1", "--device", "cpu"])
    step_vs_trl.prepare(tmp_path, args)
    completed = subprocess.run(
        step_vs_trl.worker_command("ours", tmp_path, args), input="go\ngo\n", capture_output=True, text=True,
        check=True, cwd=REPO_ROOT,
    )
    steps = [json.loads(line) for line in completed.stdout.splitlines()]
    assert len(steps) == 2  # the warm-up and one timed step
    for step in steps:
        assert step["total_wall"] == pytest.approx(step["rollout_wall"] + step["update_wall"])
        assert step["rollout_wall"] > 0 and step["update_wall"] > 0 and step["peak_memory_bytes"] > 0
        assert step["gradient_checkpointing"] is False  # off unless --gradient-checkpointing


def test_step_bench_reward_is_countdowns_plus_a_spread_for_random_text():
    """Random weights' answers all score 0 on CountDown; the bench's term must still separate them."""
    from bench import step_vs_trl

    answers = ["7 +", "(1 -", "<answer> 3 </answer>", "think 12", "", "9 9 9", "</think>", "5 / 2"]
    rewards = [step_vs_trl.bench_reward(text, [1, 2], 3) for text in answers]
    assert len(set(rewards)) > 1 and all(0 <= reward < 0.01 for reward in rewards)
    solved = " 1 + 2 = 3 </think>\n<answer> 1 + 2 </answer>"
    assert 1.1 <= step_vs_trl.bench_reward(solved, [1, 2], 3) < 1.11


def test_step_bench_without_trl_says_how_to_get_it():
    blocked = "import sys, runpy; sys.modules['trl'] = None; runpy.run_module('bench.step_vs_trl', run_name='__main__')"
    completed = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, cwd=REPO_ROOT)
    assert completed.returncode == 1
    assert "uv run --group bench python -m bench.step_vs_trl" in completed.stderr


@pytest.mark.slow
def test_step_bench_runs_both_sides(tmp_path, tiny_model_dir):
    """Both sides run the given model with gradient checkpointing as asked, and take their memory baseline after
    set-up. Off is our worker's default (test above); the bench itself refuses a side that differs from the ask."""
    report, stdout = run_bench(
        "step_vs_trl", tmp_path, "--questions", "2", "--answers", "2", "--max-gen-len", "4", "--micro-batch-size", "2",
        "--rounds", "1", "--device", "cpu", "--model", str(tiny_model_dir), "--gradient-checkpointing",
    )
    assert set(report["sides"]) == {"ours", "TRL"} and report["model"] == str(tiny_model_dir.resolve())
    for side in report["sides"].values():
        assert len(side["rounds"]) == 1 and side["total_cpu"] > 0 and side["peak_memory_bytes"] > 0
        assert [step["gradient_checkpointing"] for step in side["rounds"]] == [True]
        assert 0 < side["rounds"][0]["baseline_memory_bytes"] <= side["peak_memory_bytes"]
    assert "gradient checkpointing on" in stdout
    assert "| ours vs TRL (throughput) |" in stdout


def test_step_bench_refuses_a_model_directory_without_config(tmp_path, capsys):
    from bench import step_vs_trl

    with pytest.raises(SystemExit):
        step_vs_trl.parse_args(["--model", str(tmp_path)])
    assert "make_smollm2.sh" in capsys.readouterr().err


@pytest.mark.slow
def test_update_bench_gets_equal_loss_and_gradients(tmp_path):
    report, stdout = run_bench(
        "update", tmp_path, "--model", "tiny", "--device", "cpu", "--seq-len", "24", "--prompt-len", "8",
        "--chunk-sizes", "5",  # 23 predicted positions: 4 chunks of 5 and a remainder of 3
    )
    assert set(report["variants"]) == {"full logits", "chunk 5"}
    full, chunked = report["variants"]["full logits"], report["variants"]["chunk 5"]
    assert chunked["loss"] == pytest.approx(full["loss"], abs=1e-6)
    assert chunked["grad_max_rel_diff"] < 1e-4 and chunked["grad_max_abs"] > 0
    assert chunked["peak_memory_bytes"] > 0
    assert "| chunk 5 |" in stdout


def test_update_bench_times_update_policy_with_one_host_read_per_micro_batch_as_before(tmp_path, monkeypatch):
    from bench import update

    reads = []
    monkeypatch.setattr(update, "read_a_scalar", lambda module, inputs, output: reads.append(output[0].sum().item()))
    args = update.parse_args(["--host-reads", "--model", "tiny", "--device", "cpu", "--seq-len", "12",
                              "--prompt-len", "4", "--batch-size", "4", "--episodes", "16"])
    model = update.Transformer(update.ModelConfig(**update.MODEL_SHAPES["tiny"]))
    episodes = update.grpo_episodes(args, model.config.vocab_size)
    assert update.timed_update(model, episodes, args, read_per_micro_batch=False) > 0 and not reads
    update.timed_update(model, episodes, args, read_per_micro_batch=True)
    assert len(reads) == 16 // 4  # one read per micro-batch, and the hook is gone afterwards
    update.timed_update(model, episodes, args, read_per_micro_batch=False)
    assert len(reads) == 4

    report, stdout = run_bench("update", tmp_path, "--host-reads", "--model", "tiny", "--device", "cpu",
                               "--seq-len", "12", "--prompt-len", "4", "--batch-size", "4", "--episodes", "16",
                               "--rounds", "1")
    assert set(report["variants"]) == set(update.HOST_READ_VARIANTS)
    assert all(variant["tokens_per_second"] > 0 for variant in report["variants"].values())
    assert "| read per micro-batch (before) |" in stdout


def test_memory_plan_matches_hand_arithmetic(capsys):
    report = memory_plan.main([])
    assert "| **peak (device)** |" in capsys.readouterr().out
    big, small = report["config.yaml"], report["config_24GB.yaml"]
    # Qwen2.5-3B by hand: tied embedding + 36 x (attention with biases on q/k/v, SwiGLU MLP, two norms) + final norm.
    hidden, kv_width, intermediate = 2048, 2 * 128, 11008
    per_layer = 2 * hidden * hidden + hidden + 2 * (hidden * kv_width + kv_width) + 3 * hidden * intermediate + 2 * hidden
    num_params = 151936 * hidden + 36 * per_layer + hidden
    assert big["parameters"] == small["parameters"] == num_params
    assert big["components"]["weights"] == small["components"]["weights"] == 2 * num_params
    # Master weights: gradients summed in float32, beside one weight's bf16 gradient in flight (the embedding's);
    # the float32 masters and moments in CPU memory on both cards.
    assert big["components"]["gradients"] == 4 * num_params + 151936 * hidden * 2
    assert big["components"]["adamw_moments"] == small["components"]["adamw_moments"] == 0
    assert big["components"]["master_weights"] == small["components"]["master_weights"] == 0
    assert small["host"] == {"adamw_moments_fp32_in_cpu_ram": 8 * num_params, "master_weights_in_cpu_ram": 4 * num_params}
    # 256 episodes x (256 + 1024 - 1) slots x 36 layers x (k, v) x 2 kv heads x 128 dims x 2 bytes.
    assert big["components"]["kv_cache"] == 256 * 1279 * 36 * 2 * 2 * 128 * 2
    # Three float32 [micro-batch, chunk, vocabulary] tensors: 8 x 256 on the 48 GB card, 2 x 128 on the 24 GB one.
    assert big["components"]["logits_chunk"] == 3 * 8 * 256 * 151936 * 4
    assert small["components"]["logits_chunk"] == 3 * 2 * 128 * 151936 * 4
    for plan in (big, small):
        assert plan["peak"] == max(plan["phases"].values())
    assert small["peak"] < 24e9 < big["peak"] < 48e9
    # LoRA rank 1 on q, k, v, o (in + out each), gate, up (hidden + intermediate) and down: float32, with
    # gradients and moments; the weights frozen (no gradient, no moment) and not offloaded.
    lora = report["config_24GB.yaml+configs/lora.yaml"]
    adapters = 36 * (2 * 2 * hidden + 2 * (hidden + kv_width) + 3 * (hidden + intermediate))
    assert lora["trainable_parameters"] == adapters
    assert lora["components"]["weights"] == 2 * num_params + 4 * adapters
    assert lora["components"]["gradients"] == 4 * adapters and lora["components"]["adamw_moments"] == 8 * adapters
    assert lora["host"]["adamw_moments_fp32_in_cpu_ram"] == 0
    assert lora["peak"] == lora["phases"]["decode"] and lora["headroom"] > 4e9
    # Decoding holds the answers' cache, one step's sampling (bf16 logits, float32 log-probs and CDF) and the
    # token buffers beside the weights: config_24GB.yaml leaves 2 GB of the card beside the CUDA context.
    assert small["components"]["sampling"] == 256 * 151936 * (2 + 4 + 4)
    assert small["components"]["cache_compaction"] == 256 * 1279 * kv_width * 2
    assert small["phases"]["decode"] == sum(small["components"][key] for key in (
        "weights", "kv_cache", "token_buffers", "decode_step", "sampling"))
    assert small["headroom"] == 24e9 - 1e9 - small["peak"] > 2e9


def test_variants_table_gives_mean_min_max_over_seeds(tmp_path):
    from bench import variants_table

    for variant, seed, before, after, answers, seconds in (("dapo", 0, 0.40, 0.50, 300, 100.0),
                                                           ("dapo", 1, 0.38, 0.40, 200, 200.0),
                                                           ("grpo", 0, 0.40, 0.45, 128, 50.0)):
        result = {"before": {"success_t1": before, "success_greedy": before + 0.1},
                  "after": {"success_t1": after, "success_greedy": after + 0.07}, "gain_t1": after - before,
                  "gain_greedy": after - before - 0.03, "stages": {"grpo_seconds": seconds}, "held_out_questions": 48}
        row = {"variant": variant, "seed": seed, "result": result, "answers_sampled": answers, "optimizer_steps": 4}
        (tmp_path / "rows").mkdir(exist_ok=True)
        (tmp_path / "rows" / f"{variant}-s{seed}.json").write_text(json.dumps(row))
    lines = variants_table.table(variants_table.read_rows(tmp_path), ["grpo", "dapo"]).splitlines()
    assert lines[0].startswith("| variant | seeds | SFT T=1 | GRPO T=1 | gain T=1 |")
    # dapo: SFT 40, 38; GRPO 50, 40; gains +10, +2; greedy SFT 50, 48, GRPO 57, 47, gains +7, -1.
    assert lines[2:] == [
        "| grpo | 0 | 40.0 [40.0, 40.0] | 45.0 [45.0, 45.0] | +5.0 [+5.0, +5.0] | 50.0 [50.0, 50.0] | 52.0 [52.0, 52.0] "
        "| +2.0 [+2.0, +2.0] | 128 [128, 128] | 4 [4, 4] | 50 [50, 50] |",
        "| dapo | 0,1 | 39.0 [38.0, 40.0] | 45.0 [40.0, 50.0] | +6.0 [+2.0, +10.0] | 49.0 [48.0, 50.0] "
        "| 52.0 [47.0, 57.0] | +3.0 [-1.0, +7.0] | 250 [200, 300] | 4 [4, 4] | 150 [100, 200] |",
    ]

def test_read_scalars_reads_a_run_without_tensorboards_info_lines(tmp_path, caplog):
    from torch.utils.tensorboard import SummaryWriter

    from bench.plot_curves import read_scalars
    with SummaryWriter(tmp_path) as writer:
        for step, value in ((0, 0.25), (10, 0.5)):
            writer.add_scalar("eval/success_rate", value, step)
    caplog.set_level("INFO")
    assert read_scalars(str(tmp_path)) == {"eval/success_rate": ([0, 10], [0.25, 0.5])}
    assert not [record for record in caplog.records if record.name.startswith("tensorboard")]


def test_real_model_table_shows_the_shortcut_baseline_per_number_count():
    from bench.real_model_cpu import markdown_table
    forms = {"3_numbers/success": 0.30, "3_numbers/best_form": "a + b - c", "3_numbers/best_form_coverage": 0.19,
             "3_numbers/top10_forms_coverage": 0.76, "3_numbers/success_outside_top10": 0.12,
             "3_numbers/policy_form": "a + b - c", "3_numbers/policy_form_share": 0.4, "4_numbers/success": 0.05,
             "4_numbers/policy_form": "none", "4_numbers/policy_form_share": 0.0}
    result = {"seed": 0, "sft_greedy": 0.1, "final_greedy": 0.3, "gain_greedy": 0.2, "sft_t1": 0.05, "final_t1": 0.2,
              "gain_t1": 0.15, "seconds": 1200, "peak_rss_mib": 3000, "held_out_questions": 512,
              "forms_sft_greedy": {**forms, "3_numbers/success": 0.1}, "forms_final_greedy": forms}
    lines = markdown_table([result]).splitlines()
    header = lines[0].split(" | ")
    row = dict(zip(header, lines[2].split(" | ")))
    assert row["3n SFT"] == "10.0" and row["3n final"] == "30.0" and row["3n best form"] == "19.0"
    assert row["3n top-10 forms"] == "76.0" and row["3n outside top-10"] == "12.0" and row["3n own form share"] == "40"
    assert row["4n best form"] == "0.0" and row["4n final"] == "5.0"  # no forms of a count: 0, not a crash
    assert "seed 0: 3n `a + b - c`, 4n `none`" in lines[-1]
    assert row["SFT exact tries"] == "nan"  # a result written before the column existed
    result["exact_tries_sft_greedy"], result["exact_tries_final_greedy"] = 0.48, 0.015
    row = dict(zip(header, markdown_table([result]).splitlines()[2].split(" | ")))
    assert row["SFT exact tries"] == "48" and row["final exact tries"] == "2"
    assert row["SFT unfinished"] == "nan"
    result["unfinished_sft_greedy"], result["unfinished_final_greedy"] = 0.59, 0.424
    row = dict(zip(header, markdown_table([result]).splitlines()[2].split(" | ")))
    assert row["SFT unfinished"] == "59" and row["final unfinished"] == "42"


def test_real_model_unfinished_counts_answers_cut_at_the_length_limit():
    from bench.real_model_cpu import unfinished
    samples = [{"finished": False}, {"finished": True}, {"finished": True}, {"finished": False}, {"finished": False}]
    assert unfinished(samples) == pytest.approx(3 / 5)


def test_real_model_exact_tries_replays_the_answers():
    from bench.real_model_cpu import exact_tries
    samples = [{"nums": [97, 27, 29], "response": " 97 + 27 = 124, 124 - 29 = 95 (not 99); 97 + 27 = 99 </think>"},
               {"nums": [97, 27, 29], "response": " no steps </think>"}]
    assert exact_tries(samples) == pytest.approx((1 / 2 + 0) / 2)


def test_real_model_reuse_runs_only_new_variants_of_the_earlier_run(tmp_path, monkeypatch, capsys):
    """--reuse takes the seeds' data and SFT models of an earlier run: refused where they are not there, or with
    nothing new to run, before any stage starts."""
    from bench import real_model_cpu
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"variants": {"recipe": []}, "date": "2026-12-05 13:45 UTC",
                                   "seeds": [{"seed": 0, "variant": "recipe", "stages": {}}]}))
    monkeypatch.setattr(real_model_cpu, "run_stage", lambda *args: pytest.fail("a stage ran"))

    def refusal(*arguments: str) -> str:
        monkeypatch.setattr(sys, "argv", ["real_model_cpu.py", "--model", "m", "--work", str(tmp_path), *arguments])
        with pytest.raises(SystemExit):
            real_model_cpu.main()
        return capsys.readouterr().err

    assert "seed 0 has no recipe row there or no SFT model" in refusal("--seeds", "1", "--reuse", str(earlier),
                                                                       "--variant", "lora=model.lora.rank=1")
    (tmp_path / "seed0" / "sft-model").mkdir(parents=True)
    assert "seed 1 has no recipe row" in refusal("--seeds", "2", "--reuse", str(earlier), "--variant", "l=a.b=1")
    assert "name at least one new LABEL" in refusal("--seeds", "1", "--reuse", str(earlier))
    assert "expected a new LABEL" in refusal("--seeds", "1", "--reuse", str(earlier), "--variant", "recipe=a.b=1")
    assert "--config nowhere.yaml: no such file" in refusal("--seeds", "1", "--config", "nowhere.yaml")
    # An earlier run without a "config" key ran the recipe's config; its SFT models do not fit another one.
    assert "ran --config configs/smollm2_cpu.yaml: pass the same --config" in refusal(
        "--seeds", "1", "--reuse", str(earlier), "--config", "configs/cpu_demo.yaml", "--variant", "l=a.b=1")


def test_a_resume_maps_the_trainer_state_instead_of_holding_a_second_copy(capsys):
    """The offloaded AdamW's moments, resumed: read whole, the host holds them twice; mapped, once."""
    report = resume_memory.main(["--megabytes", "64", "--rounds", "1"])
    [round_] = report["rounds"]
    assert round_["mapped"]["after_read_mb"] < 0.25 * 64 < 0.75 * 64 < round_["read"]["after_read_mb"]
    assert round_["mapped"]["after_optimizer_mb"] < 1.5 * 64 < round_["read"]["after_optimizer_mb"]


def test_the_matmul_bench_reports_both_dtypes_at_every_shape(capsys):
    report = matmul_dtype.main(["--rows", "4", "--rounds", "1", "--threads", "1"])
    # the machine, read apart from report.machine: the flags /proc/cpuinfo lists, the kernels torch picked
    cpuinfo = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    assert report["machine"]["cpu_flags"] == sorted({flag for flag in cpuinfo if flag in ("avx2", "avx512f",
                                                                                          "avx512_bf16", "amx_bf16")})
    assert report["machine"]["torch_cpu_capability"] in ("DEFAULT", "AVX2", "AVX512", "AVX512_BF16", "AMX", "ZVECTOR",
                                                          "VSX", "SVE256", "SVE")
    assert set(report["gflops"]) == set(matmul_dtype.SHAPES)
    assert all(set(by_dtype) == {"float32", "bfloat16"} and by_dtype["float32"]["median"] > 0
               for by_dtype in report["gflops"].values())


@pytest.mark.slow
def test_gpu_check_dry_run_prints_every_check(tmp_path, tiny_model_dir):
    """bench/gpu_check.py at toy sizes on the CPU (what DRY_RUN=1 bash bench/gpu.sh runs): every check answers,
    none fails, and the tiny model stands in for SmolLM2 in the GRPO steps."""
    from bench import gpu_check

    report = gpu_check.main(["--dry-run", "--smollm2", str(tiny_model_dir), "--out", str(tmp_path)])
    checks = report["checks"]
    assert not [name for name, values in checks.items() if "failed" in values], checks
    assert checks["bf16 parity"]["top1_agreement_vs_transformers"] > 0.9
    backends = checks["attention backend"]
    assert all(kernels != ["none recorded"] for kernels in backends.values()), backends
    assert checks["decode"]["tokens_per_second"] > 0
    assert checks["GRPO (SmolLM2, bf16, config_24GB optimizer)"]["steps"] == 2
    assert checks["GRPO (SmolLM2, bf16, config_24GB optimizer)"]["losses_finite"]
    assert (tmp_path / "gpu_check.md").read_text().startswith("| check | result |")
