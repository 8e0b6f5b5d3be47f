"""The scheduler jobs of a parsed request: one per choice (``n`` per prompt), the choices of a prompt sharing
its prefill (the first computes it, the others copy its KV cache: Scheduler, ``prefill_from``) and drawing
from random streams of their own."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..sampling import UINT64_MAX
from .protocol import ParsedRequest
from .scheduler import GenerationRequest


def generation_jobs(parsed: ParsedRequest, emitter: Callable[[int], Callable[[Any], None]]) -> list[GenerationRequest]:
    """One GenerationRequest per entry of ``parsed.prompts``; ``emitter(index)`` is the choice's event sink."""
    jobs: list[GenerationRequest] = []
    for index, prompt in enumerate(parsed.prompts):
        j = index % parsed.n  # the choice's place among its prompt's n
        sampling = parsed.sampling
        if j and sampling.seed is not None:  # a seeded request repeats, yet its n choices differ
            sampling = dataclasses.replace(sampling, seed=(sampling.seed + j) % (UINT64_MAX + 1))
        jobs.append(
            GenerationRequest(
                prompt.ids,
                parsed.max_tokens,
                sampling,
                emitter(index),
                stop=parsed.stop,
                ignore_eos=parsed.ignore_eos,
                stop_token_ids=parsed.stop_token_ids,
                include_stop=parsed.include_stop,
                logprobs=parsed.logprobs,
                prompt_logprobs=parsed.echo and parsed.logprobs is not None,
                prefill_from=jobs[index - j] if j else None,
                constraint=parsed.constraints[index] if parsed.constraints else None,  # structured output
            )
        )
    return jobs


def counts_prompt(parsed: ParsedRequest, index: int) -> bool:
    """Whether choice ``index``'s prompt tokens count in the usage: once per prompt, not once per choice."""
    return index % parsed.n == 0
