"""What one few-row linear call costs besides its weight bytes: bf16 panels against int8 blocks.

A decode step with few requests running makes 121 projection calls (SmolLM2), each reading its
weights once. This script times single calls at ``--rows`` input rows for one ``--in-features``
and a range of output widths, with the weights read from memory (enough distinct copies that
none stays in L3, run one after another) and from cache (one copy called again and again), and
fits, per layout and place, time = a fixed cost per call + bytes / a streaming rate. The fixed
cost (thread start, the first lines of each thread's share waiting on memory, the op call) is
paid 121 times a step whatever the layout; the streaming rate is what the kernel's loop gets.
Rounds alternate the layouts and widths in one process, so a shared machine's drift falls on
all of them; the best round of each is fitted.

    python benchmarks/linear_calls.py                  # 1 row, 576 inputs, both layouts
    python benchmarks/linear_calls.py --rows 8 --threads 1
"""

import argparse
import time

import numpy as np
import torch

from contbatch import ops
from contbatch.layers import huge_pages
from contbatch.layers.linear import PackedWeight, packed_linear, panel_packed

from _machine import cpu_description
from linear import int8_weight, packed_bytes
from _roofline import copy_bandwidth

WIDTHS = (64, 128, 256, 512, 1024, 2048)
MEMORY_BYTES = 400e6  # bf16 weight bytes per width, far beyond an L3
CACHED_CALLS = 2000


def layouts(weight: torch.Tensor, block: int, qmax: int) -> dict[str, PackedWeight]:
    """The weight as the bf16 panels and as LLM(quantization="int8") keeps a projection."""
    return {"bf16 panels": panel_packed(weight.bfloat16()), "int8": int8_weight(weight, block, qmax)}


def call_seconds(x: torch.Tensor, weights: list[PackedWeight]) -> float:
    start = time.perf_counter()
    for packed in weights:
        packed_linear(x, packed, None)
    return (time.perf_counter() - start) / len(weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--in-features", type=int, default=576, help="SmolLM2's hidden size by default")
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--huge-pages", action="store_true",
                        help="each layout's copies on 2 MiB pages, one after another in call order, as the engine "
                        "keeps them")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    block, qmax = ops.int8_weight_block(), ops.int8_weight_qmax()
    copies: dict[int, dict[str, list[PackedWeight]]] = {}
    for width in WIDTHS:
        count = max(1, int(MEMORY_BYTES / (width * args.in_features * 2)))
        packed = [layouts(torch.randn(width, args.in_features) * 0.02, block, qmax) for _ in range(count)]
        copies[width] = {name: [p[name] for p in packed] for name in packed[0]}
        if args.huge_pages:
            for weights in copies[width].values():
                huge_pages.move_to_huge_pages([t for p in weights for t in huge_pages.weight_tensors(p)])
    x = torch.randn(args.rows, args.in_features).bfloat16()
    best: dict[tuple[str, str, int], float] = {}
    for _ in range(args.rounds):
        for width, by_layout in copies.items():
            for name, weights in by_layout.items():
                for place, calls in (("memory", weights), ("cache", weights[:1] * CACHED_CALLS)):
                    key = (name, place, width)
                    best[key] = min(best.get(key, float("inf")), call_seconds(x, calls))
    print(f"# {cpu_description()}, int8 kernel {ops.int8_kernel_isa()} (blocks of {block}), "
          f"{torch.get_num_threads()} threads, weights on {'2 MiB' if args.huge_pages else '4 KiB'} pages, "
          f"{args.rows} row(s) x {args.in_features} inputs, best of {args.rounds} "
          f"alternated rounds; a 512 MiB copy: {copy_bandwidth():.1f} GB/s (read + written)")
    print("| layout | weights from | us a call at " + " / ".join(map(str, WIDTHS)) + " outputs | fixed cost a call "
          "| streaming rate |")
    print("| --- | --- | --- | ---: | ---: |")
    for name in copies[WIDTHS[0]]:
        nbytes = np.array([packed_bytes(copies[w][name][0]) for w in WIDTHS], dtype=float)
        for place in ("memory", "cache"):
            seconds = np.array([best[name, place, w] for w in WIDTHS])
            slope, fixed = np.polyfit(nbytes, seconds, 1)
            times = " / ".join(f"{s * 1e6:.1f}" for s in seconds)
            print(f"| {name} | {place} | {times} | {fixed * 1e6:.2f} us | {1e-9 / slope:.1f} GB/s |")


if __name__ == "__main__":
    main()
