"""SamplingParams with vLLM's field names, defaults and meaning; fields Kestrel does not implement are refused by name
when set to anything but their neutral value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: every token
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # the sampled token's log-probability and this many top alternatives; -1: all
    prompt_logprobs: int | None = None  # each prompt token's log-probability and this many alternatives; -1: all
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    best_of: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logits_processors: list[Any] | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: Any = None
    guided_decoding: Any = None
    extra_args: dict[str, Any] | None = field(default=None)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < -1:
                raise ValueError(f"{name} must be non-negative or -1 (all), got {value}.")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True.")
        if self.best_of is not None and self.best_of != self.n:
            raise NotImplementedError("best_of: best-of sampling is not implemented in Kestrel (it must equal n)")
        unsupported = {
            "min_tokens": self.min_tokens != 0,
            "logit_bias": bool(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids is not None,
            "bad_words": bool(self.bad_words),
            "logits_processors": bool(self.logits_processors),
            "truncate_prompt_tokens": self.truncate_prompt_tokens is not None,
            "structured_outputs": self.structured_outputs is not None,
            "guided_decoding": self.guided_decoding is not None,
            "spaces_between_special_tokens": not self.spaces_between_special_tokens,
        }
        for name, set_ in unsupported.items():
            if set_:
                raise NotImplementedError(f"SamplingParams.{name} is not implemented in Kestrel")

    def clone(self) -> "SamplingParams":
        from copy import deepcopy

        return deepcopy(self)
