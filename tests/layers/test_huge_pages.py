"""Packed weights moved onto huge pages keep their values, land in one aligned buffer in the
order given, and are what the model (Python modules and the C++ decoder stack) reads."""

import re
import sys
from pathlib import Path

import pytest
import torch

from contbatch import LLM, SamplingParams
from contbatch.layers import huge_pages
from contbatch.layers.huge_pages import HUGE_PAGE_BYTES, move_to_huge_pages, packed_tensors

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="transparent huge pages are Linux's")


def _thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    found = re.search(r"\[(\w+)\]", path.read_text()) if path.exists() else None
    return found.group(1) if found else "never"


def _huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address``."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def _tensors() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [
        torch.randn(3, 5),  # smaller than a cache line's padding
        torch.randint(-127, 128, (1500, 1024), dtype=torch.int8),  # 1.5 MB
        torch.randn(2048, 1024).bfloat16(),  # 4 MB
        torch.randn(7).half(),
    ]


def test_moved_tensors_keep_values_and_sit_in_order_in_one_aligned_buffer(monkeypatch):
    monkeypatch.setenv("CONTBATCH_HUGE_PAGES", "1")
    tensors = _tensors()
    expected = [t.clone() for t in tensors]
    holders = [t for t in tensors]  # other references to the same tensors, as modules hold them
    moved = move_to_huge_pages(tensors)
    assert moved == sum(-(-t.numel() * t.element_size() // 64) * 64 for t in tensors)
    for tensor, holder, original in zip(tensors, holders, expected):
        assert holder.data_ptr() == tensor.data_ptr()
        assert torch.equal(tensor, original)
    starts = [t.data_ptr() for t in tensors]
    assert starts[0] % HUGE_PAGE_BYTES == 0
    assert starts == sorted(starts) and starts[-1] - starts[0] < moved
    assert all(start % 64 == 0 for start in starts)


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off on this machine")
def test_moved_weights_are_backed_by_huge_pages(monkeypatch):
    monkeypatch.setenv("CONTBATCH_HUGE_PAGES", "1")
    big = torch.randn(6 << 20 >> 2)  # 6 MiB
    assert move_to_huge_pages([big]) > 0
    assert _huge_kib_at(big.data_ptr()) >= HUGE_PAGE_BYTES >> 10


def test_switched_off_leaves_tensors_where_they_are(monkeypatch):
    monkeypatch.setenv("CONTBATCH_HUGE_PAGES", "0")
    tensors = _tensors()
    before = [t.data_ptr() for t in tensors]
    assert move_to_huge_pages(tensors) == 0
    assert [t.data_ptr() for t in tensors] == before


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_the_model_reads_the_moved_weights(tiny_model_dirs, quantization, monkeypatch):
    """Moving changes no output, and the model reads the new copies: zeroing them (and
    nothing else) changes its tokens."""
    monkeypatch.setenv("CONTBATCH_HUGE_PAGES", "0")
    llm = LLM(tiny_model_dirs["llama"], dtype="bfloat16", device="cpu", quantization=quantization, max_model_len=64,
              max_num_seqs=2, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 13, 2]}, {"prompt_token_ids": [7]}]
    tokens = lambda: [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    before = tokens()
    model = llm.engine.runner.model
    tensors = packed_tensors(model)
    monkeypatch.setattr(huge_pages, "enabled", lambda: True)
    assert move_to_huge_pages(tensors) > 0
    assert tokens() == before
    with torch.inference_mode():
        for tensor in tensors:
            tensor.zero_()
    assert tokens() != before
