"""Generation over a Ray Data dataset: one ``contbatch.LLM`` per Ray actor, on every machine
of a Ray cluster (``pip install contbatch[ray]``).

    import ray
    from contbatch import SamplingParams
    from contbatch.integrations.ray import build_processor

    ray.init(address="auto")  # or ray.init() for this machine alone
    processor = build_processor(
        model="/models/SmolLM2-135M-Instruct",
        sampling_params=SamplingParams(temperature=0, max_tokens=128),
        engine_kwargs={"dtype": "bfloat16", "kv_cache_memory": 4 << 30},
        concurrency=8,  # actors, one LLM each
        num_cpus=16,  # cores per actor: its torch threads
    )
    processor(ray.data.read_parquet("prompts/")).write_parquet("completions/")

Modelled on Ray's own ``ray.data.llm.build_llm_processor``: an actor pool in which each
actor holds one engine and takes several batches at once (``max_concurrent_batches``).
Here every batch in flight puts its rows on the one PromptQueue that the actor's engine
thread reads, so rows of the next batch join the running ones at the engine's next step
instead of waiting for the slowest row of the batch before.

Fault tolerance is Ray Data's own: it creates its actors with ``max_restarts=-1`` and
``max_task_retries=-1``, so an actor whose process or machine dies is started again (its
LLM rebuilt) and the batches it held run again; each input row still comes out once.
(Ray 2.60 deprecates passing such options to ``map_batches``, so they are not set here.)
"""

import asyncio
import inspect
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import ray.data
import torch

from contbatch.jobs.reader import without_nulls
from contbatch.llm import LLM, llm_for_adapter
from contbatch.lora.by_path import AdaptersByPath, checked_adapter_path
from contbatch.lora.request import LoRARequest
from contbatch.outputs import RequestOutput
from contbatch.prompt_queue import PromptQueue
from contbatch.sampling_params import SamplingParams, with_overrides

RowFunction = Callable[[dict], dict]

COMPLETION_SCHEMA = pa.schema([
    pa.field("generated_text", pa.string()),
    pa.field("generated_token_ids", pa.list_(pa.int64())),
    pa.field("finish_reason", pa.string()),
    pa.field("error", pa.string()),  # None when the row ran; then the three above are None
])
"""The columns the processor adds to each row."""


@dataclass(frozen=True)
class Processor:
    """Maps a Dataset of prompts to the same rows with their completions; made by build_processor()."""

    model: str
    sampling_params: SamplingParams | None  # None: each actor's LLM's get_default_sampling_params()
    engine_kwargs: dict
    concurrency: int
    batch_size: int
    max_concurrent_batches: int
    num_cpus: float
    num_threads: int
    memory: float | None = None
    map_batches_kwargs: dict = field(default_factory=dict)
    preprocess: RowFunction | None = None
    postprocess: RowFunction | None = None
    on_actor_start: Callable[[LLM], None] | None = None
    lora_request: LoRARequest | None = None

    def __call__(self, dataset: ray.data.Dataset) -> ray.data.Dataset:
        _warn_if_no_cpu_left(self.concurrency * self.num_cpus)
        return dataset.map_batches(
            _GenerationActor,
            fn_constructor_kwargs={"processor": self},
            batch_size=self.batch_size,
            batch_format="pyarrow",
            zero_copy_batch=True,
            compute=ray.data.ActorPoolStrategy(
                size=self.concurrency, max_concurrent_calls_per_actor=self.max_concurrent_batches
            ),
            num_cpus=self.num_cpus,
            memory=self.memory,
            **self.map_batches_kwargs,
        )


def build_processor(
    *,
    model: str | Path,
    sampling_params: SamplingParams | None = None,
    engine_kwargs: dict | None = None,
    concurrency: int = 1,
    batch_size: int = 32,
    max_concurrent_batches: int = 8,
    num_cpus: float = 1,
    num_threads: int | None = None,
    memory: float | None = None,
    map_batches_kwargs: dict | None = None,
    preprocess: RowFunction | None = None,
    postprocess: RowFunction | None = None,
    on_actor_start: Callable[[LLM], None] | None = None,
    lora_request: LoRARequest | None = None,
) -> Processor:
    """A processor that runs generation over a ``ray.data.Dataset``: ``processor(dataset)``.

    Each input row is a prompt: a "prompt" column (text), "prompt_token_ids", or "messages"
    (a chat conversation, formatted with the model's chat template), and optionally its own
    "sampling_params": a SamplingParams, or a dict (a struct column) of the fields that
    override ``sampling_params`` for that row, its null fields left out; and its own LoRA
    adapter: a "lora_path" column (a PEFT adapter directory, the same path on every node;
    null: ``lora_request``'s adapter, or none), or a LoRARequest that ``preprocess`` returns
    under "lora_request". Rows that name adapters need ``engine_kwargs={"enable_lora": True}``
    (implied by ``lora_request``; "max_loras" lets several run in one step). The output has the input's
    columns plus ``COMPLETION_SCHEMA``'s: generated_text, generated_token_ids, finish_reason
    and error. A row that cannot run (a bad prompt or sampling_params) gets ``error`` set and
    the other columns None, as does a row on which ``preprocess`` raises; the others run on.
    Rows come out in no particular order: keep an
    id column to join on.

    Args:
        model: model directory, the same path on every node.
        sampling_params: for rows without their own (n must be 1); default: the model's
            (``LLM.get_default_sampling_params()``: its generation_config.json over
            SamplingParams(), unless engine_kwargs has generation_config="vllm").
        engine_kwargs: keyword arguments of ``LLM(model, ...)`` for each actor's LLM, e.g.
            dtype, max_num_seqs, kv_cache_memory (size it: every actor on a node has one).
        concurrency: number of actors, each holding one LLM.
        batch_size: rows per Ray Data batch.
        max_concurrent_batches: batches one actor holds at once, all feeding its one engine;
            ``batch_size * max_concurrent_batches`` should reach the engine's max_num_seqs.
        num_cpus: CPUs Ray reserves for each actor.
        num_threads: torch threads in each actor; default ``num_cpus`` (at least 1).
        memory: bytes of RAM Ray reserves for each actor (model, KV cache, activations), so
            that it places no more actors on a node than fit.
        map_batches_kwargs: further ``Dataset.map_batches`` arguments for the generation
            stage, e.g. ``{"resources": {...}, "runtime_env": {...}}``.
        preprocess: maps an input row to the dict the engine reads (its "prompt",
            "prompt_token_ids" or "messages", and optionally "sampling_params", "lora_path"
            or "lora_request"); runs in the actor.
        postprocess: maps each output row (input columns + completion columns) to the row kept.
        on_actor_start: called with the LLM in each actor once it is built (again in a
            restarted actor): to add a stats listener, log or warm up.
        lora_request: a LoRA adapter every row runs with (its directory the same path on every
            node); each actor's LLM gets enable_lora=True and reads it as it starts.
    """
    if lora_request is not None and not isinstance(lora_request, LoRARequest):
        raise TypeError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
    _check_engine_kwargs(engine_kwargs or {})
    if not isinstance(num_cpus, (int, float)) or num_cpus <= 0:
        raise ValueError(f"num_cpus must be a number > 0, got {num_cpus!r}")
    threads = num_threads if num_threads is not None else max(1, int(num_cpus))
    counts = {"concurrency": concurrency, "batch_size": batch_size, "max_concurrent_batches": max_concurrent_batches,
              "num_threads": threads}
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if sampling_params is not None:
        _check_one_completion(sampling_params)
    return Processor(
        model=str(model), sampling_params=sampling_params, engine_kwargs=dict(engine_kwargs or {}),
        concurrency=concurrency, batch_size=batch_size, max_concurrent_batches=max_concurrent_batches,
        num_cpus=num_cpus, num_threads=threads, memory=memory,
        map_batches_kwargs=dict(map_batches_kwargs or {}),
        preprocess=preprocess, postprocess=postprocess, on_actor_start=on_actor_start, lora_request=lora_request,
    )


def _warn_if_no_cpu_left(actor_cpus: float) -> None:
    """Ray Data's read and write tasks need a CPU each: actors holding every CPU leave them waiting forever."""
    cluster_cpus = ray.cluster_resources().get("CPU", 0) if ray.is_initialized() else 0
    if cluster_cpus and actor_cpus >= cluster_cpus:
        warnings.warn(
            f"the actors reserve {actor_cpus:g} CPUs of the cluster's {cluster_cpus:g}, leaving none for Ray Data's "
            "read and write tasks, which will wait forever: lower num_cpus or concurrency",
            stacklevel=3,
        )


def _check_engine_kwargs(engine_kwargs: dict) -> None:
    """Here rather than in every actor, where a typo would kill each one as it starts."""
    allowed = set(inspect.signature(LLM).parameters) - {"model"}
    unknown = sorted(set(engine_kwargs) - allowed)
    if unknown:
        raise ValueError(f"engine_kwargs has {unknown}, which LLM() does not take; allowed: {sorted(allowed)}")


def _check_one_completion(params: SamplingParams) -> None:
    if params.n != 1:
        raise ValueError(f"SamplingParams.n={params.n}: a row holds one completion, so n must be 1")


class _GenerationActor:
    """One LLM in one Ray actor, serving every batch the actor holds at once."""

    def __init__(self, processor: Processor) -> None:
        torch.set_num_threads(processor.num_threads)
        self.processor = processor
        lora = processor.lora_request
        self.llm = llm_for_adapter(processor.model, lora, processor.engine_kwargs)  # a bad adapter fails the actor
        if processor.on_actor_start is not None:
            processor.on_actor_start(self.llm)
        self.adapters = AdaptersByPath(self.llm.engine.loaded_loras())  # rows' "lora_path"s
        given = processor.sampling_params
        self.default_params = given if given is not None else self.llm.get_default_sampling_params()
        self.engine = _EngineThread(self.llm, lora)

    async def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        completions = await asyncio.gather(*(self._complete(row) for row in rows))
        postprocess = self.processor.postprocess
        if postprocess is not None:
            return pa.Table.from_pylist([postprocess({**row, **done}) for row, done in zip(rows, completions)])
        kept = batch.drop_columns([name for name in COMPLETION_SCHEMA.names if name in batch.column_names])
        for column in COMPLETION_SCHEMA:
            kept = kept.append_column(column, pa.array([done[column.name] for done in completions], column.type))
        return kept

    async def _complete(self, row: dict) -> dict:
        preprocess = self.processor.preprocess
        try:
            fields = preprocess(row) if preprocess is not None else row
        except Exception as exc:  # the user's code: that row fails alone
            return _failed(f"preprocess raised {type(exc).__name__}: {exc}")
        try:
            prompt = _engine_prompt(fields, self.llm, self.default_params, self.adapters)
        except (TypeError, ValueError) as exc:
            return _failed(str(exc))
        return _completion_columns(await asyncio.wrap_future(self.engine.submit(prompt)))


class _EngineThread:
    """A thread that runs one ``iter_generate`` over a PromptQueue for the actor's whole
    life, so the engine never waits for a batch to end before taking the next one's rows."""

    def __init__(self, llm: LLM, lora_request: LoRARequest | None = None) -> None:
        self.queue = PromptQueue()
        self._waiting: dict[int, Future] = {}
        self._lock = threading.Lock()  # a request cannot finish before its future is registered
        self._failure: BaseException | None = None
        threading.Thread(target=self._run, args=(llm, lora_request), name="contbatch-engine", daemon=True).start()

    def submit(self, prompt: dict) -> "Future[RequestOutput]":
        future: Future = Future()
        with self._lock:
            if self._failure is not None:
                future.set_exception(self._failure)
            else:
                self._waiting[self.queue.put(prompt)] = future
        return future

    def _run(self, llm: LLM, lora_request: LoRARequest | None) -> None:
        try:
            for output in llm.iter_generate(self.queue, lora_request=lora_request):
                with self._lock:
                    future = self._waiting.pop(int(output.request_id))
                future.set_result(output)
        except BaseException as exc:  # noqa: BLE001 - every waiting batch fails with the engine's error
            with self._lock:
                self._failure = exc
                waiting, self._waiting = list(self._waiting.values()), {}
            for future in waiting:
                future.set_exception(exc)


def _engine_prompt(fields: dict, llm: LLM, default_params: SamplingParams, adapters: AdaptersByPath) -> dict:
    """The prompt dict LLM takes for one row's fields; TypeError/ValueError saying what is wrong."""
    if not isinstance(fields, dict):
        raise TypeError(f"preprocess must return a dict, got {type(fields).__name__}")
    params = _row_sampling_params(fields.get("sampling_params"), default_params)
    own = {"sampling_params": params, "lora_request": _row_adapter(fields, llm, adapters)}
    if fields.get("messages") is not None:
        return {**llm.render_chat(fields["messages"]), **own}
    prompt = {key: fields[key] for key in ("prompt", "prompt_token_ids") if fields.get(key) is not None}
    if not prompt:
        raise ValueError(f"a row needs a 'prompt', 'prompt_token_ids' or 'messages' value; it has {sorted(fields)}")
    return {**prompt, **own}


def _row_adapter(fields: dict, llm: LLM, adapters: AdaptersByPath) -> LoRARequest | None:
    """A row's own adapter (None: the processor's): its "lora_request", else its "lora_path"."""
    path = checked_adapter_path(fields.get("lora_path"), "a row's 'lora_path'")
    request = fields.get("lora_request")
    if request is None and path is None:
        return None
    if not llm.engine.config.enable_lora:
        raise ValueError("a row names a LoRA adapter, but the actors' LLM serves none: pass "
                         "engine_kwargs={'enable_lora': True} (or lora_request) to build_processor")
    return request if request is not None else adapters.request(path)


def _row_sampling_params(value: object, default: SamplingParams) -> SamplingParams:
    """A row's own SamplingParams, or ``default`` with the fields a dict sets (its nulls, which
    an Arrow struct column gives for the fields a row does not set, left out), as bulk jobs'
    per-record overrides; ``default`` itself for a row without."""
    if isinstance(value, dict):
        value = with_overrides(default, without_nulls(value) or {}, "a row's 'sampling_params'")
    if value is None:
        return default
    if not isinstance(value, SamplingParams):
        raise TypeError(f"a row's sampling_params must be a SamplingParams or a dict, got {type(value).__name__}")
    _check_one_completion(value)
    return value


def _completion_columns(output: RequestOutput) -> dict:
    if output.error is not None:
        return _failed(output.error)
    completion = output.outputs[0]
    return {
        "generated_text": completion.text,
        "generated_token_ids": completion.token_ids,
        "finish_reason": completion.finish_reason,
        "error": None,
    }


def _failed(error: str) -> dict:
    return {"generated_text": None, "generated_token_ids": None, "finish_reason": None, "error": error}
