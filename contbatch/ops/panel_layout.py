"""The weight layout of the ``bf16_linear`` op: panels of 64 output columns.

``packed[panel, pair, column, :]`` holds ``weight[64 * panel + column, 2 * pair : 2 * pair + 2]``,
zero-padded to whole panels and an even number of inputs. One ``[pair]`` row (64 columns
x 2 inputs, 256 bytes) is what AVX512_BF16's ``vdpbf16ps`` multiplies against one
broadcast pair of inputs, so each panel is read from memory once, in address order.
"""

import torch
import torch.nn.functional as F

PANEL_COLUMNS = 64


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out_features, in_features] -> [panels, pairs, 64, 2], same dtype."""
    out_features, in_features = weight.shape
    panels, pairs = -(-out_features // PANEL_COLUMNS), -(-in_features // 2)
    padded = F.pad(weight.detach(), (0, 2 * pairs - in_features, 0, panels * PANEL_COLUMNS - out_features))
    return padded.view(panels, PANEL_COLUMNS, pairs, 2).permute(0, 2, 1, 3).contiguous()


def unpack_panels(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_panels`."""
    panels, pairs = packed.shape[:2]
    plain = packed.permute(0, 2, 1, 3).reshape(panels * PANEL_COLUMNS, 2 * pairs)
    return plain[:out_features, :in_features]
