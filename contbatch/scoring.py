"""Scoring continuations: log-likelihoods (lm-eval's ``loglikelihood``) and label probabilities.

A (context, continuation) pair runs as one request over context + continuation with
prompt logprobs from the first continuation position, so only the continuation is scored
and the context's full KV blocks may come from the prefix cache. Pairs sharing a context
are admitted in two waves: the first pair of each context, then the others, which find
the context in the prefix cache and compute only its last partial block and their own
tokens; 5 labels for one prompt cost one prefill of it, not 5. A window of contexts at a
time keeps the waves' blocks within the cache's reserve of freed blocks.
"""

import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from contbatch.outputs import RequestOutput


@dataclass
class LoglikelihoodOutput:
    """One continuation's score given its context.

    Attributes:
        logprob: the continuation's summed log-probability (natural log).
        token_logprobs: each continuation token's log-probability.
        is_greedy: greedy decoding from the context would produce exactly the continuation
            (every token ranks first; a token tied with a lower id also counts).
        continuation_token_ids: the continuation's tokens as scored.
        num_cached_tokens: context tokens reused from the prefix cache.
        error: why the pair could not run (the other fields are then empty).
    """

    logprob: float
    token_logprobs: list[float]
    is_greedy: bool
    continuation_token_ids: list[int]
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass
class LabelScores:
    """A prompt's labels: ``probs`` are their probabilities normalised over the labels given
    (from each label's summed log-likelihood), ``label`` the most probable one."""

    label: str
    probs: dict[str, float]
    logprobs: dict[str, float]


def tokenize_pair(tokenizer: PreTrainedTokenizerBase | None, context: object, continuation: object) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids). Strings are split as lm-eval splits them: trailing
    spaces of the context move to the continuation, and the continuation's ids are those of
    the whole text after the context's. Where the context's last tokens are not the whole
    text's (the continuation merges with them: "hello wor" + "ld" is "hello" + " world"),
    the split moves back to the last token both share, so the token spanning the boundary
    is scored whole; lm-eval's split would score the context's tokens against the wrong
    continuation, or none at all (log-probability 0)."""
    if isinstance(context, str) and isinstance(continuation, str):
        if tokenizer is None:
            raise ValueError("text pairs need a tokenizer; this LLM was built with skip_tokenizer_init=True")
        if not context:
            raise ValueError("context is empty (score from the EOS token by giving its id as a one-token context)")
        if not continuation:
            raise ValueError("continuation is empty")
        spaces = len(context) - len(context.rstrip())
        if spaces and spaces < len(context):
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        context_ids = tokenizer(context).input_ids
        whole = tokenizer(context + continuation).input_ids
        shared = _common_prefix_length(context_ids, whole)
        if shared == 0:
            raise ValueError(
                f"the continuation merges with every token of the context ({context!r} + {continuation!r} "
                "shares no leading token with the context alone), so no token of it can be scored after the "
                "context; give (context, continuation) as token-id lists"
            )
        if shared == len(whole):
            raise ValueError(f"the continuation {continuation!r} adds no token to the context")
        return list(whole[:shared]), list(whole[shared:])
    if _is_token_list(context) and _is_token_list(continuation):
        if not context or not continuation:
            raise ValueError("context and continuation token lists must be non-empty")
        return list(context), list(continuation)
    raise TypeError(
        f"a pair is (context, continuation), both str or both lists of token ids; got "
        f"({type(context).__name__}, {type(continuation).__name__})"
    )


def admission_waves(contexts: Sequence[tuple[int, ...]], sizes: Sequence[int], budget: int) -> Iterator[list[int]]:
    """Pair indices in the order to admit them: per window of contexts whose first pairs take
    at most ``budget`` units (``sizes[i]`` per pair), their first pairs, then the others."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, context in enumerate(contexts):
        groups.setdefault(context, []).append(index)
    window: list[list[int]] = []
    used = 0
    for members in groups.values():
        if window and used + sizes[members[0]] > budget:
            yield from _waves(window)
            window, used = [], 0
        window.append(members)
        used += sizes[members[0]]
    if window:
        yield from _waves(window)


def _waves(window: list[list[int]]) -> Iterator[list[int]]:
    yield [members[0] for members in window]
    rest = [index for members in window for index in members[1:]]
    if rest:
        yield rest


def loglikelihood_output(output: RequestOutput, num_context_tokens: int) -> LoglikelihoodOutput:
    if output.error is not None:
        return LoglikelihoodOutput(float("nan"), [], False, [], error=output.error)
    continuation = output.prompt_token_ids[num_context_tokens:]
    entries = output.prompt_logprobs[num_context_tokens:]
    scored = [entry[token] for entry, token in zip(entries, continuation)]
    token_logprobs = [s.logprob for s in scored]
    return LoglikelihoodOutput(
        logprob=math.fsum(token_logprobs),
        token_logprobs=token_logprobs,
        is_greedy=all(s.rank == 1 for s in scored),
        continuation_token_ids=continuation,
        num_cached_tokens=output.num_cached_tokens,
    )


def repeated_pair_output(scored: LoglikelihoodOutput, num_context_tokens: int) -> LoglikelihoodOutput:
    """The result of a pair identical to one already scored: its own copy, nothing computed."""
    return dataclasses.replace(
        scored,
        token_logprobs=list(scored.token_logprobs),
        continuation_token_ids=list(scored.continuation_token_ids),
        num_cached_tokens=num_context_tokens if scored.error is None else 0,
    )


def label_scores(labels: list[str], outputs: list[LoglikelihoodOutput]) -> LabelScores:
    logprobs = {label: out.logprob for label, out in zip(labels, outputs)}
    top = max(logprobs.values())
    weights = {label: math.exp(value - top) for label, value in logprobs.items()}
    total = math.fsum(weights.values())
    probs = {label: weight / total for label, weight in weights.items()}
    return LabelScores(label=max(labels, key=lambda label: logprobs[label]), probs=probs, logprobs=logprobs)


def check_labels(labels: object) -> list[str]:
    if isinstance(labels, str) or not isinstance(labels, (list, tuple)) or not labels:
        raise TypeError(f"labels must be a non-empty list of strings, got {labels!r}")
    if not all(isinstance(label, str) and label for label in labels):
        raise ValueError(f"labels must be non-empty strings, got {labels!r}")
    if len(set(labels)) != len(labels):
        raise ValueError(f"labels must be distinct, got {labels!r}")
    return list(labels)


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _is_token_list(value: object) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
