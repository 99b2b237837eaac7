"""The low-rank update of adapted linear layers, for the rows of a step each adapter covers.

A step's flat batch mixes requests of several adapters and of none. ``StepAdapters`` holds
which rows each adapter covers in the step being run (the model runner sets it before the
forward); each adapted ``Linear`` then adds ``(x[rows] @ A.T) @ B.T`` to those rows of its
output: one pair of small matmuls per adapter present in the step, however many requests use
it. A request's rows are contiguous, so an adapter used by one run of neighbouring requests
(the common case: one adapter for a whole job) is a slice, with no gather.

The update is computed in fp32 and added to the base output before it is rounded to the
model's dtype, as PEFT does (it keeps adapter weights in fp32 and casts the sum back): a bf16
matmul has no AVX2 kernel in PyTorch, and the rank-r matmuls cost little in fp32.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdapterRows:
    """The rows of a step's batch that run with one adapter."""

    adapter_id: int
    rows: slice | torch.Tensor  # a slice for one contiguous run, else row indices (int64)


class StepAdapters:
    """Which rows of the current step run with which adapter; empty when none does."""

    def __init__(self) -> None:
        self.groups: tuple[AdapterRows, ...] = ()

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def set(self, row_adapters: list[tuple[int, int, int]], device: torch.device) -> None:
        """``row_adapters``: (adapter id, first row, end row) of each request with an adapter."""
        runs: dict[int, list[tuple[int, int]]] = {}
        for adapter_id, first, end in row_adapters:
            spans = runs.setdefault(adapter_id, [])
            if spans and spans[-1][1] == first:
                spans[-1] = (spans[-1][0], end)  # the next request of the same adapter: one run
            else:
                spans.append((first, end))
        self.groups = tuple(AdapterRows(adapter_id, _rows(spans, device)) for adapter_id, spans in runs.items())

    def clear(self) -> None:
        self.groups = ()


def _rows(spans: list[tuple[int, int]], device: torch.device) -> slice | torch.Tensor:
    if len(spans) == 1:
        return slice(*spans[0])
    return torch.cat([torch.arange(first, end) for first, end in spans]).to(device)


@dataclass(frozen=True)
class LoRAPair:
    """One adapter's update of one (possibly fused) linear layer, fp32: ``(x @ a_t) @ b_t``.

    A fused layer's (q|k|v, gate|up) adapted parts are stacked: ``a_t`` holds their A columns
    one after another and ``b_t`` places each part's B in its output columns, zero elsewhere.
    Both are stored transposed (PEFT's A and B are [r, in] and [out, r]) so that each matmul
    reads its operands row-major, with no transposed view made per call."""

    a_t: torch.Tensor  # [in_features, rank]
    b_t: torch.Tensor  # [rank, out_features], the adapter's scaling already applied


class LinearLoRA:
    """The adapters of one linear layer, applied to the rows ``step`` assigns them."""

    def __init__(self, step: StepAdapters) -> None:
        self.step = step
        self.pairs: dict[int, LoRAPair] = {}  # adapter id -> its update of this layer

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Add each present adapter's update of its rows of input ``x`` to ``out`` (in place).
        Few ops a call: with few rows each op's dispatch costs more than its arithmetic."""
        for group in self.step.groups:
            pair = self.pairs.get(group.adapter_id)
            if pair is None:  # the adapter leaves this layer alone
                continue
            rows = group.rows
            low_rank = torch.mm(x[rows].float(), pair.a_t)
            if isinstance(rows, slice):
                if out.dtype == torch.float32:
                    out[rows].addmm_(low_rank, pair.b_t)
                else:  # summed in fp32, rounded once to out's dtype: PEFT's result
                    out[rows].add_(torch.mm(low_rank, pair.b_t))
                continue
            update = torch.mm(low_rank, pair.b_t)
            update += out[rows]
            out.index_copy_(0, rows, update.to(out.dtype))
