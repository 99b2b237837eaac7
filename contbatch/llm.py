"""LLM: the user-facing entry point (vLLM's offline ``LLM`` API)."""

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import closing, contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm

from contbatch.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, BeamStepInput
from contbatch.config import EngineConfig, resolve_device, resolve_dtype
from contbatch.engine.kv_cache import resolve_block_size
from contbatch.engine.llm_engine import LLMEngine
from contbatch.interrupts import StepInterrupts
from contbatch.lora.request import LoRARequest
from contbatch.models.generation_config import default_sampling_params
from contbatch.models.gguf import has_q8_0_layers, is_gguf_file
from contbatch.outputs import GenerationCancelled, GenerationInterrupted, RequestMetrics, RequestOutput
from contbatch.prompt_queue import IterableFeed, PromptQueue
from contbatch.prompts import (
    ChatTemplateOptions,
    PreparedPrompt,
    PromptPreparer,
    as_prompt_iterable,
    raise_if_invalid,
    render_conversation,
    validate_conversation,
)
from contbatch.sampling_params import SamplingParams
from contbatch.scoring import (
    LabelScores,
    LoglikelihoodOutput,
    admission_waves,
    check_labels,
    label_scores,
    loglikelihood_output,
    repeated_pair_output,
    tokenize_pair,
)


class LLM:
    """Offline batched generation with continuous batching and a paged KV cache.

    Args:
        model: path to a Hugging Face model directory (config.json, *.safetensors,
            tokenizer files). Llama, Mistral, Qwen2, Qwen3, Phi-3 and Gemma 3 run on contbatch's
            own model code; any other decoder-only text model transformers can load (GPT-2,
            GPT-NeoX, Phi-2, Granite, OLMo 2, ...) runs on transformers' modeling code with
            contbatch's paged attention (see ``model_impl``). Or a GGUF file (llama.cpp's
            format, "llama" architecture: Llama, Mistral, SmolLM; needs ``pip install
            contbatch[gguf]``), config and tokenizer read from it: on the CPU its Q8_0 linear
            layers (and a tied LM head over a Q8_0 embedding table) run on the int8 kernels as
            stored; other tensor types (Q4_K, F16, ...) load dequantized into ``dtype``.
        dtype: "auto" (bf16 on CPUs and GPUs with native bf16, else fp32 on CPU; bf16 on any
            CPU around int8 linear weights: ``quantization="int8"`` or a GGUF file's Q8_0 layers),
            "float32", "bfloat16", or "float16" (GPU only: refused on CPU, where it is ~300x slower).
        device: "auto", "cpu" or "cuda". "auto" is the GPU when torch sees one, except with
            ``quantization`` or ``kv_cache_dtype="int8"``, which run on the CPU only (an
            explicit "cuda" is refused then).
        max_num_seqs: most requests decoded together in one step.
        max_num_batched_tokens: tokens per step (long prompts are prefilled in chunks).
        max_model_len: longest prompt + completion; default: the model's context length.
        block_size: tokens per KV-cache block; default 16, or 256 on CUDA with flash-attn
            installed (flash-attn's paged kernel then serves attention).
        kv_cache_memory: bytes for the KV cache; default 30% of available RAM (logged).
        enable_prefix_caching: reuse the KV cache of shared prompt prefixes.
        seed: seed for requests that do not set their own.
        skip_tokenizer_init: run without a tokenizer (token-id prompts, empty text).
        adapt_threads: on the CPU, use only the cores that other processes leave free
            (checked four times a second; spinning OpenMP threads sharing a core with another
            process slow every step 2-4x). False keeps torch's thread count as it is.
        model_impl: "auto" (contbatch's native model where one runs the architecture, else
            transformers' modeling code; the choice is logged), "native" or "transformers".
            Every engine feature works the same on both.
        quantization: None, or "int8": 8-bit weights (llama.cpp's Q8_0 rule in blocks of 64
            inputs on CPUs with AVX512_VNNI, 32 elsewhere) and per-token 8-bit activations in
            the linear layers; CPU only.
        quantize_lm_head: with quantization="int8", whether the LM head is quantized too.
        quantize_embeddings: with quantization="int8", whether the embedding table is kept in
            8-bit blocks too (rows dequantized on lookup; a tied head shares the int8 copy).
        kv_cache_dtype: "auto" (the model dtype) or "int8": the KV cache in 8 bits, one fp32
            scale per token and kv head, so the same memory holds about twice the tokens of a
            bf16 cache (four times fp32's); CPU only. vLLM's name; its "fp8" has no CPU kernel here.
        enable_lora: serve PEFT LoRA adapters that requests name (``lora_request`` of generate
            and chat), mixed in one batch; adapters on the decoder layers' linear layers only.
        max_loras: the most adapters the running requests use between them in one step (as
            vLLM's); requests of another adapter wait for a place.
        max_lora_rank: the highest adapter rank accepted (vLLM's default, 16).
        generation_config: "auto" (vLLM's default): prompts given no SamplingParams run with
            the sampling settings the model's generation_config.json recommends (temperature,
            top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens) over
            SamplingParams' defaults; "vllm": SamplingParams() as it is. See
            ``get_default_sampling_params``.

    Example:
        >>> llm = LLM("path/to/model")
        >>> outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
        >>> outs[0].outputs[0].text
    """

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 4096,
        max_model_len: int | None = None,
        block_size: int | None = None,
        kv_cache_memory: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        skip_tokenizer_init: bool = False,
        adapt_threads: bool = True,
        model_impl: str = "auto",
        quantization: str | None = None,
        quantize_lm_head: bool = True,
        quantize_embeddings: bool = False,
        kv_cache_dtype: str = "auto",
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        generation_config: str = "auto",
    ) -> None:
        config = EngineConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            block_size=block_size,
            kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            adapt_threads=adapt_threads,
            model_impl=model_impl,
            quantization=quantization,
            quantize_lm_head=quantize_lm_head,
            quantize_embeddings=quantize_embeddings,
            kv_cache_dtype=kv_cache_dtype,
            enable_lora=enable_lora,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
        )
        if not isinstance(model, (str, Path)):
            raise TypeError(f"model must be a path to a model directory or GGUF file, got {type(model).__name__}")
        resolved_device = resolve_device(device, config.cpu_only_settings())
        config.block_size = resolve_block_size(config.block_size, resolved_device)
        int8_weights = dtype == "auto" and _int8_weights(Path(model), config)  # the file is read only for "auto"
        self.dtype = resolve_dtype(dtype, resolved_device, int8_weights)
        self._default_params = default_sampling_params(Path(model), generation_config)  # before the weights load
        self.engine = LLMEngine(Path(model), config, resolved_device, self.dtype, skip_tokenizer_init)
        engine = self.engine
        self.preparer = PromptPreparer(
            engine.tokenizer, engine.max_model_len, engine.model_config.vocab_size, engine.check_params, engine.load_lora
        )
        self._running = False

    def get_default_sampling_params(self) -> SamplingParams:
        """What prompts given no SamplingParams run with: SamplingParams() with the model's
        generation_config.json settings over it (``LLM(generation_config=...)``), as vLLM's."""
        return self._default_params

    def get_tokenizer(self):
        return self.engine.tokenizer

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, formatted with the
        tokenizer's chat template (or ``chat_template``); outputs come back in input order.
        Each conversation is a list of {"role": ..., "content": ...} messages, the content a
        string or a list of {"type": "text", "text": ...} parts. ``continue_final_message``
        (with add_generation_prompt=False) lets the model go on with the last message, e.g. an
        assistant reply begun by you; ``chat_template_kwargs`` are extra template variables,
        ``tools`` the template's tool definitions, as in vLLM; ``lora_request`` as in generate()."""
        if self.engine.tokenizer is None:
            raise ValueError("chat() needs a tokenizer (skip_tokenizer_init=True was given)")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations")
        options = ChatTemplateOptions(chat_template, add_generation_prompt, continue_final_message,
                                      chat_template_kwargs, tools)
        conversations = [messages] if isinstance(messages[0], dict) else messages
        checked = [validate_conversation(c, f"conversation {i}") for i, c in enumerate(conversations)]  # all first
        prompts = [self._render_chat(c, i, options) for i, c in enumerate(checked)]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def render_chat(
        self, conversation: list[dict], index: int = 0, options: ChatTemplateOptions = ChatTemplateOptions()
    ) -> dict:
        """One conversation as the prompt dict ``generate`` takes ({"prompt", "prompt_token_ids"}),
        rendered as ``chat()`` renders it; ValueError naming conversation ``index`` if it is malformed
        or the template fails. For callers that feed prompts one at a time (a PromptQueue)."""
        if self.engine.tokenizer is None:
            raise ValueError("'messages' need a tokenizer; this LLM was built with skip_tokenizer_init=True")
        return self._render_chat(validate_conversation(conversation, f"conversation {index}"), index, options)

    def _render_chat(self, conversation: list[dict], index: int, options: ChatTemplateOptions) -> dict:
        text, token_ids = render_conversation(self.engine.tokenizer, conversation, f"conversation {index}", options)
        return {"prompt": text, "prompt_token_ids": token_ids}

    def generate(
        self,
        prompts: object,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in input order.

        Args:
            prompts: a str, a list of str, a list of token-id lists, dicts with
                "prompt" or "prompt_token_ids" (and optionally their own
                "sampling_params" and "lora_request"), or any iterable of these. A list is
                validated whole before any work (one ValueError lists every bad
                index); other iterables are read lazily as the engine has room, and
                a bad item there gets a RequestOutput with ``error`` set instead. In
                any form, a request that fails as it starts ends alone, with ``error`` set.
            sampling_params: one SamplingParams for all prompts, or a list with one
                per prompt. Default: ``get_default_sampling_params()`` (SamplingParams()
                with the model's generation_config.json settings, as vLLM's).
            use_tqdm: show a progress bar with input and output tokens per second.
            lora_request: the LoRA adapter every prompt runs with, or a list with one per
                prompt (None: the base model); needs LLM(enable_lora=True). Every adapter
                named is read and checked before any work. A dict prompt's own
                "lora_request" takes its place for that prompt (in a lazy iterable or a
                PromptQueue, the way to give each prompt its own adapter).

        Raises:
            GenerationInterrupted: an exception was raised part-way (e.g. by a prompts
                generator): its ``outputs`` are the requests that finished before it, in
                input order, and the original exception is its ``__cause__``.
            GenerationCancelled: Ctrl-C (a KeyboardInterrupt subclass); its ``outputs`` are
                the requests that finished before it, in input order. A first Ctrl-C takes
                effect when the running step ends, so the engine is left consistent and the
                LLM can generate again; a second one in the same step stops it at once.
        """
        outputs = self.iter_generate(prompts, sampling_params, use_tqdm, lora_request)  # invalid input raises here
        finished: list[RequestOutput] = []
        try:
            for output in outputs:
                finished.append(output)
        except Exception as exc:
            raise GenerationInterrupted(_in_input_order(finished), exc) from exc
        except KeyboardInterrupt as exc:
            raise GenerationCancelled(_in_input_order(finished)) from exc
        return _in_input_order(finished)

    def iter_generate(
        self,
        prompts: object,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> Iterator[RequestOutput]:
        """Like generate(), but yields each RequestOutput the moment its request finishes.

        Outputs arrive in completion order; ``request_id`` is the prompt's position in
        the input (as a string). Nothing is kept for finished requests, so memory stays
        flat however many prompts stream through. Closing the iterator early aborts
        the unfinished requests. To add prompts while it runs, pass a ``PromptQueue``.
        A Ctrl-C that arrives while a step runs is raised once the step's finished
        outputs are yielded (contbatch/interrupts.py).
        """
        self._check_idle()  # here too, so that generate() raises it as it is, before any work
        items, materialised = as_prompt_iterable(prompts)
        total = len(items) if materialised else None
        given = self._default_params if sampling_params is None else sampling_params
        params = _params_iterator(given, total, self.engine.check_params)
        loras = _lora_iterator(lora_request, total, self.engine.load_lora)
        if total == 0:  # as vLLM: nothing to do (a filter upstream may leave no prompt)
            return iter(())
        if materialised:  # every prompt paired with its params and checked before any work
            return self._run(self.preparer.prepare_all(items, params), itertools.repeat(None), loras, True,
                             _Progress(total, use_tqdm))
        return self._run(items, params, loras, False, _Progress(total, use_tqdm))

    def loglikelihood(
        self, requests: Sequence[tuple[object, object]], lora_request: LoRARequest | None = None
    ) -> list[LoglikelihoodOutput]:
        """The log-likelihood of each (context, continuation) pair, in input order.

        Named after lm-eval's request type: vLLM's offline API has no such call (its users
        read ``prompt_logprobs``, which computes every prompt position of every request).
        Here each pair scores only its continuation, and pairs sharing a context prefill it
        once (contbatch/scoring.py); identical pairs are scored once. Contexts and continuations are both strings (split as
        lm-eval splits them) or both token-id lists. Every pair is validated before any
        work: one ValueError lists the bad indices. A pair that fails as it starts gets a
        LoglikelihoodOutput with ``error`` set. ``lora_request``: the LoRA adapter every pair is
        scored with (as in generate()).
        """
        if not isinstance(requests, (list, tuple)) or not requests:
            raise ValueError("requests must be a non-empty list of (context, continuation) pairs")
        return self._loglikelihood(requests, lambda index: f"requests[{index}]", lora_request)

    def _loglikelihood(
        self, requests: Sequence, name: Callable[[int], str], lora_request: LoRARequest | None
    ) -> list[LoglikelihoodOutput]:
        """loglikelihood(), its bad pairs listed as ``name(index)`` names them."""
        self._check_idle()
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
        pairs, prepared = self._prepare_pairs(requests, name)
        loras = _lora_iterator(lora_request, None, self.engine.load_lora)
        # Eval suites repeat pairs (the same choices after the same few-shot prompt): score each once.
        keys = [(tuple(context), tuple(continuation)) for context, continuation in pairs]
        first_of: dict[tuple, int] = {}
        for index, key in enumerate(keys):
            first_of.setdefault(key, index)
        unique = list(first_of.values())
        block_size = self.engine.config.block_size
        sizes = [-(-(len(keys[i][0]) + len(keys[i][1]) + 1) // block_size) for i in unique]
        budget = max(1, self.engine.block_manager.freed_block_reserve // 2)
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        results: list[LoglikelihoodOutput | None] = [None] * len(pairs)
        for wave in admission_waves([keys[i][0] for i in unique], sizes, budget):
            source = [prepared[unique[w]] for w in wave]
            for output in self._run(source, itertools.repeat(params), loras, True, _Progress(None, False)):
                index = unique[wave[int(output.request_id)]]
                results[index] = loglikelihood_output(output, len(keys[index][0]))
        for index, key in enumerate(keys):
            if first_of[key] != index:
                results[index] = repeated_pair_output(results[first_of[key]], len(key[0]))
        return results

    def score_labels(
        self, prompts: Sequence[object], labels: Sequence[str], lora_request: LoRARequest | None = None
    ) -> list[LabelScores]:
        """For each prompt, the probability of each label (normalised over ``labels``) and the
        most probable one: one prefill of each prompt, then each label's tokens (a labeling job
        over 1M rows and 5 labels does not pay for 5M prompt prefills). ``lora_request``: the
        LoRA adapter every prompt is scored with."""
        labels = check_labels(labels)
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list")
        scored = self._loglikelihood(
            [(prompt, label) for prompt in prompts for label in labels],
            lambda index: f"prompts[{index // len(labels)}] with label {labels[index % len(labels)]!r}",
            lora_request,
        )
        results = []
        for start in range(0, len(scored), len(labels)):
            outputs = scored[start : start + len(labels)]
            failed = next((o.error for o in outputs if o.error is not None), None)
            if failed is not None:
                raise ValueError(f"prompts[{start // len(labels)}] could not be scored: {failed}")
            results.append(label_scores(labels, outputs))
        return results

    def beam_search(
        self,
        prompts: Sequence[object],
        params: BeamSearchParams,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """The ``params.beam_width`` best continuations of each prompt by length-penalised
        log-probability, as vLLM's ``LLM.beam_search`` (contbatch/beam_search.py).

        ``prompts``: a list of the forms generate() takes (their own "sampling_params" are not
        used), validated whole before any work; ``lora_request`` as in generate(). Every step
        runs the live beams of all prompts together, each beam continuing from its parent's K/V
        (one token computed a beam a step). ``use_tqdm``: a bar over the steps."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
        items, _ = as_prompt_iterable(prompts)
        loras = list(itertools.islice(_lora_iterator(lora_request, len(items), self.engine.load_lora), len(items)))
        prepared = self.preparer.prepare_all(items, itertools.repeat(None))
        loras = [prompt.lora_request or lora for prompt, lora in zip(prepared, loras)]
        search = BeamSearch(params, self.engine.eos_token_ids, self.engine.max_model_len)
        tokenizer = self.engine.tokenizer
        with self._engine_held(), tqdm(total=params.max_tokens, desc="beam search", unit="step",
                                       disable=not use_tqdm) as steps:
            return search.run([prompt.token_ids for prompt in prepared], loras,
                              lambda inputs, step_params: self._beam_step(inputs, step_params, steps),
                              self.engine.release, None if tokenizer is None else tokenizer.decode)

    def _beam_step(
        self, inputs: list[BeamStepInput], params: SamplingParams, steps: tqdm
    ) -> list[tuple[RequestOutput, int]]:
        """One beam search step (beam_search.Step): a request a beam, continuing from its
        parent's kept K/V and keeping its own; Ctrl-C lands between engine steps."""
        engine, interrupts = self.engine, StepInterrupts()
        with interrupts.deferred():
            seqs = [engine.add_request(index, None, beam.tokens, params, lora_request=beam.lora_request,
                                       keep_blocks=True, parent_seq_id=beam.context)
                    for index, beam in enumerate(inputs)]
            engine.release({beam.context for beam in inputs if beam.context is not None})
        interrupts.raise_pending()
        outputs: dict[int, RequestOutput] = {}
        while engine.has_unfinished():
            with interrupts.deferred():
                outputs.update((int(output.request_id), output) for output in engine.step())
            interrupts.raise_pending()
        steps.update(1)
        return [(outputs[index], seq) for index, seq in enumerate(seqs)]

    def _prepare_pairs(
        self, requests: Sequence, name: Callable[[int], str]
    ) -> tuple[list[tuple[list[int], list[int]]], list[PreparedPrompt]]:
        """Tokenised pairs and their prepared requests; one ValueError lists every bad pair."""
        pairs, prepared, errors = [], [], []
        for index, pair in enumerate(requests):
            try:
                if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                    raise TypeError(f"expected a (context, continuation) pair, got {type(pair).__name__}")
                context, continuation = tokenize_pair(self.engine.tokenizer, *pair)
                prompt = self.preparer.prepare({"prompt_token_ids": context + continuation})
            except (TypeError, ValueError) as exc:
                errors.append(f"{name(index)}: {exc}")
                continue
            pairs.append((context, continuation))
            prepared.append(dataclasses.replace(prompt, prompt_logprobs_from=len(context)))
        raise_if_invalid(errors, "pair(s)")
        return pairs, prepared

    def _run(
        self, source: Iterable, params: Iterator[SamplingParams | None], loras: Iterator[LoRARequest | None],
        prepared: bool, progress: "_Progress",
    ) -> Iterator[RequestOutput]:
        engine = self.engine
        # Held before the feed starts: of two iterators made before either ran, the second to start is refused.
        with self._engine_held(), closing(progress):
            feed = source if isinstance(source, PromptQueue) else IterableFeed(source)
            interrupts = StepInterrupts()  # Ctrl-C between engine updates, never inside one
            while True:
                while engine.num_waiting < engine.config.max_num_seqs:
                    # Wait for a prompt only when nothing runs: waiting then would stall the running requests.
                    taken = feed.take(wait=not engine.has_unfinished())
                    if taken is None:
                        break
                    position, item = taken
                    with interrupts.deferred():
                        failed = self._admit(position, item, next(params, None), next(loras, None), prepared)
                    if failed is not None:
                        progress.update(failed)
                        yield failed
                    interrupts.raise_pending()
                if not engine.has_unfinished():
                    if feed.finished:
                        return
                    continue
                with interrupts.deferred():
                    finished = engine.step()
                for output in finished:
                    progress.update(output)
                    yield output
                interrupts.raise_pending()

    @contextmanager
    def _engine_held(self) -> Iterator[None]:
        """The engine for one call (generate's iterator, a beam search): refused while another
        holds it; left idle, every request dropped, however the call ends."""
        self._check_idle()
        self._running = True
        try:
            yield
        finally:
            self.engine.abort_all()
            self._running = False

    def _check_idle(self) -> None:
        if self._running:
            raise RuntimeError("this LLM is already running a generate/iter_generate call; finish or close it first")

    def _admit(
        self, position: int, item: object, params: SamplingParams | None, lora: LoRARequest | None, prepared: bool
    ) -> RequestOutput | None:
        """Queue one prompt; a prompt that cannot run gets an error output instead. ``params``:
        the call's for this prompt (None past the end of a short list), unless it comes prepared."""
        try:
            prompt: PreparedPrompt = item if prepared else self.preparer.prepare(item, params)
        except (TypeError, ValueError) as exc:
            return _error_output(position, item, str(exc))
        params = prompt.params or params
        lora = prompt.lora_request or lora
        if params is None:
            return _error_output(position, item, "sampling_params list is shorter than the prompts")
        try:
            self.engine.add_request(position, prompt.text, prompt.token_ids, params, prompt.prompt_logprobs_from, lora)
        except Exception as exc:  # noqa: BLE001 - whatever fails, it ends this request only
            return _error_output(position, prompt.text, f"the request could not start: {type(exc).__name__}: {exc}")
        return None


def llm_for_adapter(model: str | Path, lora_request: LoRARequest | None, engine_kwargs: dict,
                    llm: LLM | None = None) -> LLM:
    """The LLM of a bulk job or a Ray actor whose requests all run with ``lora_request`` (or
    none): ``llm`` if given, else one loaded from ``model`` with LoRA enabled when an adapter
    is named; the adapter is loaded now, so a bad one is refused before any request runs."""
    if llm is None:
        llm = LLM(model, **{**({"enable_lora": True} if lora_request is not None else {}), **engine_kwargs})
    if lora_request is not None:
        llm.engine.load_lora(lora_request)
    return llm


def _int8_weights(model: Path, config: EngineConfig) -> bool:
    """Whether the linear layers will hold int8 weights: quantization="int8", or a GGUF file
    whose layers are Q8_0 (its metadata read, not its tensors)."""
    if config.quantization == "int8":
        return True
    return is_gguf_file(model) and has_q8_0_layers(model)


def _params_iterator(
    sampling_params: object, total: int | None, check: Callable[[SamplingParams], None]
) -> Iterator[SamplingParams]:
    """Validated before any work: types, count, and what this engine can serve."""
    if sampling_params is None:
        return itertools.repeat(SamplingParams())
    if isinstance(sampling_params, SamplingParams):
        check(sampling_params)
        return itertools.repeat(sampling_params)
    if isinstance(sampling_params, (list, tuple)):
        if total is not None and len(sampling_params) != total:
            raise ValueError(
                f"sampling_params has {len(sampling_params)} entries but there are {total} prompts; "
                "give one SamplingParams or one per prompt"
            )
        for index, params in enumerate(sampling_params):
            if not isinstance(params, SamplingParams):
                raise TypeError(f"sampling_params[{index}] must be a SamplingParams, got {type(params).__name__}")
            try:
                check(params)
            except ValueError as exc:
                raise ValueError(f"sampling_params[{index}]: {exc}") from exc
        return iter(sampling_params)
    raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}")


def _lora_iterator(
    lora_request: object, total: int | None, load: Callable[[LoRARequest], None]
) -> Iterator[LoRARequest | None]:
    """Every adapter named, read and checked before any work (``load``: LLMEngine.load_lora)."""
    if lora_request is None:
        return itertools.repeat(None)
    if isinstance(lora_request, LoRARequest):
        load(lora_request)
        return itertools.repeat(lora_request)
    if not isinstance(lora_request, (list, tuple)):
        raise TypeError(f"lora_request must be a LoRARequest, a list of them (None for the base model) or None, "
                        f"got {type(lora_request).__name__}")
    if total is not None and len(lora_request) != total:
        raise ValueError(f"lora_request has {len(lora_request)} entries but there are {total} prompts; "
                         "give one LoRARequest or one per prompt")
    for index, request in enumerate(lora_request):
        if request is not None and not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request[{index}] must be a LoRARequest or None, got {type(request).__name__}")
        if request is not None:
            try:
                load(request)
            except ValueError as exc:
                raise ValueError(f"lora_request[{index}]: {exc}") from exc
    return iter(lora_request)


def _in_input_order(outputs: list[RequestOutput]) -> list[RequestOutput]:
    return sorted(outputs, key=lambda output: int(output.request_id))


def _error_output(request_id: int, item: object, message: str) -> RequestOutput:
    return RequestOutput(
        request_id=str(request_id),
        prompt=item if isinstance(item, str) else None,
        prompt_token_ids=[],
        outputs=[],
        finished=True,
        metrics=RequestMetrics(arrival_time=time.time(), finished_time=time.time()),
        error=message,
    )


class _Progress:
    """tqdm bar over finished prompts with input and output tokens per second."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        self.bar = tqdm(total=total, desc="Generating", unit="prompt", disable=not enabled, dynamic_ncols=True)
        self.start = time.perf_counter()
        self.input_tokens = 0
        self.output_tokens = 0

    def close(self) -> None:
        self.bar.close()

    def update(self, output: RequestOutput) -> None:
        self.input_tokens += len(output.prompt_token_ids)
        self.output_tokens += sum(len(c.token_ids) for c in output.outputs)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"in {self.input_tokens / elapsed:.0f} tok/s, out {self.output_tokens / elapsed:.0f} tok/s", refresh=False
        )
        self.bar.update(1)
