"""The ``contbatch`` command line (``python -m contbatch`` too).

``contbatch generate``: a bulk job from a JSONL, text, Parquet or CSV file to a JSONL or
Parquet results file; see ``contbatch generate --help`` and docs/bulk_jobs.md.
``contbatch eval``: lm-eval's command line with contbatch as the model
(contbatch/integrations/lm_eval.py).
"""

import argparse
import dataclasses
import functools
import json
import logging
import os
import re
import signal
import sys
import types
import typing

from contbatch.config import KV_CACHE_DTYPES, MODEL_IMPLS, QUANTIZATIONS
from contbatch.jobs import run_job
from contbatch.lora.by_path import adapter_name
from contbatch.lora.request import LoRARequest
from contbatch.models.generation_config import GENERATION_CONFIGS
from contbatch.sampling_params import SamplingParams

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130

_EXAMPLES = """examples:
  contbatch generate --input prompts.jsonl --output results.jsonl --temperature 0 --max-tokens 64
  contbatch generate -i questions.txt -o answers.jsonl --model ./my-model --dtype float32
  contbatch generate -i chats.jsonl -o out.jsonl --messages-field messages --on-error stop
  contbatch generate -i questions.txt -o - | jq -r '.outputs[0].text'
  contbatch generate -i rows.parquet -o labels.parquet --prompt-field text --id-field row_id
  contbatch generate -i sheet.csv -o out.jsonl --prompt-field question

Rerunning the same command resumes: ids already in the output are skipped, and a result
whose input record changed since (an inserted or edited line, another input file) is
refused unless --redo-mismatched. A JSONL line may override sampling with a
"sampling_params" object ({"temperature": 0.7, "structured_outputs": {"choice": ["a", "b"]}});
its other keys are metadata. In Parquet and CSV input a "sampling_params" column does the
same (a struct, or JSON text), and only the prompt, id and sampling_params columns are read.
Parquet output: results go to OUTPUT.journal.jsonl as they finish (the journal reruns resume
from; it is kept), and OUTPUT is written from it, in input order, once every record is done.
Parquet input or output needs pyarrow: pip install contbatch[parquet].
Exit status: 0 done, 1 error (nothing or not everything generated), 2 bad usage,
130 interrupted (Ctrl-C; rerun to resume)."""

def run() -> typing.NoReturn:
    """The process entry point (``contbatch`` and ``python -m contbatch``): ``main``, then exit.

    Once ``main`` returns every result is on disk, so Ctrl-C is ignored from then on. Python's
    teardown takes a moment, and late in it Python puts SIGINT back to its default action: a
    Ctrl-C then ended the process by the signal, losing the exit status (130 after a first one).
    """
    try:
        status = main()
    except KeyboardInterrupt:  # a second Ctrl-C in the instant between main's handler and here
        status = EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(status)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["eval"]:  # every flag after it is lm-eval's own, so argparse must not see them
        return _eval(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("contbatch: %(message)s"))
    handler.setLevel(logging.WARNING)
    package_logger = logging.getLogger("contbatch")
    package_logger.addHandler(handler)
    try:
        return args.command(args)
    except KeyboardInterrupt:
        # Generation handles SIGINT itself; this is one before it, while the Parquet file is
        # written, or a second Ctrl-C just after the job wound up (while its summary prints).
        print("contbatch: interrupted; rerun the same command to carry on", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        package_logger.removeHandler(handler)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="contbatch", description="Offline batched LLM generation.")
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    generate = commands.add_parser(
        "generate",
        help="generate for every record of a JSONL/text/Parquet/CSV file into a resumable JSONL or Parquet "
        "results file",
        description="Generate a completion for every record of an input file. Results are appended to "
        "the output (the journal, for Parquet output) as each request finishes (completion order), "
        "one JSON object per line: "
        '{"id", "outputs": [{"text", "finish_reason", "stop_reason", "completion_tokens"}], '
        '"prompt_tokens", "completion_tokens", "fingerprint"} (the fingerprint identifies the record\'s '
        "prompt and per-line sampling, so a resume can tell when the input changed).",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    generate.set_defaults(command=functools.partial(_generate, generate))
    _add_job_flags(generate)
    _add_engine_flags(generate)
    _add_sampling_flags(generate)
    commands.add_parser(
        "eval",
        help="run lm-evaluation-harness with contbatch as the model (any lm_eval flag; "
        "pip install contbatch[eval])",
        description="lm-eval's own command line with --model contbatch: "
        "contbatch eval --model_args pretrained=DIR,dtype=auto --tasks TASKS [lm_eval flags]",
    )
    return parser


def _eval(lm_eval_args: list[str]) -> int:
    try:
        from contbatch.integrations import lm_eval
    except ImportError as exc:
        print(f"contbatch eval needs lm-eval: pip install 'contbatch[eval]' ({exc})", file=sys.stderr)
        return EXIT_ERROR
    return lm_eval.main(lm_eval_args)


def _add_job_flags(parser: argparse.ArgumentParser) -> None:
    job = parser.add_argument_group("job")
    job.add_argument("-i", "--input", required=True,
                     help="input file: JSONL (one object per line), text (one prompt per line), Parquet or CSV "
                     "(one record per row, CSV with a header row); read lazily")
    job.add_argument("-o", "--output", required=True,
                     help="results file, JSONL or Parquet (see --output-format); OUTPUT.meta.json and "
                     "OUTPUT.errors.jsonl go beside it, and for Parquet the journal OUTPUT.journal.jsonl. "
                     "'-': standard output (JSONL), with no resume and no file beside it (bad records only go to "
                     "stderr); other paths that are not regular files (pipes, devices, directories) are refused")
    job.add_argument("-m", "--model",
                     help="Hugging Face model directory or GGUF file (default: the demo model SmolLM2-135M-Instruct, "
                     "fetched once)")
    job.add_argument("--format", choices=("auto", "jsonl", "text", "parquet", "csv"), default="auto",
                     help="input format; auto: by extension, .jsonl/.ndjson/.json, .txt, .parquet or .csv "
                     "(default: auto)")
    job.add_argument("--output-format", choices=("auto", "jsonl", "parquet"), default="auto",
                     help="output format; auto: parquet for a .parquet OUTPUT, else jsonl (default: auto)")
    fields = job.add_mutually_exclusive_group()
    fields.add_argument("--prompt-field", default="prompt",
                        help="JSONL field or Parquet/CSV column holding the prompt text (default: prompt)")
    fields.add_argument("--messages-field",
                        help="field or column holding chat messages [{role, content}] (a list of structs in "
                        "Parquet, JSON text in CSV); the chat template is applied")
    job.add_argument("--id-field", default="id",
                     help="field or column holding the record id, a string or integer; records without it use "
                     "their line (row) number, as text input does (default: id)")
    job.add_argument("--on-error", choices=("skip", "stop"), default="skip",
                     help="bad records (malformed JSON, missing fields, duplicate ids, empty prompts, bad overrides, "
                     "CSV rows with the wrong number of cells): "
                     "skip = list them in OUTPUT.errors.jsonl with a warning and run the rest; stop = validate the "
                     "whole input first and refuse to start if any is bad (default: skip)")
    job.add_argument("--force", action="store_true",
                     help="resume even if the existing output was made with other settings "
                     "(model, dtype, sampling, fields) or has results without a fingerprint (older contbatch)")
    job.add_argument("--redo-mismatched", action="store_true",
                     help="generate again the records whose existing result was made from another prompt or other "
                     "per-line sampling than the input has now under the same id (or has no fingerprint), "
                     "replacing those results; without it such a resume is refused")
    job.add_argument("--fsync-every", type=int, default=1000, metavar="N",
                     help="fsync the output every N records (default: 1000)")
    job.add_argument("--fsync-interval", type=float, default=5.0, metavar="SECONDS",
                     help="... or every SECONDS, whichever comes first (default: 5)")
    job.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="show a progress bar (default: when stderr is a terminal)")


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("engine (see contbatch.LLM)")
    engine.add_argument("--dtype", help="auto, float32, bfloat16 or float16 (default: auto)")
    engine.add_argument("--device", help="auto, cpu or cuda (default: auto)")
    engine.add_argument("--max-num-seqs", type=int, help="most requests decoded together (default: 256)")
    engine.add_argument("--max-num-batched-tokens", type=int, help="tokens per step (default: 4096)")
    engine.add_argument("--max-model-len", type=int, help="longest prompt + completion (default: the model's)")
    engine.add_argument("--kv-cache-memory", type=int, metavar="BYTES",
                        help="KV cache size (default: 30%% of free RAM)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="reuse the KV cache of shared prompt prefixes (default: on)")
    engine.add_argument("--model-impl", choices=MODEL_IMPLS,
                        help="native model code, transformers' own (any decoder-only model), or auto: native "
                        "where there is one (default: auto)")
    engine.add_argument("--quantization", choices=[q for q in QUANTIZATIONS if q],
                        help="int8: 8-bit weights in blocks of 64 inputs (32 on CPUs without AVX512_VNNI) and "
                        "per-token 8-bit activations in the linear layers, CPU only (default: none)")
    engine.add_argument("--quantize-lm-head", action=argparse.BooleanOptionalAction, default=None,
                        help="with --quantization, quantize the LM head too (default: on)")
    engine.add_argument("--quantize-embeddings", action=argparse.BooleanOptionalAction, default=None,
                        help="with --quantization, keep the embedding table in 8-bit blocks too (default: off)")
    engine.add_argument("--lora", metavar="DIR",
                        help="a PEFT LoRA adapter directory every record runs with (part of the job's settings); "
                        "a record's own \"lora_path\" overrides it")
    engine.add_argument("--enable-lora", action="store_true", default=None,
                        help="serve the LoRA adapters records name in \"lora_path\" (implied by --lora)")
    engine.add_argument("--generation-config", choices=GENERATION_CONFIGS,
                        help="auto: the sampling flags not given take the model's generation_config.json "
                        "settings (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), as "
                        "vLLM's; vllm: SamplingParams' own defaults (default: auto)")
    engine.add_argument("--max-loras", type=int, help="most adapters in one step, with LoRA on (default: 1)")
    engine.add_argument("--max-lora-rank", type=int, help="highest adapter rank accepted, with LoRA on (default: 16)")
    engine.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                        help="int8: the KV cache in 8 bits with a scale per token and kv head (about twice the "
                        "tokens of bf16 in the same memory), CPU only (default: auto, the model dtype)")


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field (bools as --x/--no-x, lists repeatable); help from its docstring."""
    sampling = parser.add_argument_group(
        "sampling (defaults for every record, over the model's generation_config.json; see contbatch.SamplingParams)")
    docs = _field_docs(SamplingParams)
    hints = typing.get_type_hints(SamplingParams)
    for field in dataclasses.fields(SamplingParams):
        kwargs = _flag_kwargs(hints[field.name])
        if kwargs is None:
            continue  # a type the command line cannot express; JSONL overrides can still set it
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        help_text = f"{docs.get(field.name, '')} (default: {default!r})".replace("%", "%%")
        if kwargs.get("action") is not argparse.BooleanOptionalAction:
            kwargs["metavar"] = field.name.upper()
        sampling.add_argument(_flag(field.name), dest=f"sampling_{field.name}", help=help_text.strip(), **kwargs)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _flag_kwargs(annotation: object) -> dict | None:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        # "T | None" is T; "list[T] | T" (one value or several) is list[T].
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        lists = [arg for arg in members if typing.get_origin(arg) is list]
        if len(members) == 1:
            annotation = members[0]
        elif len(lists) == 1 and all(arg is lists[0] or (arg,) == typing.get_args(lists[0]) for arg in members):
            annotation = lists[0]
        else:
            return None
    args = typing.get_args(annotation)
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if annotation in (int, float, str):
        return {"type": annotation}
    if typing.get_origin(annotation) is dict:  # e.g. --logit-bias '{"50256": -100}'
        return {"type": _json_object}
    if typing.get_origin(annotation) is list and len(args) == 1 and args[0] in (int, float, str):
        if args[0] is str:  # one value per flag, so values may start with "-" (--stop=-x)
            return {"type": str, "action": "append"}
        return {"type": args[0], "nargs": "+", "action": "extend"}
    return None


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _field_docs(cls: type) -> dict[str, str]:
    """{field: description} from the "Attributes:" section of a Google-style docstring."""
    names = {field.name for field in dataclasses.fields(cls)}
    docs: dict[str, str] = {}
    current = None
    section = (cls.__doc__ or "").partition("Attributes:")[2]
    for line in section.splitlines():
        match = re.match(r"\s*(\w+): (.*)", line)
        if match and match.group(1) in names:
            current = match.group(1)
            docs[current] = match.group(2).strip()
        elif current and line.strip():
            docs[current] += " " + line.strip()
    return docs


def _generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``contbatch generate``; ``parser`` is its subparser (usage errors name the subcommand)."""
    sampling = {key.removeprefix("sampling_"): value for key, value in vars(args).items()
                if key.startswith("sampling_") and value is not None}
    try:
        SamplingParams(**sampling)  # a bad flag is a usage error; the flags go over the model's defaults
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    engine = {key: getattr(args, key) for key in ("dtype", "device", "max_num_seqs", "max_num_batched_tokens",
                                                  "max_model_len", "kv_cache_memory", "enable_prefix_caching",
                                                  "model_impl", "quantization", "quantize_lm_head",
                                                  "quantize_embeddings", "kv_cache_dtype", "enable_lora", "max_loras",
                                                  "max_lora_rank", "generation_config")}
    if args.lora is not None:
        engine["enable_lora"] = True
    for flag in ("max_loras", "max_lora_rank"):
        if engine[flag] is not None and not engine.get("enable_lora"):
            parser.error(f"--{flag.replace('_', '-')} applies only with --lora or --enable-lora")
    lora = None if args.lora is None else LoRARequest(adapter_name(args.lora), 1, args.lora)
    try:
        summary = run_job(
            args.input,
            args.output,
            model=args.model,
            sampling_params=sampling,
            input_format=args.format,
            output_format=args.output_format,
            prompt_field=args.prompt_field,
            messages_field=args.messages_field,
            id_field=args.id_field,
            on_error=args.on_error,
            force=args.force,
            redo_mismatched=args.redo_mismatched,
            llm_kwargs={key: value for key, value in engine.items() if value is not None},
            use_tqdm=sys.stderr.isatty() if args.progress is None else args.progress,
            fsync_every=args.fsync_every,
            fsync_interval=args.fsync_interval,
            lora_request=lora,
        )
    except BrokenPipeError:
        _silence_stdout()
        print("contbatch: error: standard output was closed (broken pipe); stopped", file=sys.stderr)
        return EXIT_ERROR
    except (ImportError, OSError, TypeError, ValueError) as exc:  # ImportError: pyarrow missing for Parquet
        print(f"contbatch: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(summary.line(), file=sys.stderr)
    return {"done": 0, "interrupted": EXIT_INTERRUPTED}.get(summary.status, EXIT_ERROR)


def _silence_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null, so that the interpreter's final flush
    does not fail a second time."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
