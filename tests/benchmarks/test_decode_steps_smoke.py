"""benchmarks/decode_steps.py end to end on the demo model, a few tokens: it loads all four
configurations and prints one table row per request count, each with the engine's decode-step
times and the whole calls' times per token. No timing is asserted."""

import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_decode_steps_prints_a_row_per_running_count(smollm_dir):
    command = [sys.executable, str(BENCHMARKS / "decode_steps.py"), "--running", "1,2", "--tokens", "4",
               "--rounds", "1", "--dtype", "float32"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "2"]
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert all(float(ms) > 0 for ms in cells[1:5] + cells[6:10]), row
        assert cells[5].count("x (") == 2 and cells[10].count("x (") == 2, row
