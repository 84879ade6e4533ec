"""kestrel.LLM: offline inference in this process, with vLLM's LLM interface (constructor arguments, generate,
SamplingParams, RequestOutput), plus score: the teacher-forced log-probability of every given token of a sequence,
through the same engine path and kernels as generation (the trainer side of a zero-mismatch RL loop)."""

from __future__ import annotations

import itertools
import json
import os
import random
from collections.abc import Sequence
from typing import Any, Union

from . import _kestrel
from .lora_request import LoRARequest
from .outputs import CompletionOutput, Logprob, RequestOutput, ScoreOutput
from .sampling_params import SamplingParams

# A prompt as vLLM's generate takes it: text, or a dict with "prompt" (text) or "prompt_token_ids".
PromptType = Union[str, dict]

# vLLM's LLM arguments Kestrel does not implement yet, with the value that means "not used" and what is missing.
_NOT_YET = {
    "tensor_parallel_size": (1, "tensor parallelism needs the NCCL backend, which is not built yet"),
    "pipeline_parallel_size": (1, "pipeline parallelism is not implemented"),
    "enable_sleep_mode": (False, "sleep mode (releasing and restoring the GPU's weights and cache) is not "
                                 "implemented yet"),
    "quantization": (None, "on-the-fly quantization is not implemented (FP8 / MXFP4 checkpoints load as they are)"),
    "cpu_offload_gb": (0, "CPU offload of weights is not implemented"),
}
# vLLM arguments that have no effect here (what they control is fixed or does not exist in Kestrel).
_NO_EFFECT = {"trust_remote_code", "enforce_eager", "disable_log_stats", "tokenizer_mode", "swap_space",
              "compilation_config", "disable_custom_all_reduce"}


def _env_batch_invariant() -> bool:
    return any(os.environ.get(k, "0") not in ("", "0") for k in ("VLLM_BATCH_INVARIANT", "KESTREL_BATCH_INVARIANT"))


class Tokenizer:
    """The model's tokenizer (tokenizer.json or tiktoken), as LLM.get_tokenizer() returns it."""

    def __init__(self, session: Any):
        self._session = session
        self.eos_token_id = session.eos_token_id
        self.vocab_size = session.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._session.encode(text, add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._session.decode(list(token_ids), skip_special_tokens)


class LLM:
    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        seed: int | None = 0,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool | None = None,
        block_size: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        kv_cache_dtype: str = "auto",
        index_cache_dtype: str = "fp8",
        device: str = "auto",
        gpu_memory_utilization: float = 0.9,
        batch_invariant: bool | None = None,
        scheduling_policy: str = "fcfs",
        max_logprobs: int = 20,
        dtype: str = "auto",
        load_format: str = "auto",
        hf_overrides: dict | None = None,
        speculative_config: dict | None = None,
        enable_lora: bool = False,
        max_lora_rank: int = 16,
        max_loras: int = 1,
        **kwargs: Any,
    ):
        for name, value in kwargs.items():
            if name in _NOT_YET:
                neutral, why = _NOT_YET[name]
                if value != neutral:
                    raise NotImplementedError(f"LLM({name}={value!r}): {why}")
            elif name not in _NO_EFFECT:
                raise TypeError(f"LLM() got an unexpected keyword argument '{name}'")
        if tokenizer is not None and os.path.abspath(tokenizer) != os.path.abspath(model):
            raise NotImplementedError("tokenizer: Kestrel reads the tokenizer of the model directory; a separate one "
                                      "is not supported")
        if dtype not in ("auto", "bfloat16"):
            raise NotImplementedError(f"dtype={dtype!r}: the weights run in the checkpoint's formats ('auto')")
        if load_format not in ("auto", "safetensors", "dummy"):
            raise NotImplementedError(f"load_format={load_format!r}: Kestrel loads safetensors checkpoints or "
                                      "dummy weights")
        if batch_invariant is None:
            batch_invariant = _env_batch_invariant()
        options = {
            "device": device,
            "gpu_memory_utilization": gpu_memory_utilization,
            "kv_cache_dtype": kv_cache_dtype,
            "index_cache_dtype": index_cache_dtype,
            "batch_invariant": bool(batch_invariant),
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "block_size": block_size,
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "enable_prefix_caching": True if enable_prefix_caching is None else enable_prefix_caching,
            "scheduling_policy": scheduling_policy,
            "load_format": load_format,
            "hf_overrides": json.dumps(hf_overrides or {}),
            # vLLM's dict (method, num_speculative_tokens, prompt_lookup_min/max, ...), checked as
            # --speculative-config is: an error names the field. Runs on the CPU (ngram, mtp, dspark).
            "speculative_config": json.dumps(speculative_config) if speculative_config else None,
        }
        if enable_lora and not 1 <= max_lora_rank <= 64:
            raise ValueError(f"max_lora_rank must be in [1, 64], got {max_lora_rank}")
        if enable_lora and max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.model = model
        self.enable_lora = bool(enable_lora)
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self._loras: dict[int, str] = {}  # loaded adapters: id -> path
        self.batch_invariant = bool(batch_invariant)
        self.max_logprobs = max_logprobs
        self._session = _kestrel.Session(model, options)
        self._seeds = random.Random(seed)
        self._ids = itertools.count()

    @property
    def max_model_len(self) -> int:
        return self._session.max_model_len

    def get_tokenizer(self) -> Tokenizer:
        return Tokenizer(self._session)

    def reset_prefix_cache(self) -> bool:
        return self._session.reset_prefix_cache()

    def stats(self) -> dict:
        """Engine counters: steps, computed and generated tokens, preemptions, prefix-cache hit tokens, and the
        speculative-decoding counters (drafts, draft tokens, accepted tokens)."""
        return self._session.stats()

    # -- LoRA ---------------------------------------------------------------------------------------------------

    def load_lora(self, lora_request: LoRARequest) -> None:
        """(Re)loads the adapter at lora_request.lora_path as lora_request.lora_int_id: new weights for an id already
        loaded replace the old ones (the RL weight sync); prefixes cached under the old weights are not reused."""
        self._check_lora(lora_request)
        self._session.load_lora(lora_request.lora_int_id, lora_request.lora_path, self.max_lora_rank)
        self._loras[lora_request.lora_int_id] = lora_request.lora_path

    def remove_lora(self, lora_int_id: int) -> bool:
        if lora_int_id not in self._loras:
            return False
        self._session.unload_lora(lora_int_id)
        del self._loras[lora_int_id]
        return True

    def list_loras(self) -> list[int]:
        return sorted(self._loras)

    def _check_lora(self, lora_request: Any) -> None:
        if not self.enable_lora:
            raise ValueError("lora_request needs LLM(enable_lora=True)")
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a kestrel.LoRARequest, got {type(lora_request)}")

    def _lora_ids(self, lora_request: Any, n: int) -> list[int]:
        """Each request's adapter id (0: none), loading adapters not loaded yet (by id, or at a new path)."""
        if lora_request is None:
            return [0] * n
        reqs = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * n
        if len(reqs) != n:
            raise ValueError("The lengths of prompts and lora_request must be the same.")
        active = {r.lora_int_id for r in reqs if r is not None}
        if len(active) > self.max_loras:
            raise ValueError(f"{len(active)} adapters in one call, more than max_loras={self.max_loras}")
        for r in reqs:
            if r is not None:
                self._check_lora(r)
                if self._loras.get(r.lora_int_id) != r.lora_path:
                    self.load_lora(r)
        return [0 if r is None else r.lora_int_id for r in reqs]

    def sleep(self, level: int = 1) -> None:
        raise NotImplementedError("sleep: releasing the GPU's weights and cache is not implemented yet")

    def wake_up(self, tags: list[str] | None = None) -> None:
        raise NotImplementedError("wake_up: sleep mode is not implemented yet")

    # -- generation ---------------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: Any = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError("The lengths of prompts and sampling_params must be the same.")
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError("The lengths of prompts and priority must be the same.")
        lora_ids = self._lora_ids(lora_request, len(prompt_list))
        texts, requests = [], []
        for i, (prompt, p) in enumerate(zip(prompt_list, params)):
            text, ids = self._prompt(prompt)
            texts.append(text)
            requests.append(self._request(ids, p, 0 if priority is None else priority[i]))
            requests[-1]["lora_id"] = lora_ids[i]
        results = self._session.generate(requests)
        return [self._request_output(text, r, p) for text, r, p in zip(texts, results, params)]

    def score(
        self,
        prompts: PromptType | list[int] | Sequence[PromptType | list[int]],
        responses: Sequence[list[int] | str] | None = None,
        *,
        top_logprobs: int = 0,
        start: int = 1,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ScoreOutput]:
        """Teacher forcing: the log-probability of every given token under the model, each given the tokens before
        it, computed by the engine that generates (same batching, cache and kernels, so a token scored from a
        rollout gets the bits the rollout sampled it with).

        With `responses`, sequence i is prompts[i] followed by responses[i] (token ids, or text encoded without
        special tokens), and the response tokens are scored; positions before them may come from the prefix cache.
        Without, every token of the prompt from position `start` (>= 1) on is scored.

        With `lora_request`, through that adapter (as generate).

        Unlike vLLM's LLM.score (cross-encoder relevance scores), this scores a generative model's tokens."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and
                                               isinstance(prompts[0], int)):
            prompts = [prompts]
        prompt_list = list(prompts)
        if responses is not None and len(responses) != len(prompt_list):
            raise ValueError("The lengths of prompts and responses must be the same.")
        if top_logprobs < 0 or top_logprobs > self.max_logprobs:
            raise ValueError(f"top_logprobs must be in [0, {self.max_logprobs}], got {top_logprobs}")
        lora_ids = self._lora_ids(lora_request, len(prompt_list))
        requests, starts = [], []
        for i, prompt in enumerate(prompt_list):
            ids = list(prompt) if isinstance(prompt, list) else self._prompt(prompt)[1]
            first = start
            if responses is not None:
                response = responses[i]
                response_ids = self._session.encode(response, False) if isinstance(response, str) else list(response)
                if not response_ids:
                    raise ValueError(f"responses[{i}] is empty: there is nothing to score")
                first = len(ids)
                ids = ids + response_ids
            if not 1 <= first < len(ids):
                raise ValueError(f"sequence {i} of {len(ids)} tokens has no token to score from position {first} "
                                 "(the first token has no context)")
            starts.append(first)
            requests.append({"prompt_token_ids": ids, "max_tokens": 0, "temperature": 0.0,
                             "prompt_logprobs": top_logprobs, "prompt_logprobs_start": first,
                             "priority": 0 if priority is None else priority[i], "lora_id": lora_ids[i]})
        out = []
        for first, r in zip(starts, self._session.generate(requests)):
            lps = r["prompt_logprobs"]
            out.append(ScoreOutput(
                request_id=str(next(self._ids)),
                prompt_token_ids=r["prompt_token_ids"],
                start=first,
                token_ids=r["prompt_token_ids"][first:],
                logprobs=[lp[1] for lp in lps],
                top_logprobs=[self._logprob_dict(lp) for lp in lps] if top_logprobs > 0 else None))
        return out

    # -- conversions --------------------------------------------------------------------------------------------

    def _prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._session.encode(prompt, True)
        if isinstance(prompt, dict):
            extra = set(prompt) - {"prompt", "prompt_token_ids"}
            if extra:
                raise NotImplementedError(f"prompt fields {sorted(extra)} are not supported (text models only)")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self._session.encode(prompt["prompt"], True)
        raise TypeError(f"a prompt is a string or a dict with 'prompt' or 'prompt_token_ids', got {type(prompt)}")

    def _logprobs_count(self, name: str, value: int | None) -> int:
        if value is None:
            return -1
        if value == -1:
            value = self._session.vocab_size
        if value > self.max_logprobs and self.max_logprobs != -1:
            raise ValueError(f"Requested {name} of {value}, which is greater than max allowed: {self.max_logprobs}")
        return value

    def _request(self, ids: list[int], p: SamplingParams, priority: int) -> dict:
        max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len - len(ids)
        return {
            "prompt_token_ids": ids,
            "n": p.n,
            "max_tokens": max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": max(p.top_k, 0),
            "min_p": p.min_p,
            "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty,
            "repetition_penalty": p.repetition_penalty,
            "seed": (p.seed if p.seed is not None else self._seeds.getrandbits(64)) % 2**64,
            "logprobs": self._logprobs_count("sample logprobs", p.logprobs),
            "prompt_logprobs": self._logprobs_count("prompt logprobs", p.prompt_logprobs),
            "stop_token_ids": p.stop_token_ids,
            "ignore_eos": p.ignore_eos,
            "stop": p.stop,
            "include_stop_str_in_output": p.include_stop_str_in_output,
            "skip_special_tokens": p.skip_special_tokens,
            "detokenize": p.detokenize,
            "priority": priority,
        }

    def _logprob_dict(self, lp: tuple) -> dict[int, Logprob]:
        """One position's (token, logprob, rank, top) as vLLM gives it: the position's token first, then the top
        alternatives with ranks 1, 2, ..."""
        token, logprob, rank, top = lp
        d = {token: Logprob(logprob, rank if rank > 0 else None, self._session.token_text(token))}
        for i, (t, l) in enumerate(top):
            if t not in d:
                d[t] = Logprob(l, i + 1, self._session.token_text(t))
        return d

    def _request_output(self, text: str | None, r: dict, p: SamplingParams) -> RequestOutput:
        prompt_logprobs = None
        if p.prompt_logprobs is not None:
            prompt_logprobs = [None] + [self._logprob_dict(lp) for lp in r["prompt_logprobs"]]
        outputs = []
        for o in r["outputs"]:
            logprobs = None if p.logprobs is None else [self._logprob_dict(lp) for lp in o["logprobs"]]
            cumulative = None if p.logprobs is None else float(sum(lp[1] for lp in o["logprobs"]))
            outputs.append(CompletionOutput(index=o["index"], text=o["text"], token_ids=o["token_ids"],
                                            cumulative_logprob=cumulative, logprobs=logprobs,
                                            finish_reason=o["finish_reason"], stop_reason=o["stop_reason"]))
        return RequestOutput(request_id=str(next(self._ids)), prompt=text, prompt_token_ids=r["prompt_token_ids"],
                             prompt_logprobs=prompt_logprobs, outputs=outputs)
