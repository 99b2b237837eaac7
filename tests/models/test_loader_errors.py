"""A broken model on disk is named, with what is wrong, before any work: a file given for
the directory, a truncated weights file; an all-zero checkpoint loads but warns."""

import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from contbatch import LLM


def test_a_file_given_as_the_model_directory_is_named(tiny_model_dirs):
    weights = tiny_model_dirs["llama"] / "model.safetensors"
    with pytest.raises(ValueError, match=r"model\.safetensors' is a file; pass the model's directory"):
        LLM(weights, skip_tokenizer_init=True)


@pytest.mark.parametrize("keep", [0.5, 0.001])  # cut in the tensor data, cut in the header
def test_truncated_weights_file_is_named_as_incomplete(tiny_model_dirs, tmp_path, keep):
    source = tiny_model_dirs["llama"]
    shutil.copy(source / "config.json", tmp_path / "config.json")
    data = (source / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: max(9, int(len(data) * keep))])
    with pytest.raises(ValueError, match=r"model\.safetensors' is incomplete or not a safetensors file"):
        LLM(tmp_path, skip_tokenizer_init=True)


def test_all_zero_checkpoint_warns(tiny_model_dirs, tmp_path, caplog):
    source = tiny_model_dirs["llama"]
    shutil.copy(source / "config.json", tmp_path / "config.json")
    save_file({k: torch.zeros_like(v) for k, v in load_file(source / "model.safetensors").items()},
              tmp_path / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="contbatch.models.loader"):
        LLM(tmp_path, skip_tokenizer_init=True, dtype="float32")
    assert any("every weight in the checkpoint" in r.getMessage() for r in caplog.records)


def test_real_checkpoint_does_not_warn(tiny_model_dirs, caplog):
    with caplog.at_level(logging.WARNING, logger="contbatch.models.loader"):
        LLM(tiny_model_dirs["llama"], skip_tokenizer_init=True, dtype="float32")
    assert not any("is zero" in r.getMessage() for r in caplog.records)
