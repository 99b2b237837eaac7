"""A job that tears its output and hangs, for test_crash to SIGKILL: run_job with the settings of
test_crash's command line, and an ``on_result`` hook that, after the job's Nth result, appends half
of that result's line again (the torn line a kill mid-write leaves) and sleeps.

    python -m tests.jobs.hanging_job INPUT OUTPUT MODEL N
"""

import os
import sys
import time

from contbatch import SamplingParams
from contbatch.jobs import run_job
from contbatch.jobs.output import encode_line


def hang_after(count: int, output: str):
    written = 0

    def on_result(result: dict) -> None:
        nonlocal written
        written += 1
        if written == count:
            line = encode_line(result)
            fd = os.open(output, os.O_WRONLY | os.O_APPEND)
            os.write(fd, line[: len(line) // 2])
            os.close(fd)
            time.sleep(3600)

    return on_result


if __name__ == "__main__":
    input_path, output, model, count = sys.argv[1:]
    run_job(
        input_path, output, model=model, sampling_params=SamplingParams(temperature=0, max_tokens=8),
        llm_kwargs={"dtype": "float32", "max_num_seqs": 16}, fsync_every=50, on_result=hang_after(int(count), output),
    )
