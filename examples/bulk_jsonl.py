"""Bulk job: answer a JSONL file of chat questions with the demo model, resumably.

Writes questions.jsonl (200 questions), then runs ``contbatch.jobs.run_job`` over it
into answers.jsonl. Press Ctrl-C at any time and run the script again: it carries on
where it stopped, and no answer is lost or written twice. The same job on the command
line:

    contbatch generate -i questions.jsonl -o answers.jsonl --messages-field messages \\
        --temperature 0 --max-tokens 64 --max-model-len 1024

    python examples/bulk_jsonl.py [workdir]
"""

import json
import sys
from pathlib import Path

from contbatch import SamplingParams
from contbatch.jobs import run_job

TOPICS = ["the sea", "a hash table", "photosynthesis", "the moon", "compound interest", "a bicycle", "rain", "chess"]


def write_questions(path: Path, count: int = 200) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for index in range(count):
            question = f"In one sentence, what is {TOPICS[index % len(TOPICS)]}? (#{index})"
            record = {"id": f"q{index:04d}", "messages": [{"role": "user", "content": question}]}
            if index % 10 == 0:
                record["sampling_params"] = {"max_tokens": 16}  # a per-line override of the job's sampling
            out.write(json.dumps(record) + "\n")


def main() -> int:
    workdir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    questions, answers = workdir / "questions.jsonl", workdir / "answers.jsonl"
    if not questions.exists():
        write_questions(questions)
    summary = run_job(
        questions,
        answers,
        messages_field="messages",
        sampling_params=SamplingParams(temperature=0, max_tokens=64),
        llm_kwargs={"max_model_len": 1024},
        use_tqdm=True,
    )
    print(summary.line(), file=sys.stderr)
    with open(answers, encoding="utf-8") as results:
        for line, _ in zip(results, range(3)):
            record = json.loads(line)
            print(record["id"], record["outputs"][0]["text"].strip())
    return 0 if summary.status == "done" else 130


if __name__ == "__main__":
    sys.exit(main())
