"""Rotary frequencies against transformers' own implementations of each scaling type."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from contbatch.layers.rotary import _inverse_frequencies

SCALINGS = [
    {"rope_type": "linear", "factor": 4.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s["rope_type"])
def test_scaled_frequencies_match_transformers(scaling):
    config = LlamaConfig(hidden_size=512, num_attention_heads=4, rope_scaling=dict(scaling, rope_theta=500000.0))
    expected, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    ours = _inverse_frequencies(128, 500000.0, scaling)
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)


def test_unsupported_scaling_is_refused():
    with pytest.raises(ValueError, match="yarn"):
        _inverse_frequencies(64, 10000.0, {"rope_type": "yarn", "factor": 2.0})
