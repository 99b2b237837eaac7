"""Times the bf16 linear layers of one SmolLM2-135M step: contbatch's panel kernel against
oneDNN's packed linear (what contbatch used before) and plain ``F.linear``; on CPUs with AMX,
the panels with the AMX kernel switched off too (``vector``); on tiers that widen bf16 to
fp32, the way of widening the CPU does not take by default too (``widened`` or ``direct``);
the same weights in fp32 on oneDNN (``fp32``: what ``dtype="float32"`` runs); with ``--int8``,
the same weights in 8-bit blocks too (``LLM(quantization="int8")``'s layers).

One "step" is the model's 121 projections (fused QKV, O, fused gate-up and down for 30
layers, then the tied LM head), 269 MB of weights in bf16 (151 MB in int8), so they stream
from memory as in a real decode step (a CPU whose L3 holds more than that serves part of
them from L3, as it does in the model; ``--copies N`` runs N copies of the step back to back
so that none can stay there), for 1 to 720 input rows. Reports milliseconds per
step, the weight bytes read per second and the matmul rate. The panel kernel runs on the
active ISA tier (CONTBATCH_CPU_ISA picks one), the int8 one on the tier's int8 kernel
(``--int8-kernel`` picks another); oneDNN's bf16 linear only exists on AVX-512 and
AVX-NE-CONVERT CPUs. ``--update-docs`` rewrites this kind of CPU's section.

    python benchmarks/linear.py [--rows 1,4,...] [--int8 [--int8-kernel avx2]] [--update-docs]
"""

import argparse
import contextlib
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from contbatch import ops
from contbatch.layers.linear import (
    PackedWeight,
    int8_quantized,
    onednn_can_pack,
    onednn_packed,
    packed_linear,
    panel_packed,
)
from contbatch.ops.int8_blocks import QMAX

from _report import replace_marked
from _machine import cpu_description, cpu_kind
from _roofline import copy_bandwidth, fastest

HIDDEN, INTERMEDIATE, QKV, LAYERS, VOCAB = 576, 1536, 960, 30, 49152
ROWS = (1, 2, 4, 8, 16, 32, 64, 256, 720)


def step_shapes() -> list[tuple[int, int]]:
    """(out_features, in_features) of every projection of one SmolLM2-135M forward."""
    layer = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    return layer * LAYERS + [(VOCAB, HIDDEN)]


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def packed_bytes(packed: PackedWeight) -> int:
    data = packed.data
    return tensor_bytes((data.values, data.scales) if packed.layout == "int8" else (data,))


def int8_weight(weight: torch.Tensor, block: int, qmax: int) -> PackedWeight:
    """As LLM(quantization="int8") quantizes it: to |q| <= qmax, but the LM head to 127."""
    return int8_quantized(weight.float(), block, QMAX if weight.shape[0] == VOCAB else qmax)


def packed_step(weights: list[torch.Tensor], pack: Callable[[torch.Tensor], PackedWeight]):
    """The engine's call (``packed_linear``) on the weights packed by ``pack``, and the bytes
    they take."""
    packed = [(w.shape[1], pack(w)) for w in weights]

    def run(inputs: dict[int, torch.Tensor]) -> None:
        for in_features, p in packed:
            packed_linear(inputs[in_features], p, None)

    return run, sum(packed_bytes(p) for _, p in packed)


def without_amx(step):
    """``step`` (a packed_step) with the AMX kernel switched off: the vector kernel alone."""
    run, nbytes = step

    def run_on_the_vector_kernel(inputs: dict[int, torch.Tensor]) -> None:
        with ops.use_amx_matmuls(False):
            run(inputs)

    return run_on_the_vector_kernel, nbytes


def widening_switched(step, on: bool):
    """``step`` (a packed_step) with the widened bf16 kernel switched ``on`` or off (ops.use_widened_panels)."""
    run, nbytes = step

    def run_with_the_other_widening(inputs: dict[int, torch.Tensor]) -> None:
        with ops.use_widened_panels(on):
            run(inputs)

    return run_with_the_other_widening, nbytes


def fp32_step(weights: list[torch.Tensor]):
    """The same weights in fp32 on oneDNN's packed linear (what dtype="float32" runs), fed fp32 rows."""
    run, nbytes = packed_step([w.float() for w in weights], onednn_packed)

    def run_in_fp32(inputs: dict[int, torch.Tensor]) -> None:
        run({k: x.float() for k, x in inputs.items()})

    return run_in_fp32, nbytes


def plain_step(weights: list[torch.Tensor]):
    def run(inputs: dict[int, torch.Tensor]) -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    return run, tensor_bytes(weights)


def markdown(results: dict[str, dict[int, float]], step_bytes: dict[str, int], params: int, copy_gbs: float,
             int8_kernel: str | None, int8_block: int | None, copies: int) -> str:
    names = list(results)
    copies_note = f" ({copies} copies of them, run one after another, times per copy)" if copies > 1 else ""
    narrow = " (all but the LM head narrow: \\|q\\| <= 64)" if int8_kernel in ops.INT8_NARROW_WEIGHT_KERNELS else ""
    int8_note = (f" `int8`: the same weights in 8-bit blocks of {int8_block} inputs{narrow} "
                 f"({step_bytes['int8'] / 1e6:.0f} MB "
                 f"with their scales) on the `{int8_kernel}` int8 kernel." if int8_kernel else "")
    amx_note = (" `panels`: `bf16_linear` as the engine calls it, calls of 5 rows or more on the AMX kernel; "
                "`vector`: the same with AMX switched off." if "vector" in results else "")
    widening_note = {"widened": " `panels` widens each weight in the loop (this CPU's default); `widened`: the "
                                "panel widened to fp32 first (ops.use_widened_panels(True)).",
                     "direct": " `panels` widens a panel to fp32 first for runs of 2 register tiles of rows "
                               "(this CPU's default); `direct`: "
                               "each weight widened in the loop (ops.use_widened_panels(False))."}
    amx_note += next((note for name, note in widening_note.items() if name in results), "")
    if "fp32" in results:
        amx_note += (f" `fp32`: the same weights in fp32 ({step_bytes['fp32'] / 1e6:.0f} MB) on oneDNN, "
                     "what dtype=\"float32\" runs.")
    lines = [
        f"One step = SmolLM2-135M's 121 bf16 projections{copies_note}, {step_bytes[names[0]] / 1e6:.0f} MB of weights."
        f"{int8_note}{amx_note} "
        f"Copy bandwidth {copy_gbs:.1f} GB/s (read + write). torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, CPU: {cpu_description()}. "
        "Times: fastest of 4 steps.",
        "",
    ]
    # (column, faster, slower): how many times faster the first system ran, where both ran.
    pairs = (("panels", "onednn"), ("panels", "vector"), ("panels", "widened"), ("panels", "direct"),
             ("panels", "fp32"), ("int8", "panels"))
    ratios = [(f"{a} vs {b}", a, b) for a, b in pairs if a in results and b in results]
    lines += [
        "| rows | " + " | ".join([f"{n} ms (GB/s, GFLOP/s)" for n in names] + [r[0] for r in ratios]) + " |",
        "| ---: | " + " | ".join("---:" for _ in names + ratios) + " |",
    ]
    for rows in results[names[0]]:
        cells = []
        for name in names:
            seconds = results[name][rows] / copies
            gbs, gflops = step_bytes[name] / seconds / 1e9, 2 * params * rows / seconds / 1e9
            cells.append(f"{seconds * 1e3:.1f} ({gbs:.1f}, {gflops:.0f})")
        cells += [f"{results[slower][rows] / results[faster][rows]:.2f}x" for _, faster, slower in ratios]
        lines.append(f"| {rows} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated input row counts")
    parser.add_argument("--copies", type=int, default=1, help="copies of the step's weights, run one after another")
    parser.add_argument("--int8", action="store_true",
                        help="add the weights in 8-bit blocks (LLM(quantization='int8'))")
    parser.add_argument("--int8-kernel", default="auto",
                        help="the int8 kernel to run (ops.INT8_KERNELS; auto: the tier's)")
    parser.add_argument("--update-docs", action="store_true",
                        help="rewrite this CPU's linear section of docs/performance.md")
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = [torch.randn(n, k).mul_(0.05).to(torch.bfloat16) for n, k in step_shapes() * args.copies]
    steps = {"F.linear": plain_step(weights)}
    if onednn_can_pack(weights[0]):  # oneDNN has bf16 on AVX-512 and AVX-NE-CONVERT CPUs only
        steps = {"onednn": packed_step(weights, onednn_packed), **steps}
    if ops.bf16_linear_available():
        panels = packed_step(weights, panel_packed)
        if ops.amx_bf16_matmuls():  # "panels" takes the AMX kernel from 5 rows: the vector kernel beside it
            steps = {"vector": without_amx(panels), **steps}
        widened = ops.widened_bf16_panels()
        with ops.use_widened_panels(True):
            tier_widens = ops.widened_bf16_panels()  # tiers with bf16 dot products have no widened kernel
        if tier_widens:  # the way of widening bf16 this CPU does not take, beside it
            steps = {"direct" if widened else "widened": widening_switched(panels, not widened), **steps}
        steps = {"panels": panels, **steps}
    if onednn_can_pack(weights[0].float()):
        steps["fp32"] = fp32_step(weights)
    if args.int8:
        with ops.use_int8_kernel(args.int8_kernel):  # the blocks LLM(quantization="int8") takes with that kernel
            block, qmax = ops.int8_weight_block(), ops.int8_weight_qmax()
        steps["int8"] = packed_step(weights, lambda weight: int8_weight(weight, block, qmax))
    copy_gbs = copy_bandwidth()
    results: dict[str, dict[int, float]] = {name: {} for name in steps}
    with ops.use_int8_kernel(args.int8_kernel) if args.int8 else contextlib.nullcontext():
        int8_kernel = ops.int8_kernel_isa() if args.int8 else None
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in (HIDDEN, INTERMEDIATE)}
            for name, (step, _) in steps.items():
                results[name][rows] = fastest(lambda step=step: step(inputs), reps=4)
            print(rows, {name: f"{r[rows] * 1e3:.1f} ms" for name, r in results.items()}, flush=True)
    params = sum(w.numel() for w in weights) // args.copies
    step_bytes = {name: nbytes // args.copies for name, (_, nbytes) in steps.items()}
    table = markdown(results, step_bytes, params, copy_gbs, int8_kernel, block if args.int8 else None, args.copies)
    print(table)
    if args.update_docs:
        command = "python benchmarks/linear.py" + (f" --copies {args.copies}" if args.copies > 1 else "") + (
            " --int8" if args.int8 else "") + (
            f" --int8-kernel {args.int8_kernel}" if args.int8_kernel != "auto" else "") + " --update-docs"
        measured = f"Measured {time.strftime('%Y-%m-%d %H:%M:%S')} with `{command}`."
        replace_marked(f"linear-{cpu_kind()}", f"{measured}\n\n{table}")


if __name__ == "__main__":
    main()
