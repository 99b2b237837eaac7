"""The settings fingerprint stored beside a job's results, so a resume cannot mix settings.

``<output>.meta.json`` holds the settings that decide what a record contains: the
model (a hash of its config and tokenizer files and of the size, head and tail of
each weight file), dtype, max_model_len, the default SamplingParams and how prompts
are read. Engine knobs that do not change results (batch sizes, KV cache size) and
the input path are not part of it.
"""

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

from contbatch.config import Quantization
from contbatch.jobs.output import fsync_directory
from contbatch.sampling_params import SamplingParams

META_FORMAT = "contbatch-job-meta/1"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SMALL_SUFFIXES = (".json", ".jinja", ".model", ".txt", ".tiktoken")
_SAMPLE_BYTES = 1 << 20
_ABSENT = object()


class SettingsMismatch(ValueError):
    """The existing results were made with other settings (or have no settings file)."""


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over the files that decide a model's outputs (a GGUF file is all of them),
    without reading whole weight files."""
    digest = hashlib.sha256()
    for path in [model_dir] if model_dir.is_file() else sorted(model_dir.iterdir()):
        relevant = path.name.endswith(_WEIGHT_SUFFIXES + _SMALL_SUFFIXES) and not path.name.startswith(".")
        if not (relevant and path.is_file()):
            continue
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as source:
            if path.name.endswith(_WEIGHT_SUFFIXES) and size > 2 * _SAMPLE_BYTES:
                digest.update(source.read(_SAMPLE_BYTES))
                source.seek(-_SAMPLE_BYTES, os.SEEK_END)
            digest.update(source.read())
    return digest.hexdigest()


def job_settings(
    model_fp: str,
    dtype: str,
    max_model_len: int | None,
    params: SamplingParams,
    prompt: dict,
    quantization: Quantization | None = None,
    kv_cache_dtype: str = "auto",
    lora_fp: str | None = None,
) -> dict:
    """Flat {"section.key": JSON value} settings that must match between runs of one job.
    ``quantization`` (as "int8 in 64-input blocks, LM head int8, embeddings dense") and ``kv_cache_dtype`` are
    recorded only when set, so that jobs written before they existed still resume; so is ``lora_fp``,
    the fingerprint of the LoRA adapter directory every record runs with."""
    settings = {"model.fingerprint": model_fp, "engine.dtype": dtype, "engine.max_model_len": max_model_len}
    if quantization is not None:
        settings["engine.quantization"] = quantization.describe()
    if kv_cache_dtype != "auto":
        settings["engine.kv_cache_dtype"] = kv_cache_dtype
    if lora_fp is not None:
        settings["engine.lora_adapter"] = lora_fp
    settings.update(input_settings(params, prompt))
    return settings


def input_settings(params: SamplingParams, prompt: dict) -> dict:
    """The settings known before the model loads: the default SamplingParams and how prompts are read."""
    settings = {f"sampling.{k}": v for k, v in _jsonable(dataclasses.asdict(params)).items()}
    settings.update({f"prompt.{k}": v for k, v in prompt.items()})
    return settings


def require_settings_file(meta_path: Path, has_records: bool, force: bool) -> None:
    """SettingsMismatch if the output has results but no settings file to check a resume against, unless ``force``."""
    if has_records and not force and not meta_path.exists():
        raise SettingsMismatch(
            f"the output already has results but no settings file {meta_path.name}, so a resume cannot be "
            "checked; pass --force (force=True) to add to it anyway, or choose another output"
        )


def check_settings(meta_path: Path, settings: dict, has_records: bool, force: bool, partial: bool = False) -> bool:
    """Whether the meta file must be (re)written; raises SettingsMismatch unless ``force``.
    ``partial``: ``settings`` are only some of them (input_settings); only those are compared."""
    if not meta_path.exists():
        return True
    stored = json.loads(meta_path.read_text(encoding="utf-8"))
    differences = list(_differences(stored.get("settings", {}), settings, partial))
    if not differences:
        return False
    if not has_records:
        return True
    if not force:
        raise SettingsMismatch(
            f"the existing results were made with other settings ({meta_path.name}):\n  "
            + "\n  ".join(differences)
            + "\nrerun with the same settings to resume, pass --force (force=True) to continue with the new "
            "settings anyway (the file then mixes both), or choose another output"
        )
    return True


def write_meta(meta_path: Path, settings: dict, model_path: Path) -> None:
    """Atomically replace the meta file (temp file, fsync, rename, fsync the directory)."""
    meta = {
        "format": META_FORMAT,
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model_path": str(model_path.resolve()),
        "settings": settings,
    }
    temporary = meta_path.with_name(meta_path.name + ".tmp")
    with open(temporary, "w", encoding="utf-8") as out:
        json.dump(meta, out, indent=1, sort_keys=True)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, meta_path)
    fsync_directory(meta_path.parent)


def _differences(stored: dict, current: dict, partial: bool):
    # A SamplingParams field added since the results were written counts as its default.
    defaults = {f"sampling.{k}": v for k, v in _jsonable(dataclasses.asdict(SamplingParams())).items()}
    for key in sorted(current.keys() if partial else stored.keys() | current.keys()):
        old = stored.get(key, defaults.get(key, _ABSENT))
        new = current.get(key, defaults.get(key, _ABSENT))
        if old != new:
            yield f"{key}: {_show(old)} in the existing results, {_show(new)} now"


def _show(value: object) -> str:
    return "(absent)" if value is _ABSENT else json.dumps(value)


def _jsonable(value: dict) -> dict:
    return json.loads(json.dumps(value, default=repr))
