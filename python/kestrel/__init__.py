"""Kestrel's Python API: LLM (vLLM's interface: generate with SamplingParams, prompt log-probabilities) and
LLM.score (teacher-forced log-probabilities through the engine that generates). See docs/python.md."""

from .llm import LLM, Tokenizer
from .lora_request import LoRARequest
from .outputs import CompletionOutput, Logprob, RequestOutput, ScoreOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "ScoreOutput", "Tokenizer"]
