"""Rows of docs/results/gpu.json, written by the GPU scripts themselves (never typed by hand).

Schema (the GPU-speed work's): a list of {"name", "value", "target", "unit", "date", "commit", "device"}; a run
replaces the rows it measured (by name) and keeps the others.
"""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH = ROOT / "docs" / "results" / "gpu.json"


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def result_row(name: str, value, target, unit: str, device: str) -> dict:
    return {
        "name": name,
        "value": value,
        "target": target,
        "unit": unit,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "device": device,
    }


def merge(rows: list[dict], path: Path = PATH) -> None:
    """Write `rows` into `path`, replacing earlier rows of the same names."""
    old = json.loads(path.read_text()) if path.exists() else []
    names = {r["name"] for r in rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([r for r in old if r["name"] not in names] + rows, indent=1) + "\n")
    print(f"wrote {len(rows)} rows into {path}")
