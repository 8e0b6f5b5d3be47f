"""Server settings, validated once, shared by the CLI, the app and the scheduler."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidArgumentError, PerfxError
from ..model import MIXED_PROMPT_ROWS

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_LIMIT_CONCURRENCY = 1024  # open connections and requests; beyond it uvicorn answers 503
DEFAULT_MIXED_CHUNK = 16
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s]+", re.IGNORECASE)  # scheme://host[:port], as browsers send it


class ServeError(PerfxError):
    """The server cannot start or serve: the port is taken, the model failed to load, a dependency is missing."""


@dataclass(frozen=True)
class ServerConfig:
    model_path: Path
    backend: str = "numpy"
    device: int | str | None = None
    context_length: int | None = None  # KV-cache length per slot; None: min(model, 4096)
    max_running: int = 8  # sequences decoded together; one KV-cache slot each
    max_queue: int = 64  # requests waiting for a slot; more get 429
    prefill_chunk: int = 64  # prompt tokens prefilled per scheduler iteration
    kv_dtype: str | None = None  # "float16" or "float32"; None: the backend's choice
    # A prompt chunk in the decode step's forward pass; None: on where the device is a GPU, off on CPUs
    # (docs/serving.md: it paid on the H200, and cost throughput and first tokens on a CPU).
    mixed_steps: bool | None = None
    # Prompt tokens per mixed step, at most. Its rows are padded to whole tiles of 8 (model.MIXED_GRAPH_ROUNDING),
    # and every decoding sequence waits for the whole step (H200, 7B, ms of device time: 15 decode rows alone
    # 4.90, with an 8-token chunk 5.84, with 16 6.03). 8 instead of 16 took the c16 client p99 from 7.6 and 7.3
    # to 7.5 and 6.9 ms but output tokens/s down 14%: twice the mixed steps
    # (docs/results/h200_serving_mixed_chunk_8_vs_16.txt).
    mixed_chunk: int = DEFAULT_MIXED_CHUNK
    # A step's text (detokenizing, stop strings, events) handled while the device runs the next step; None: on
    # where the device is a GPU (a CPU backend computes while queueing, so there is nothing to overlap).
    overlap_output: bool | None = None
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    host: str = "127.0.0.1"  # the address listened on: a loopback one limits the Host names answered
    allowed_hosts: tuple[str, ...] = ()  # Host names answered besides the defaults ("*": any)
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # request headers (and then the body) must arrive in this
    limit_concurrency: int = DEFAULT_LIMIT_CONCURRENCY
    allowed_origins: tuple[str, ...] = ()  # browser origins granted CORS ("*": any); none by default
    # The names clients may put in "model" and /v1/models lists. None given: the file's name is listed and any
    # name is served (a server has one model, and many clients hard-code a name); given: only these.
    served_model_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_running", "prefill_chunk", "mixed_chunk", "max_body_bytes", "limit_concurrency"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name.replace('_', '-')} must be an integer >= 1; got {value!r}")
        if self.mixed_chunk > MIXED_PROMPT_ROWS:
            raise InvalidArgumentError(
                f"mixed-chunk must be at most {MIXED_PROMPT_ROWS} (a mixed step's most prompt rows); "
                f"got {self.mixed_chunk}"
            )
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise InvalidArgumentError(f"max-queue must be an integer >= 0; got {self.max_queue!r}")
        if self.context_length is not None and self.context_length < 2:
            raise InvalidArgumentError(f"context must be at least 2 tokens; got {self.context_length}")
        if not isinstance(self.header_timeout_s, (int, float)) or not 0 < self.header_timeout_s <= 3600:
            raise InvalidArgumentError(f"header-timeout must be in (0, 3600] seconds; got {self.header_timeout_s!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise InvalidArgumentError("the API key is empty: pass a non-empty --api-key or unset PERFX_API_KEY")
        for origin in self.allowed_origins:
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise InvalidArgumentError(
                    f"allowed-origins: {origin!r} is not an origin; write scheme://host[:port] with no path "
                    "(http://localhost:3000), or '*' for any"
                )
        for name in self.served_model_names:
            if not isinstance(name, str) or not name.strip() or name != name.strip():
                raise InvalidArgumentError(f"served-model-name: {name!r} is not a name (empty or spaced)")
        if len(set(self.served_model_names)) != len(self.served_model_names):
            raise InvalidArgumentError(f"served-model-name lists a name twice: {', '.join(self.served_model_names)}")

    @property
    def model_id(self) -> str:
        """The name clients put in ``model``: the file name without ``.gguf``."""
        name = self.model_path.name
        return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name

    @property
    def model_names(self) -> tuple[str, ...]:
        """What /v1/models lists: the --served-model-name names, else the file's name."""
        return self.served_model_names or (self.model_id,)

    def response_model_name(self, requested: object) -> str | None:
        """The name a response reports for a request naming ``requested``: that name when it is listed, the first
        listed one when none or (without --served-model-name) any other is asked for; None when the request must
        be refused (an unlisted name while --served-model-name is given)."""
        if isinstance(requested, str) and requested in self.model_names:
            return requested
        if requested and isinstance(requested, str) and self.served_model_names:
            return None
        return self.model_names[0]
