"""benchmarks/gpu_bundle.sh cuts the demo GGUF file into parts that each fit one transfer to
a GPU machine: the parts, joined in name order, are the file again, and its checksum line
verifies the join the way the script's header tells the GPU machine to."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_parts_join_into_the_demo_gguf_file(smollm_gguf, tmp_path):
    bundle = tmp_path / "bundle"
    env = dict(os.environ, GPU_BUNDLE_NO_WHEELS="1", PYTHON=sys.executable)
    subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_bundle.sh"), str(bundle), "40"],
                   env=env, check=True, capture_output=True, text=True)
    folders = sorted(bundle.glob("p*"))
    assert [f.name for f in folders] == ["p0", "p1", "p2"]  # 98 MB in parts of 40 MiB
    assert all(sorted(f.name for f in folder.iterdir()) == ["gguf.sha256", f"part_0{i}"]
               for i, folder in enumerate(folders)), "one part and the checksum in each folder"
    parts = sorted(bundle.glob("p*/part_*"))
    assert all(part.stat().st_size <= 40 << 20 for part in parts)

    # As the header tells the GPU machine: every folder's files copied to one place, the parts
    # joined in name order, the checksum (which came with the last folder) checked there.
    cache = tmp_path / "cb"
    cache.mkdir()
    for folder in folders:
        for file in folder.iterdir():
            (cache / file.name).write_bytes(file.read_bytes())
    joined = cache / smollm_gguf.name
    joined.write_bytes(b"".join(part.read_bytes() for part in sorted(cache.glob("part_*"))))
    assert hashlib.sha256(joined.read_bytes()).digest() == hashlib.sha256(smollm_gguf.read_bytes()).digest()
    subprocess.run(["sha256sum", "-c", "gguf.sha256"], cwd=cache, check=True, capture_output=True)
    data = joined.read_bytes()
    joined.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # one byte changed: the check fails
    assert subprocess.run(["sha256sum", "-c", "gguf.sha256"], cwd=cache, capture_output=True).returncode
