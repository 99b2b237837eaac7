"""Run llama.cpp (llama-cpp-python) on one benchmark job, one request at a time (its Python
API has no continuous batching), in a venv of its own: llama-cpp-python compiles llama.cpp
and pins nothing contbatch's environment has.

Started by llama_cpp_q8.py as ``<venv>/bin/python -I _llama_cpp_child.py JOB.json RESULT.json``.
Self-contained: the standard library and llama_cpp only.

JOB: {"model": path to a GGUF file, "threads": n, "n_ctx": n, "requests": [[prompt_token_ids, max_tokens], ...]}.
RESULT: {"wall_s", "ttft_s": [...], "token_ids": [[...], ...], "version"}; greedy, EOS ignored.
"""

import json
import sys
import time


def greedy(llm, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    """The first max_tokens greedy tokens (EOS does not stop it) and the time to the first."""
    llm.reset()
    start, first, tokens = time.perf_counter(), 0.0, []
    for token in llm.generate(prompt_ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        if not tokens:
            first = time.perf_counter() - start
        tokens.append(token)
        if len(tokens) == max_tokens:
            break
    return tokens, first


def main(job_path: str, result_path: str) -> None:
    import llama_cpp

    job = json.loads(open(job_path).read())
    llm = llama_cpp.Llama(job["model"], n_ctx=job["n_ctx"], n_threads=job["threads"], n_batch=512, verbose=False)
    greedy(llm, job["requests"][0][0], 2)  # warm-up
    start, ttft, token_ids = time.perf_counter(), [], []
    for prompt_ids, max_tokens in job["requests"]:
        tokens, first = greedy(llm, prompt_ids, max_tokens)
        token_ids.append(tokens)
        ttft.append(first)
    result = {"wall_s": time.perf_counter() - start, "ttft_s": ttft, "token_ids": token_ids,
              "version": llama_cpp.__version__}  # fmt: skip
    open(result_path, "w").write(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
