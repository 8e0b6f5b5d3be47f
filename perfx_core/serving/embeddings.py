"""`POST /v1/embeddings`: each input's unit-length mean of the model's final-normed hidden states
(perfx_core.pooling), computed by the scheduler in a KV-cache slot of its own, between other requests' steps.

Inputs: a string, a list of strings, a list of token ids, or a list of such lists (up to MAX_INPUTS, each within
the context). ``encoding_format`` float (default) or base64 (little-endian float32, as OpenAI sends it);
``dimensions`` only as the model's own width (perfx does not truncate embeddings). A request's inputs enter the
scheduler a few at a time (as many as it has slots), so a large batch neither fills the queue nor holds every
slot while others wait behind it.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import RequestCancelledError
from ..sampling import SamplingParams
from .admission import admit
from .guard import refusal
from .job_events import ClientGone, JobRun, ServingState
from .protocol import APIError, bad_request
from .scheduler import Embedding, Failed, Finished, GenerationRequest

MAX_INPUTS = 2048  # OpenAI's limit per request
ENCODING_FORMATS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingRequest:
    inputs: list[list[int]]  # token ids per input
    encoding_format: str


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def parse_embedding_request(body: Any, model: Any, cancelled: Callable[[], bool] = lambda: False) -> EmbeddingRequest:
    """Validate a body against the loaded ``model`` (400s name the parameter); tokenizes the strings."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise bad_request(f"'model' must be a string; got {name!r}", "model")
    encoding = body.get("encoding_format", "float")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODING_FORMATS:
        raise bad_request(f"'encoding_format' must be 'float' or 'base64'; got {encoding!r}", "encoding_format")
    dim = model.config.dim
    dimensions = body.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or dimensions != dim):
        raise bad_request(
            f"'dimensions' must be this model's embedding size, {dim} (perfx does not shorten embeddings); "
            f"got {dimensions!r}",
            "dimensions",
        )
    raw = body.get("input")
    if raw is None:
        raise bad_request("'input' is required", "input")
    if isinstance(raw, str) or _is_ids(raw):
        items = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(i, (str, list)) for i in raw):
        items = raw
    else:
        raise bad_request(
            "'input' must be a string, a list of strings, a list of token ids or a list of such lists", "input"
        )
    if len(items) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} inputs per request; got {len(items)}", "input")
    vocab, context = model.config.vocab_size, model.context_length
    inputs = []
    for i, item in enumerate(items):
        if cancelled():
            raise RequestCancelledError("the client went away")
        where = f"input[{i}]" if len(items) > 1 or not isinstance(raw, str) else "'input'"
        if isinstance(item, str):
            if not item:
                raise bad_request(f"{where} is an empty string", "input")
            ids = model.tokenizer.encode(item, add_special=True)
        elif _is_ids(item):
            if not all(0 <= t < vocab for t in item):
                raise bad_request(f"{where}: token ids must be in [0, {vocab})", "input")
            ids = list(item)
        else:
            raise bad_request(f"{where} must be a non-empty string or a non-empty list of token ids", "input")
        if len(ids) > context:
            raise bad_request(
                f"{where} has {len(ids)} tokens; this server's context holds {context}",
                "input",
                "context_length_exceeded",
            )
        inputs.append(ids)
    return EmbeddingRequest(inputs, encoding)


def encode_vector(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32).tolist()


def embeddings_endpoint(state: ServingState) -> Callable[[Request], Any]:
    """The route's handler, bound to the server's shared state."""

    async def embeddings(request: Request) -> Response:
        metrics = state.metrics
        try:
            scheduler, _, name, parsed = await admit(
                state, request, lambda body, _, cancelled: parse_embedding_request(body, state.model, cancelled)
            )
            run = JobRun(state, scheduler)
            vectors = await _embed_all(request, run, parsed.inputs)
        except APIError as error:
            return refusal(metrics, error)
        except (ClientGone, RequestCancelledError):
            return refusal(metrics, None)
        tokens = sum(len(ids) for ids in parsed.inputs)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"object": "embedding", "index": i, "embedding": encode_vector(v, parsed.encoding_format)}
                    for i, v in enumerate(vectors)
                ],
                "model": name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    return embeddings


async def _embed_all(request: Request, run: JobRun, inputs: list[list[int]]) -> list[np.ndarray]:
    """Every input's vector, keeping at most as many inputs in the scheduler as it has slots."""
    vectors: list[np.ndarray | None] = [None] * len(inputs)
    window = run.scheduler.n_slots
    submitted = finished = 0
    try:
        while finished < len(inputs):
            while submitted < len(inputs) and submitted - finished < window:
                job = GenerationRequest(inputs[submitted], 0, SamplingParams(), run.emitter(submitted), embed=True)
                run.submit([job])
                submitted += 1
            index, event = await run.next_event(request)
            if isinstance(event, Embedding):
                vectors[index] = event.vector
            elif isinstance(event, Finished):
                finished += 1
            elif isinstance(event, Failed):
                raise APIError(500, event.message, type="server_error")
    except BaseException:
        run.cancel()
        raise
    return vectors  # type: ignore[return-value]
