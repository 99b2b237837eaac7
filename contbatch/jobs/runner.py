"""run_job: generate for every record of an input file into a results file that survives crashes."""

import dataclasses
import itertools
import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path

from contbatch.jobs import fingerprints
from contbatch.jobs.adapters import JobAdapters
from contbatch.jobs.ledger import Claim, IdLedger
from contbatch.jobs.output import (
    STDOUT,
    ErrorLog,
    ResultWriter,
    StdoutWriter,
    check_output_path,
    detect_output_format,
    journal_path,
)
from contbatch.jobs.parquet_output import check_replaceable, write_parquet
from contbatch.jobs.pyarrow_required import import_pyarrow
from contbatch.jobs.reader import BadRecord, InputFile, RawRecord, detect_format
from contbatch.jobs.records import RecordBuilder
from contbatch.jobs.settings import (
    check_settings,
    input_settings,
    job_settings,
    model_fingerprint,
    require_settings_file,
    write_meta,
)
from contbatch.llm import LLM, llm_for_adapter
from contbatch.lora.request import LoRARequest
from contbatch.models.generation_config import default_sampling_params
from contbatch.outputs import CompletionOutput, RequestOutput
from contbatch.sampling_params import SamplingParams, with_overrides

logger = logging.getLogger("contbatch.jobs")

ON_ERROR = ("skip", "stop")
MAX_LOGGED_ERRORS = 10
"""Bad records logged one by one before the rest only go to the errors file."""


class JobError(ValueError):
    """The job refused to start: bad input under on_error="stop", or unusable arguments."""


@dataclass
class JobSummary:
    """What one run_job call did. ``status``: "done", "interrupted" (SIGINT) or "stopped"
    (a bad record under on_error="stop" found during generation)."""

    status: str
    output: Path  # Path("-"): standard output
    written: int  # records this run added to the output
    already_done: int  # input records skipped because an earlier run wrote them
    errors: int
    errors_path: Path | None  # None with standard output: bad records are only logged
    prompt_tokens: int
    completion_tokens: int
    generation_s: float
    wall_s: float
    redone: int = 0  # results removed because their input record changed (redo_mismatched), then written again
    journal: Path | None = None  # with Parquet output: the JSONL file results go to until the job is done

    def line(self) -> str:
        where = "standard output" if str(self.output) == STDOUT else self.output
        if self.journal is not None and self.status != "done":
            where = f"{self.journal} ({self.output} is written once every record is done)"
        redone = f", {self.redone} redone because their records changed" if self.redone else ""
        errors = f", {self.errors} bad records in {self.errors_path or 'the log above'}" if self.errors else ""
        rate = self.completion_tokens / self.generation_s if self.generation_s > 0 else 0.0
        hint = _RESUME_HINTS.get(self.status, "")
        return (
            f"contbatch: {self.status}: {self.written} records written to {where} "
            f"({self.already_done} already there{redone}{errors}); {self.prompt_tokens} prompt + "
            f"{self.completion_tokens} generated tokens, {rate:.0f} generated tok/s, "
            f"{self.generation_s:.1f} s generating, {self.wall_s:.1f} s wall{hint}"
        )


_RESUME_HINTS = {
    "interrupted": "; rerun the same command to resume",
    "stopped": "; fix the bad record, then rerun the same command to resume",
}


def run_job(
    input_path: str | Path,
    output_path: str | Path,
    *,
    model: str | Path | None = None,
    llm: LLM | None = None,
    sampling_params: SamplingParams | dict | None = None,
    input_format: str = "auto",
    output_format: str = "auto",
    prompt_field: str = "prompt",
    messages_field: str | None = None,
    id_field: str = "id",
    on_error: str = "skip",
    force: bool = False,
    redo_mismatched: bool = False,
    llm_kwargs: dict | None = None,
    use_tqdm: bool = False,
    fsync_every: int = 1000,
    fsync_interval: float = 5.0,
    on_result: Callable[[dict], None] | None = None,
    lora_request: LoRARequest | None = None,
) -> JobSummary:
    """Generate a completion for every record of ``input_path`` into ``output_path`` (JSONL or Parquet).

    Rerunning the same call after a crash or Ctrl-C resumes: records whose id is in
    the output already are skipped, a torn last line is cut off, and different
    settings are refused (SettingsMismatch) unless ``force``. Before the model loads,
    each result's fingerprint (its record's prompt and own sampling overrides) is
    compared with the input record that has its id now: a difference (an inserted or
    edited line, another input file) is refused (InputMismatch) unless
    ``redo_mismatched``. Results are appended as each request finishes, in completion
    order, one object per line::

        {"id": ..., "outputs": [{"text", "finish_reason", "stop_reason", "completion_tokens"}],
         "prompt_tokens": n, "completion_tokens": n, "fingerprint": {"prompt": hex, "sampling": hex}}

    With Parquet output those lines go to the journal ``<output>.journal.jsonl``, and once
    the job is done the Parquet file is written from it atomically, in input order, with the
    same columns (see contbatch.jobs.parquet_output and parquet_schema). The journal is kept:
    reruns resume from it (a rerun of a finished job leaves the Parquet file as it is).

    Args:
        input_path: JSONL (one object per line), text (one prompt per line), Parquet or
            CSV (one record per row) file, read lazily.
        output_path: results file; ``<output>.meta.json`` (settings) and
            ``<output>.errors.jsonl`` (bad records) are written beside it. ``"-"``:
            standard output (JSONL), with no resume and no file beside it (bad records are
            only logged). Anything else that is not a regular file is refused (OutputError).
        model: model directory or GGUF file; default: the demo model. Needed with ``llm`` too
            (it identifies the model in the settings file).
        llm: an LLM built from ``model`` to reuse; default: one built with ``llm_kwargs``.
        sampling_params: defaults for every record; lines may override fields (see
            contbatch.jobs.records). A SamplingParams is taken whole; a dict of its fields, or
            None, goes over the model's own defaults (``LLM.get_default_sampling_params()``:
            its generation_config.json, unless ``llm_kwargs`` has generation_config="vllm").
        input_format: "auto" (by extension: .jsonl/.ndjson/.json, .txt, .parquet or .csv),
            "jsonl", "text", "parquet" or "csv". Parquet needs pyarrow
            (``pip install contbatch[parquet]``), checked before any work.
        output_format: "auto" (parquet for a .parquet path, else jsonl), "jsonl" or "parquet".
        prompt_field: JSONL field (Parquet/CSV column) holding the prompt text.
        messages_field: field or column holding chat messages instead (a list of
            {role, content}; JSON text in CSV); the model's chat template is applied.
            Excludes prompt_field.
        id_field: field or column holding the record id (string or integer); records
            without it use their line (row) number. Text input always uses line numbers.
        on_error: "skip" (default): bad records go to the errors file with a warning
            and the rest run. "stop": the whole input is validated first and any bad
            record refuses the job (JobError) before generation starts.
        force: resume even if the stored settings differ, or the results have no
            fingerprint (written by an older contbatch; they are kept unchecked).
        redo_mismatched: generate again the records whose results do not match them
            (or have no fingerprint); their old results are removed from the output
            (atomically rewritten), so it keeps exactly one result per id.
        use_tqdm: show a progress bar.
        fsync_every, fsync_interval: fsync the output every this many records or seconds.
        on_result: called with each result object (as above) right after its line is
            written, e.g. to follow the job's progress.
        lora_request: a LoRA adapter every record runs with (the LLM it builds gets
            enable_lora=True; a given ``llm`` must have it). Its directory's fingerprint is
            part of the job's settings, so a resume with another adapter is refused. A
            record's own ``"lora_path"`` (a PEFT adapter directory) overrides it for that
            record, where the LLM has enable_lora (``llm_kwargs``); each record's adapter
            and the adapter directory's content are part of its fingerprint.

    On SIGINT (in the main thread) no new records are started, in-flight ones finish
    and are written, and the summary has status "interrupted"; a second SIGINT
    aborts in-flight requests at once. A result that finished is never lost.
    """
    started = time.perf_counter()
    input_path, output_path = Path(input_path), Path(output_path)
    _check_arguments(on_error, prompt_field, messages_field, model, llm, llm_kwargs, fsync_every, fsync_interval)
    source, output_format = _check_files(
        input_path, output_path, input_format, output_format, prompt_field, messages_field, id_field
    )
    if model is None:
        from contbatch.demo_model import demo_model_dir

        model = demo_model_dir()
    model = Path(model)
    params = _job_sampling_params(sampling_params, _model_defaults(model, llm, llm_kwargs))
    to_file = str(output_path) != STDOUT
    journal = journal_path(output_path, output_format)
    writer = ResultWriter(journal, fsync_every, fsync_interval) if to_file else StdoutWriter()
    meta_path = output_path.with_name(output_path.name + ".meta.json")
    prompt = _prompt_settings(source)
    adapters = JobAdapters(lora_request)
    try:
        known = input_settings(params, prompt)
        redo = _check_resume(writer, meta_path, known, source, adapters, redo_mismatched, force)
        llm = llm_for_adapter(model, lora_request, llm_kwargs or {}, llm)
        settings = job_settings(model_fingerprint(model), str(llm.dtype), llm.engine.max_model_len, params, prompt,
                                llm.engine.quantization, llm.engine.config.kv_cache_dtype,
                                None if lora_request is None else model_fingerprint(Path(lora_request.lora_path)))
        rewrite_meta = to_file and check_settings(meta_path, settings, bool(writer.done), force)
        adapters.know(llm.engine.loaded_loras())
        builder = RecordBuilder(params, prompt_field, messages_field, llm.get_tokenizer(),
                                adapters if llm.engine.config.enable_lora else None)
        errors = ErrorLog(output_path.with_name(output_path.name + ".errors.jsonl") if to_file else None)
        job = _Job(source, builder, adapters, writer, errors, on_error, on_result)
        try:
            if on_error == "stop":
                job.validate_all()
            if rewrite_meta:
                write_meta(meta_path, settings, model)
            if redo:
                writer.drop(redo)
            status, generation_s = job.generate(llm, params, use_tqdm, lora_request)
            if status == "done" and journal != output_path:
                writer.sync()
                write_parquet(journal, output_path, (r.id for r in source.records() if isinstance(r, RawRecord)))
        finally:
            errors.close()
    except BaseException:
        writer.close(remove_if_unused=True)  # a refused job leaves no empty results file behind
        raise
    writer.close()
    return JobSummary(
        status=status,
        output=output_path,
        written=writer.num_written,
        already_done=job.already_done,
        errors=errors.count,
        errors_path=errors.path,
        prompt_tokens=job.prompt_tokens,
        completion_tokens=job.completion_tokens,
        generation_s=generation_s,
        wall_s=time.perf_counter() - started,
        redone=len(redo),
        journal=journal if journal != output_path else None,
    )


def _check_resume(
    writer: ResultWriter | StdoutWriter, meta_path: Path, known_settings: dict, source: InputFile,
    adapters: JobAdapters, redo_mismatched: bool, force: bool,
) -> set:
    """Before the model loads: the ids whose results must be generated again; SettingsMismatch or
    InputMismatch when the existing results cannot be used as they are. The settings known
    now are checked first: a changed setting explains mismatching records better."""
    if not writer.done:
        return set()
    require_settings_file(meta_path, True, force)
    check_settings(meta_path, known_settings, True, force, partial=True)
    with closing(source.records()) as records:
        check = fingerprints.check_results(records, writer.done, source.prompt_key, adapters.digest, source.unit)
    return check.to_redo(writer.path, redo_mismatched, force)


def _prompt_settings(source: InputFile) -> dict:
    """How prompts are read, for the settings file."""
    prompt = {"format": source.format}
    if source.format != "text":
        prompt["id_field"] = source.id_field
        prompt["messages_field" if source.chat else "prompt_field"] = source.prompt_key
    return prompt


def _check_arguments(
    on_error: str, prompt_field: str, messages_field: str | None, model: object, llm: LLM | None,
    llm_kwargs: dict | None, fsync_every: int, fsync_interval: float,
) -> None:
    """ValueError for arguments that cannot work together."""
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be 'skip' or 'stop', got {on_error!r}")
    if messages_field is not None and prompt_field != "prompt":
        raise ValueError("give prompt_field or messages_field, not both")
    if llm is not None and model is None:
        raise ValueError("give model (the directory llm was built from) together with llm: it identifies the results")
    if llm is not None and llm_kwargs:
        raise ValueError("llm_kwargs only apply when run_job builds the LLM; give llm or llm_kwargs, not both")
    if fsync_every < 1 or not fsync_interval >= 0:  # `not >=`: NaN is refused too
        raise ValueError(f"fsync_every must be >= 1 and fsync_interval >= 0, got {fsync_every} and {fsync_interval}")


def _check_files(
    input_path: Path, output_path: Path, input_format: str, output_format: str, prompt_field: str,
    messages_field: str | None, id_field: str,
) -> tuple[InputFile, str]:
    """The input and the output format, once the files can be used: JobError or OutputError
    (ValueErrors) if not, MissingDependency if Parquet is asked for without pyarrow; all before any work."""
    if not input_path.is_file():
        what = "is a directory, not a file" if input_path.is_dir() else "is not a regular file"
        raise JobError(f"input file {str(input_path)!r} {what if input_path.exists() else 'does not exist'}")
    output_format = detect_output_format(output_path, output_format)
    if str(output_path) != STDOUT:
        for path in dict.fromkeys((output_path, journal_path(output_path, output_format))):
            if input_path.resolve() == path.resolve():
                raise JobError("the output file must not be the input file")
            check_output_path(path)
    input_format = detect_format(input_path, input_format)
    if input_format == "text" and messages_field is not None:
        raise ValueError("messages_field needs JSONL, Parquet or CSV input; text input has one prompt per line")
    if "parquet" in (input_format, output_format):
        import_pyarrow()  # without it a Parquet output would fail only once every record is done
    if output_format == "parquet":
        check_replaceable(output_path)
    source = InputFile(input_path, input_format, id_field, messages_field or prompt_field, messages_field is not None)
    source.check_columns()
    return source, output_format


class _Job:
    def __init__(
        self,
        source: InputFile,
        builder: RecordBuilder,
        adapters: JobAdapters,
        writer: ResultWriter | StdoutWriter,
        errors: ErrorLog,
        on_error: str,
        on_result: Callable[[dict], None] | None,
    ) -> None:
        self.source = source
        self.builder = builder
        self.adapters = adapters
        self.writer = writer
        self.errors = errors
        self.on_error = on_error
        self.on_result = on_result
        self.already_done = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.input_exhausted = False

    def validate_all(self) -> None:
        """on_error="stop": read the whole input first; any bad record refuses the job."""
        listed = []
        for item in self._prompts(IdLedger(), lambda: False):
            if isinstance(item, BadRecord):
                self.errors.write(item.line, item.id, item.error)
                if self.errors.path is None or len(listed) < MAX_LOGGED_ERRORS:  # no file: list them all
                    listed.append(f"{self.source.unit} {item.line}: {item.error}")
        if not listed:
            return
        more = f"\n  ... and {self.errors.count - len(listed)} more" if self.errors.count > len(listed) else ""
        where = f"; all listed in {self.errors.path}" if self.errors.path else ""
        raise JobError(
            f"{self.errors.count} bad record(s) in {self.source.path}, nothing was generated (on_error='stop'{where}):"
            "\n  " + "\n  ".join(listed) + more
        )

    def generate(
        self, llm: LLM, params: SamplingParams, use_tqdm: bool, lora_request: LoRARequest | None = None
    ) -> tuple[str, float]:
        stop = _StopSignal()
        ledger = IdLedger(self.writer.done)
        inflight: dict[int, tuple[RawRecord, bytes]] = {}  # iter_generate position -> (record, fingerprint)
        positions = itertools.count()

        def feed() -> Iterator[dict]:
            for item in self._prompts(ledger, lambda: stop.requested):
                if isinstance(item, BadRecord):
                    self._bad(item, stop)
                    continue
                record, prompt = item
                inflight[next(positions)] = record, fingerprints.fingerprint(record, self.source.prompt_key,
                                                                             self.adapters.digest)
                yield prompt

        started = time.perf_counter()
        self.input_exhausted = aborted = False
        outputs = llm.iter_generate(feed(), params, use_tqdm=use_tqdm, lora_request=lora_request)
        with stop.installed(), closing(outputs):
            try:
                for output in outputs:
                    self._finish(*inflight.pop(int(output.request_id)), output, stop)
            except KeyboardInterrupt:
                aborted = True
        if stop.failed:
            status = "stopped"
        else:
            status = "done" if self.input_exhausted and not aborted else "interrupted"
        return status, time.perf_counter() - started

    def _prompts(self, ledger: IdLedger, stopped: Callable[[], bool]) -> Iterator[tuple[RawRecord, dict] | BadRecord]:
        """Prompts of the records still to do, and bad records; ends early once ``stopped()``."""
        with closing(self.source.records()) as records:
            while not stopped():
                item = next(records, None)
                if item is None:
                    self.input_exhausted = True
                    return
                if isinstance(item, BadRecord):
                    yield item
                    continue
                claim = ledger.claim(item.id)
                if claim is Claim.DONE:
                    self.already_done += 1
                elif claim is Claim.DUPLICATE:
                    duplicate = f"duplicate id {item.id!r}: an earlier {self.source.unit} has it"
                    yield BadRecord(item.line, item.id, duplicate)
                else:
                    try:
                        yield item, self.builder.build(item)
                    except (TypeError, ValueError) as exc:
                        yield BadRecord(item.line, item.id, str(exc))

    def _finish(self, record: RawRecord, fingerprint: bytes, output: RequestOutput, stop: "_StopSignal") -> None:
        if output.error is not None:
            self._bad(BadRecord(record.line, record.id, output.error), stop)
            return
        result = result_record(record.id, output, fingerprint)
        with stop.writing():
            self.writer.write(result)
        self.prompt_tokens += len(output.prompt_token_ids)
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)
        if self.on_result is not None:
            self.on_result(result)

    def _bad(self, item: BadRecord, stop: "_StopSignal") -> None:
        with stop.writing():
            self.errors.write(item.line, item.id, item.error)
        self._log_bad(item)
        if self.on_error == "stop":
            stop.requested = stop.failed = True

    def _log_bad(self, item: BadRecord) -> None:
        """The first MAX_LOGGED_ERRORS bad records are logged, the rest are only in the errors
        file; without one (standard output) every one is logged."""
        path = self.errors.path
        if path is not None and self.errors.count > MAX_LOGGED_ERRORS:
            if self.errors.count == MAX_LOGGED_ERRORS + 1:
                logger.warning("more bad records: see %s", path)
            return
        action = "skipped" if self.on_error == "skip" else "stopping"
        listed = f"; listed in {path}" if path is not None else ""
        logger.warning("%s %s %d: %s (%s%s)", self.source.path, self.source.unit, item.line, item.error, action, listed)


def _job_sampling_params(given: object, defaults: SamplingParams) -> SamplingParams:
    """run_job's sampling_params: a SamplingParams, or a dict of fields over ``defaults``
    (None: ``defaults`` as they are)."""
    if given is None:
        return defaults
    if isinstance(given, SamplingParams):
        return given
    if isinstance(given, dict):
        return with_overrides(defaults, given, "sampling_params")
    raise TypeError(f"sampling_params must be a SamplingParams, a dict of its fields or None, got {type(given).__name__}")


def _model_defaults(model: Path, llm: LLM | None, llm_kwargs: dict | None) -> SamplingParams:
    """What the job's LLM runs prompts given no SamplingParams with, read before it loads."""
    if llm is not None:
        return llm.get_default_sampling_params()
    return default_sampling_params(model, (llm_kwargs or {}).get("generation_config", "auto"))


def result_record(record_id: str | int, output: RequestOutput, fingerprint: bytes) -> dict:
    """The results-file object for one finished request; ``fingerprint`` identifies its input record."""
    completions = [_completion(c) for c in output.outputs]
    record = {
        "id": record_id,
        "outputs": completions,
        "prompt_tokens": len(output.prompt_token_ids),
        "completion_tokens": sum(c["completion_tokens"] for c in completions),
        fingerprints.KEY: fingerprints.encode(fingerprint),
    }
    if output.prompt_logprobs is not None:  # asked for: one entry a prompt token, null for the first
        record["prompt_logprobs"] = json.loads(json.dumps(_plain(output.prompt_logprobs)))
    return record


def _completion(completion: CompletionOutput) -> dict:
    """text, finish_reason, stop_reason and completion_tokens, plus any other field
    CompletionOutput has that is set (e.g. logprobs), as JSON."""
    fields = {f.name: getattr(completion, f.name) for f in dataclasses.fields(completion)}
    token_ids = fields.pop("token_ids")
    del fields["index"]  # the position in "outputs"
    result = {"text": fields.pop("text"), "finish_reason": fields.pop("finish_reason"),
              "stop_reason": fields.pop("stop_reason"), "completion_tokens": len(token_ids)}
    extra = {name: value for name, value in fields.items() if value is not None}
    if extra:
        result.update(json.loads(json.dumps(_plain(extra), default=repr)))
    return result


def _plain(value: object) -> object:
    """Dataclasses as dicts, recursively (dataclasses.asdict only takes a dataclass)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


class _StopSignal:
    """SIGINT handling: the first stops admitting new records (in-flight ones finish and are
    written); the second raises KeyboardInterrupt at once, but never while a line is being written."""

    def __init__(self) -> None:
        self.requested = False
        self.failed = False
        self._writing = False
        self._deferred = False

    @contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGINT, self._handle)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    @contextmanager
    def writing(self):
        self._writing = True
        try:
            yield
        finally:
            self._writing = False
        if self._deferred:
            raise KeyboardInterrupt

    def _handle(self, signum, frame) -> None:
        if not self.requested:
            self.requested = True
            logger.warning("interrupted: finishing the requests in flight (Ctrl-C again to abort them now)")
        elif self._writing:
            self._deferred = True
        else:
            raise KeyboardInterrupt
