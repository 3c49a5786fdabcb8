"""How every bench ends: its report printed as JSON, and written to --json-out when given; and the machine a
number was taken on, which every report records."""

import json
import os
import platform
from pathlib import Path

# What decides which matmul kernels torch runs on a CPU: the same seed gives other numbers where these differ.
MATMUL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def emit_json(report: dict, json_out: Path | None) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    if json_out:
        Path(json_out).write_text(text + "\n")


def machine() -> dict:
    """The CPU a bench ran on: its model name, cores, the matmul-relevant instruction sets and the kernel family
    torch picked (torch.backends.cpu.get_cpu_capability)."""
    import torch  # here, not at the top: the benches that time pure Python need not load it

    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    names = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")]
    return {"cpu": names[0] if names else platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "cpu_flags": sorted(set(text.split()) & set(MATMUL_FLAGS)),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}
