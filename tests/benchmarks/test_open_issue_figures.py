"""benchmarks/open_issue_figures.sh runs for about 55 minutes on a Zen 3 or Zen 4 machine,
which sessions get by chance: every command in it that writes docs/performance.md must
find its markers there for both CPUs, or the run stops at that command (the long-prompt
table's markers for them were missing until 2026-11-26). Each script's marker key is
written as the script builds it; a command this test does not know fails it."""

import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "open_issue_figures.sh"
DOCS = REPO / "docs" / "performance.md"
TARGET_CPUS = ("zen3", "zen4")


def _commands() -> list[list[str]]:
    text = SCRIPT.read_text()
    block = text[text.index("commands=(") : text.index("\n)", text.index("commands=("))]
    return [shlex.split(line) for line in re.findall(r'^\s+"(.+)"$', block, flags=re.M)]


def _option(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv else default


def _marker_key(argv: list[str], cpu: str) -> str:
    """The key benchmarks/<script> passes to replace_marked for this command on ``cpu``."""
    script = Path(argv[1]).name
    if script == "throughput.py":  # _report.section_key: workload, dtype, CPU
        return f"{_option(argv, '--workload', 'chat256')}-{_option(argv, '--dtype', 'bf16')}-{cpu}"
    if script == "long_prompt.py":
        return f"long-prompt-{_option(argv, '--dtype', 'fp32')}-{cpu}"
    if script == "linear.py":
        return f"linear-{cpu}"
    if script == "kernel_timings.py":
        return f"kernels-{'int8-kv-' if _option(argv, '--kv-cache-dtype', 'auto') == 'int8' else ''}{cpu}"
    raise AssertionError(f"{script} writes the docs, but this test does not know its marker key")


def test_the_script_lists_commands():
    assert len(_commands()) >= 6


@pytest.mark.parametrize("cpu", TARGET_CPUS)
def test_every_docs_update_finds_its_markers(cpu):
    docs = DOCS.read_text()
    missing = []
    for argv in _commands():
        if "--update-docs" not in argv:
            continue
        key = _marker_key(argv, cpu)
        if f"<!-- bench:{key}:begin -->" not in docs or f"<!-- bench:{key}:end -->" not in docs:
            missing.append(f"{shlex.join(argv)}: bench:{key}")
    assert not missing, "docs/performance.md lacks the markers of:\n" + "\n".join(missing)
