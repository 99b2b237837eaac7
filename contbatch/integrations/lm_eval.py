"""contbatch as an lm-evaluation-harness backend, registered as ``contbatch``.

    contbatch eval --model_args pretrained=DIR,dtype=auto --tasks TASKS [any lm_eval flag]

or from Python::

    import contbatch.integrations.lm_eval  # registers the model
    lm_eval.simple_evaluate(model="contbatch", model_args="pretrained=DIR", tasks=[...])

Requests are tokenised, windowed and truncated exactly as lm-eval's own ``hf`` backend
does it, so scores agree with it; what differs is how they run. Every request of a call
goes to the engine at once (continuous batching; lm-eval's ``batch_size`` is accepted and
ignored), and log-likelihood pairs that share a context prefill it once through the prefix
cache (``LLM.loglikelihood``). Needs ``pip install contbatch[eval]``.
"""

import logging
import sys
from collections.abc import Sequence

import torch

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    _add_special_kwargs,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from contbatch.llm import LLM
from contbatch.lora.request import LoRARequest
from contbatch.sampling_params import SamplingParams

# Generation kwargs of lm-eval tasks that map onto SamplingParams fields of the same name.
_SAMPLING_KWARGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
# Accepted for compatibility with the CLI's flags, with no effect: the scheduler sizes
# batches by its token budget, not by a request count.
_IGNORED_ARGS = ("batch_size", "max_batch_size")

logger = logging.getLogger(__name__)

TokenPair = tuple[list[int], list[int]]
_LM_EVAL_SUBCOMMANDS = ("run", "ls", "validate")


@register_model("contbatch")
class ContbatchLM(TemplateLM):
    """lm-eval's model interface over one ``contbatch.LLM``.

    Args (``--model_args``): ``pretrained`` (model directory), ``max_length`` (lm-eval's
    context length; the engine gets two tokens more, the scored token's successor and the
    one generated token a scoring request needs), ``max_gen_toks`` (default 256, as ``hf``),
    ``add_bos_token`` and ``prefix_token_id`` (as ``hf``), ``lora_local_path`` (a PEFT LoRA
    adapter directory every request runs with, as in lm-eval's ``vllm`` backend; ``hf`` calls
    it ``peft``), and any ``LLM`` keyword (``dtype``, ``device``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``kv_cache_memory``, ``enable_prefix_caching``, ``seed``,
    ``max_lora_rank``).
    """

    def __init__(
        self,
        pretrained: str,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        lora_local_path: str | None = None,
        **llm_kwargs: object,
    ) -> None:
        super().__init__()
        self.lora_request = None if lora_local_path is None else LoRARequest("lm-eval", 1, str(lora_local_path))
        if self.lora_request is not None:
            llm_kwargs.setdefault("enable_lora", True)
        for name in _IGNORED_ARGS:
            llm_kwargs.pop(name, None)
        llm_kwargs["device"] = _engine_device(llm_kwargs.get("device"))
        if max_length is not None:
            llm_kwargs["max_model_len"] = int(max_length) + 2
        self.llm = LLM(pretrained, **llm_kwargs)
        if self.lora_request is not None:  # a bad adapter is refused here, before any request
            self.llm.engine.load_lora(self.lora_request)
        self.tokenizer = self.llm.get_tokenizer()
        if self.tokenizer is None:
            raise ValueError("the contbatch lm-eval backend needs the model's tokenizer")
        self._max_length = int(max_length) if max_length is not None else self.llm.engine.max_model_len - 2
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id

    # -- what lm-eval asks of a model ---------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context or a rolling window's first prediction conditions on."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: object) -> list[int]:
        """As the hf backend encodes: the tokenizer's own special tokens unless told, and no
        second BOS on a string (a rendered chat template) that already starts with one."""
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        return self.tokenizer.encode(string, **special)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(summed log-probability, is_greedy) of each (cache key, context ids, continuation ids)."""
        pairs = [self._truncated_pair(context, continuation) for _, context, continuation in requests]
        results = [(out.logprob, out.is_greedy) for out in self._score(pairs)]
        for (cache_key, _, _), answer in zip(requests, results):
            if cache_key is not None:  # rolling windows are cached per document instead
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood, scored in the hf backend's disjoint windows of at most
        ``max_length`` tokens; all windows of all documents go to the engine together."""
        windows: list[tuple[None, list[int], list[int]]] = []
        counts: list[int] = []
        for (text,) in (request.args for request in requests):
            document = [(None, *make_disjoint_window(w)) for w in self._rolling_windows(self.tok_encode(text))]
            windows.extend(document)
            counts.append(len(document))
        scores = [logprob for logprob, _ in self._loglikelihood_tokens(windows)]
        totals, start = [], 0
        for request, count in zip(requests, counts):
            totals.append(sum(scores[start : start + count]))
            start += count
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, totals[-1])
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Every request's completion, cut at its first ``until`` string, in request order."""
        eos = self.tokenizer.decode(self.eot_token_id)
        prompts, stops = [], []
        for context, gen_kwargs in (request.args for request in requests):
            params, until = self._sampling_params(gen_kwargs, eos)
            prompts.append({"prompt_token_ids": self._generation_context(context, params.max_tokens), "sampling_params": params})
            stops.append(until)
        outputs = self.llm.generate(prompts, use_tqdm=not disable_tqdm, lora_request=self.lora_request)
        texts = []
        for request, output, until in zip(requests, outputs, stops):
            if output.error is not None:
                raise RuntimeError(f"contbatch could not run a generate_until request: {output.error}")
            texts.append(postprocess_generated_text(output.outputs[0].text, until, None))
            self.cache_hook.add_partial("generate_until", request.args, texts[-1])
        return texts

    # -- the hf backend's rules, applied to token ids ---------------------------------------------

    def _rolling_windows(self, token_ids: list[int]) -> list[TokenPair]:
        return list(get_rolling_token_windows(token_ids, self.prefix_token_id, self.max_length, context_len=1))

    def _truncated_pair(self, context: list[int], continuation: list[int]) -> TokenPair:
        """At most ``max_length`` + 1 tokens, dropped from the left of the context (as hf)."""
        excess = len(context) + len(continuation) - (self.max_length + 1)
        if excess <= 0:
            return list(context), list(continuation)
        if excess >= len(context):
            raise ValueError(
                f"a continuation of {len(continuation)} tokens does not fit max_length={self.max_length}"
            )
        return list(context[excess:]), list(continuation)

    def _generation_context(self, context: str, max_tokens: int) -> list[int]:
        """The context's ids, left-truncated to leave ``max_tokens`` for the completion (as hf)."""
        room = self.max_length - max_tokens
        if room <= 0:
            raise ValueError(f"max_gen_toks={max_tokens} leaves no room for a context within max_length={self.max_length}")
        return self.tok_encode(context)[-room:]

    def _sampling_params(self, gen_kwargs: dict, eos: str) -> tuple[SamplingParams, list[str]]:
        """SamplingParams for one request's generation kwargs, and its stop strings (EOS included,
        as lm-eval cuts at it). A kwarg with no SamplingParams field is refused by name."""
        if not isinstance(gen_kwargs, dict):
            raise TypeError(f"generation kwargs must be a dict, got {type(gen_kwargs).__name__}")
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_tokens = int(kwargs.pop("max_gen_toks"))
        do_sample = bool(kwargs.pop("do_sample", False))
        unknown = sorted(set(kwargs) - set(_SAMPLING_KWARGS))
        if unknown:
            raise ValueError(
                f"generation kwargs {unknown} have no contbatch equivalent; supported: "
                f"until, max_gen_toks, do_sample, {', '.join(_SAMPLING_KWARGS)}"
            )
        if not do_sample:
            kwargs["temperature"] = 0.0
        stop = [s for s in until if s and s != eos]  # EOS ends a request as a token already
        return SamplingParams(max_tokens=max_tokens, stop=stop or None, **kwargs), until

    def _score(self, pairs: Sequence[TokenPair]) -> list:
        outputs = self.llm.loglikelihood(pairs, self.lora_request) if pairs else []
        failed = next((o.error for o in outputs if o.error is not None), None)
        if failed is not None:
            raise RuntimeError(f"contbatch could not score a loglikelihood request: {failed}")
        return outputs


def _engine_device(device: object) -> str:
    """The LLM device for lm-eval's ``device``. lm-eval's CLI passes "cuda:0" unless told
    otherwise, on machines with no GPU too; there, as its hf backend does, run on the CPU."""
    if device is None or device == "auto":
        return "auto"
    name, _, index = str(device).partition(":")
    if name not in ("cpu", "cuda") or index not in ("", "0"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:0' (one GPU), got {device!r}")
    if name == "cuda" and not torch.cuda.is_available():
        logger.warning("device=%r but no CUDA GPU is available: running on the CPU", device)
        return "cpu"
    return name


def main(argv: list[str]) -> int:
    """``contbatch eval ARGS``: lm-eval's own command line (``run``, ``ls``, ``validate``, or its
    legacy flags-only form) with this backend registered and ``--model contbatch`` the default."""
    from lm_eval.__main__ import cli_evaluate

    args = list(argv)
    subcommand = args.pop(0) if args and args[0] in _LM_EVAL_SUBCOMMANDS else "run"
    if subcommand == "run" and "--model" not in args and not any(a.startswith("--model=") for a in args):
        args = ["--model", "contbatch", *args]
    sys.argv = ["lm-eval", subcommand, *args]
    cli_evaluate()
    return 0
