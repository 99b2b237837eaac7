"""A job that hangs part-way, for test_crash to SIGKILL: run_job with the settings of test_crash's
command line, and either an ``on_result`` hook that, after the job's Nth result, appends half of
that result's line again to the results (or journal) file, the torn line a kill mid-write leaves,
and sleeps; or, with ``rename``, a sleep just before the finished Parquet file is renamed into place.
Before it sleeps it creates OUTPUT.hanging (``hanging_marker``): the file's own state cannot say
when to kill, since a normal write crossing a page boundary is briefly seen half done.

    python -m tests.jobs.hanging_job INPUT OUTPUT MODEL N|rename
"""

import os
import sys
import time
from pathlib import Path

from contbatch import SamplingParams
from contbatch.jobs import run_job
from contbatch.jobs.output import detect_output_format, encode_line, journal_path


def hanging_marker(output: Path) -> Path:
    return output.with_name(output.name + ".hanging")


def hang(output: Path) -> None:
    hanging_marker(output).touch()
    time.sleep(3600)


def hang_after(count: int, results: Path, output: Path):
    written = 0

    def on_result(result: dict) -> None:
        nonlocal written
        written += 1
        if written == count:
            line = encode_line(result)
            fd = os.open(results, os.O_WRONLY | os.O_APPEND)
            os.write(fd, line[: len(line) // 2])
            os.close(fd)
            hang(output)

    return on_result


def hang_before_renaming(output: Path) -> None:
    replace = os.replace

    def hanging(source, destination) -> None:
        if Path(destination) == output:
            hang(output)
        replace(source, destination)

    os.replace = hanging


if __name__ == "__main__":
    input_path, output, model, when = sys.argv[1:]
    output = Path(output)
    on_result = None
    if when == "rename":
        hang_before_renaming(output)
    else:
        on_result = hang_after(int(when), journal_path(output, detect_output_format(output, "auto")), output)
    run_job(
        input_path, output, model=model, sampling_params=SamplingParams(temperature=0, max_tokens=8),
        llm_kwargs={"dtype": "float32", "max_num_seqs": 16}, fsync_every=50, on_result=on_result,
    )
