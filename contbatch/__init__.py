"""contbatch: offline batched LLM generation with continuous batching and a paged KV cache."""

from contbatch.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from contbatch.jobs import run_job
from contbatch.llm import LLM
from contbatch.lora import LoRARequest
from contbatch.outputs import (
    CompletionOutput, GenerationCancelled, GenerationInterrupted, RequestMetrics, RequestOutput,
)
from contbatch.prompt_queue import PromptQueue
from contbatch.sampling_params import SamplingParams
from contbatch.scoring import LabelScores, LoglikelihoodOutput

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "GenerationInterrupted",
    "GenerationCancelled", "run_job",
    "LoglikelihoodOutput", "LabelScores", "PromptQueue", "LoRARequest",
    "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
]
__version__ = "0.1.0"
