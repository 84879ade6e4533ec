"""The results of LLM.generate (vLLM's RequestOutput, CompletionOutput and Logprob) and of LLM.score."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # how many tokens are at least as likely (1: the most likely)
    decoded_token: str | None = None


# Per position: {token id: Logprob}, the token of that position first, then the top alternatives.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list["dict[int, Logprob] | None"]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclass
class ScoreOutput:
    """The teacher-forced log-probabilities of one sequence: token_ids[i] = prompt_token_ids[start + i], each scored
    given every token before it, by the same engine path and kernels as generation."""

    request_id: str
    prompt_token_ids: list[int]
    start: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: SampleLogprobs | None = field(default=None)

    @property
    def cumulative_logprob(self) -> float:
        return float(sum(self.logprobs))
