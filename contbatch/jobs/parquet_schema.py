"""The Parquet form of result objects: typed columns that mirror the JSONL results.

    id            int64 when every id is an integer (that fits), else string (integers as decimals)
    outputs       list<struct<text: string, finish_reason: string, stop_reason: string,
                  completion_tokens: int64, [logprobs, cumulative_logprob, ...]>>
    prompt_tokens, completion_tokens   int64
    fingerprint   struct<prompt: string, sampling: string>
    prompt_logprobs  list<map<int64 token id, struct<logprob, rank, decoded_token>>>, null for
                  the first token; only when some result has them

A stop token id in ``stop_reason`` becomes its decimal string (a column has one type).
The completion fields after ``completion_tokens`` are there only when some result has them:
``logprobs`` as list<map<int64 token id, struct<logprob, rank, decoded_token>>>,
``cumulative_logprob`` as double, and any other as its JSON text.
"""

import json
from collections.abc import Iterable
from types import ModuleType

_INT64 = range(-(2**63), 2**63)
_COMPLETION_FIELDS = ("text", "finish_reason", "stop_reason", "completion_tokens")


def ids_fit_int64(ids: Iterable) -> bool:
    """Whether an int64 id column can hold every id."""
    return all(isinstance(record_id, int) and record_id in _INT64 for record_id in ids)


def results_schema(pyarrow: ModuleType, int_ids: bool, completion_fields: Iterable[str],
                   prompt_logprobs: bool = False):
    """The schema of a results file whose completions have ``completion_fields`` (besides the
    four always there), with a prompt_logprobs column if some result has them."""
    known = _known_completion_types(pyarrow)
    extra = [name for name in known if name in completion_fields and name not in _COMPLETION_FIELDS]
    extra += sorted(set(completion_fields) - set(known))
    completion = pyarrow.struct([(name, known.get(name, pyarrow.string())) for name in (*_COMPLETION_FIELDS, *extra)])
    columns = [
        ("id", pyarrow.int64() if int_ids else pyarrow.string()),
        ("outputs", pyarrow.list_(completion)),
        ("prompt_tokens", pyarrow.int64()),
        ("completion_tokens", pyarrow.int64()),
        ("fingerprint", pyarrow.struct([("prompt", pyarrow.string()), ("sampling", pyarrow.string())])),
    ]
    if prompt_logprobs:
        columns.append(("prompt_logprobs", known["logprobs"]))
    return pyarrow.schema(columns)


def arrow_row(result: dict, int_ids: bool) -> dict:
    """A JSONL result object as a row of ``results_schema``."""
    row = dict(result, outputs=[_completion_row(completion) for completion in result["outputs"]])
    if not int_ids:
        row["id"] = str(row["id"])
    if "prompt_logprobs" in row:
        row["prompt_logprobs"] = _logprobs_row(row["prompt_logprobs"])
    return row


def _logprobs_row(positions: list[dict | None]) -> list[list[tuple] | None]:
    """JSON made the token ids strings; the map keys are integers. A null position stays null."""
    return [None if position is None else [(int(token), logprob) for token, logprob in position.items()]
            for position in positions]


def _completion_row(completion: dict) -> dict:
    row = {}
    for name, value in completion.items():
        if value is None or name in ("text", "finish_reason", "completion_tokens", "cumulative_logprob"):
            row[name] = value
        elif name == "stop_reason":
            row[name] = str(value)
        elif name == "logprobs":
            row[name] = _logprobs_row(value)
        else:
            row[name] = json.dumps(value, ensure_ascii=False)
    return row


def _known_completion_types(pyarrow: ModuleType) -> dict:
    """The types of the completion fields contbatch writes, in the order a result has them."""
    logprob = pyarrow.struct([("logprob", pyarrow.float64()), ("rank", pyarrow.int64()),
                              ("decoded_token", pyarrow.string())])
    return {
        "text": pyarrow.string(), "finish_reason": pyarrow.string(), "stop_reason": pyarrow.string(),
        "completion_tokens": pyarrow.int64(), "logprobs": pyarrow.list_(pyarrow.map_(pyarrow.int64(), logprob)),
        "cumulative_logprob": pyarrow.float64(),
    }
