"""Times the bf16 linear layers of one SmolLM2-135M step: contbatch's panel kernel against
oneDNN's packed linear (what contbatch used before) and plain ``F.linear``.

One "step" is the model's 121 projections (fused QKV, O, fused gate-up and down for 30
layers, then the tied LM head), 269 MB of weights, so they stream from DRAM as in a real
decode step, for 1 to 720 input rows. Reports milliseconds per step, the weight bytes read
per second and the matmul rate. The panel kernel runs on the active ISA tier
(CONTBATCH_CPU_ISA picks one); oneDNN's bf16 linear only exists on AVX-512 and
AVX-NE-CONVERT CPUs.

    python benchmarks/linear.py [--rows 1,4,...] [--update-docs]
"""

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from contbatch import ops
from contbatch.layers.linear import PackedWeight, onednn_can_pack, onednn_packed, packed_linear, panel_packed

from _report import replace_marked
from _machine import cpu_description
from _roofline import copy_bandwidth, fastest

HIDDEN, INTERMEDIATE, QKV, LAYERS, VOCAB = 576, 1536, 960, 30, 49152
ROWS = (1, 2, 4, 8, 16, 32, 64, 256, 720)


def step_shapes() -> list[tuple[int, int]]:
    """(out_features, in_features) of every projection of one SmolLM2-135M forward."""
    layer = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    return layer * LAYERS + [(VOCAB, HIDDEN)]


def packed_step(weights: list[torch.Tensor], pack: Callable[[torch.Tensor], PackedWeight]):
    """The engine's call (``packed_linear``) on the weights packed by ``pack``."""
    packed = [(w.shape[1], pack(w)) for w in weights]

    def run(inputs: dict[int, torch.Tensor]) -> None:
        for in_features, p in packed:
            packed_linear(inputs[in_features], p, None)

    return run


def plain_step(weights: list[torch.Tensor]):
    def run(inputs: dict[int, torch.Tensor]) -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    return run


def markdown(results: dict[str, dict[int, float]], weight_bytes: int, copy_gbs: float) -> str:
    names = list(results)
    lines = [
        f"One step = SmolLM2-135M's 121 bf16 projections, {weight_bytes / 1e6:.0f} MB of weights. "
        f"Copy bandwidth {copy_gbs:.1f} GB/s (read + write). torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, CPU: {cpu_description()}. "
        "Times: fastest of 4 steps.",
        "",
        "| rows | " + " | ".join(f"{n} ms (GB/s, GFLOP/s)" for n in names) + " | panels vs oneDNN |",
        "| ---: | " + " | ".join("---:" for _ in names) + " | ---: |",
    ]
    for rows in results[names[0]]:
        cells = []
        for name in names:
            seconds = results[name][rows]
            # bf16: 2 bytes and, per input row, 2 FLOPs per weight, so FLOPs = bytes x rows.
            gbs, gflops = weight_bytes / seconds / 1e9, weight_bytes * rows / seconds / 1e9
            cells.append(f"{seconds * 1e3:.1f} ({gbs:.1f}, {gflops:.0f})")
        both = "panels" in results and "onednn" in results
        ratio = results["onednn"][rows] / results["panels"][rows] if both else float("nan")
        lines.append(f"| {rows} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated input row counts")
    parser.add_argument("--update-docs", action="store_true", help="rewrite the linear section of docs/performance.md")
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = [torch.randn(n, k).mul_(0.05).to(torch.bfloat16) for n, k in step_shapes()]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    steps = {"F.linear": plain_step(weights)}
    if onednn_can_pack(weights[0]):  # oneDNN has bf16 on AVX-512 and AVX-NE-CONVERT CPUs only
        steps = {"onednn": packed_step(weights, onednn_packed), **steps}
    if ops.bf16_linear_available():
        steps = {"panels": packed_step(weights, panel_packed), **steps}
    copy_gbs = copy_bandwidth()
    results: dict[str, dict[int, float]] = {name: {} for name in steps}
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in (HIDDEN, INTERMEDIATE)}
        for name, step in steps.items():
            results[name][rows] = fastest(lambda step=step: step(inputs), reps=4)
        print(rows, {name: f"{r[rows] * 1e3:.1f} ms" for name, r in results.items()}, flush=True)
    table = markdown(results, weight_bytes, copy_gbs)
    print(table)
    if args.update_docs:
        replace_marked("linear", f"Measured {time.strftime('%Y-%m-%d %H:%M:%S')} with "
                       f"`python benchmarks/linear.py --update-docs`.\n\n{table}")


if __name__ == "__main__":
    main()
