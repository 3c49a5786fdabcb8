"""How every bench ends: its report printed as JSON, and written to --json-out when given."""

import json
from pathlib import Path


def emit_json(report: dict, json_out: Path | None) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    if json_out:
        Path(json_out).write_text(text + "\n")
