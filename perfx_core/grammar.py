"""Structured output: a grammar (a JSON schema, any JSON object, or Lark) as a mask over each next token.

The engine is llguidance (guidance-ai's Rust grammar engine, also behind vLLM's and llama.cpp's guided decoding):
it installs alone from PyPI (no torch, no CUDA), runs on the CPU, compiles JSON schemas and Lark grammars lazily
instead of precomputing an index over the vocabulary, and computes a mask for SmolLM2's 49k tokens in 0.01-0.2 ms
(benchmarks/bench_grammar.py, docs/serving.md). Its view of the vocabulary is built from perfx's own tokenizer
(each token's bytes, the end-of-sequence ids), so it works for any GGUF model, without a Hugging Face
tokenizer.json.

A ``Grammar`` is compiled and checked once per request; each sequence then gets a ``TokenConstraint`` of its own:
``mask_logits`` sets the tokens the grammar does not allow next to -inf, ``accept`` advances it by the sampled
token, and ``complete`` says the grammar allows nothing more (the sequence ends there, without waiting for an
end-of-sequence token).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from .errors import InvalidArgumentError
from .tokenizer_base import TokenType

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

# JSON is generated compact but readable, with no free whitespace: a small model given free whitespace can pad
# an object with newlines until max_tokens, and the output is then never complete.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The grammar engine's own bounds on one grammar's size and on the work of one token's mask (llguidance's
# defaults), with fewer lexer states than its default (each takes 1-2 kB): a request's grammar stays well
# under 100 MB however it is written.
LIMITS = dict(max_lexer_states=50_000)


class GrammarError(InvalidArgumentError):
    """A grammar or JSON schema that the engine cannot compile, or output that left its grammar."""


# -- the engine's view of a perfx tokenizer ---------------------------------------------------------------


class _TokenizerView:
    """What llguidance.TokenizerWrapper reads: each token's bytes, the special ids, and an encoder."""

    def __init__(self, tokenizer: Tokenizer):
        n = tokenizer.vocab_size
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eos_ids, default=0)
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [tokenizer.token_to_bytes(i) for i in range(n)]
        # Control tokens are never text: the grammar cannot spell them, only end on the end-of-sequence ones.
        special = (TokenType.CONTROL, TokenType.UNKNOWN)
        self.special_token_ids = [i for i in range(n) if tokenizer.token_type(i) in special]
        # Weakly: the engine's tokenizer holds this view and is cached per tokenizer, which must stay collectable.
        self._tokenizer = weakref.ref(tokenizer)
        self._by_bytes: dict[bytes, int] | None = None

    def __call__(self, text: str) -> list[int]:
        """Tokens whose bytes are exactly ``text``'s: the engine tokenizes pieces of output with this. The model's
        own encoding when it is (a SentencePiece vocabulary adds a dummy-prefix space to each text), else the
        longest pieces, left to right."""
        tokenizer = self._tokenizer()
        ids = tokenizer.encode(text) if tokenizer is not None else []
        data = text.encode("utf-8")
        if b"".join(self.tokens[i] for i in ids) == data:
            return ids
        if self._by_bytes is None:
            special = set(self.special_token_ids)
            self._by_bytes = {}
            for i, piece in enumerate(self.tokens):
                if piece and i not in special:
                    self._by_bytes.setdefault(piece, i)
        longest = max(map(len, self._by_bytes))
        out, pos = [], 0
        while pos < len(data):
            for size in range(min(longest, len(data) - pos), 0, -1):
                token = self._by_bytes.get(data[pos : pos + size])
                if token is not None:
                    out.append(token)
                    pos += size
                    break
            else:
                raise GrammarError(f"the vocabulary cannot spell byte {data[pos]:#04x}")
        return out


_views: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_views_lock = threading.Lock()


def engine_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """The grammar engine's tokenizer for ``tokenizer``, built once (~0.1-0.5 s for a 49k vocabulary)."""
    with _views_lock:
        view = _views.get(tokenizer)
        if view is None:
            eos = sorted(tokenizer.eos_ids) or [0]
            view = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenizerView(tokenizer)), eos_token=eos)
            _views[tokenizer] = view
        return view


# -- grammars -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grammar:
    """A grammar in the engine's serialized form, checked against one tokenizer."""

    source: str
    tokenizer: Any  # perfx Tokenizer

    def constraint(self) -> TokenConstraint:
        """A fresh constraint at the grammar's start, for one sequence."""
        view = engine_tokenizer(self.tokenizer)
        matcher = llguidance.LLMatcher(view, self.source, log_level=0, limits=_limits())
        if matcher.is_error():
            raise GrammarError(f"the grammar could not be used: {matcher.get_error()}")
        return TokenConstraint(matcher, self.tokenizer.vocab_size)


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


def compile_grammar(source: str, tokenizer: Tokenizer) -> Grammar:
    """Check an llguidance grammar (as made by the functions below) against ``tokenizer``."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        source, engine_tokenizer(tokenizer), limits=_limits()
    )
    if is_error:
        raise GrammarError(messages[0] if messages else "the grammar is invalid")
    return Grammar(source, tokenizer)


def json_schema_grammar(schema: Mapping[str, Any] | bool, tokenizer: Tokenizer) -> Grammar:
    """Output that is one JSON value valid against ``schema`` (JSON Schema, draft 2020-12 keywords)."""
    if not isinstance(schema, (Mapping, bool)):
        raise GrammarError(f"a JSON schema must be an object; got {type(schema).__name__}")
    try:
        source = llguidance.LLMatcher.grammar_from_json_schema(_plain_json(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"the JSON schema is not valid: {exc}") from None
    return compile_grammar(source, tokenizer)


def json_object_grammar(tokenizer: Tokenizer) -> Grammar:
    """Output that is any one JSON object (OpenAI's ``{"type": "json_object"}``)."""
    return json_schema_grammar({"type": "object"}, tokenizer)


def lark_grammar(lark: str, tokenizer: Tokenizer) -> Grammar:
    """Output that matches a Lark grammar (llguidance's dialect: ``%json {schema}`` embeds a JSON schema)."""
    return compile_grammar(llguidance.LLMatcher.grammar_from_lark(lark), tokenizer)


def embedded_json(schema: Mapping[str, Any] | bool) -> str:
    """``%json {...}`` for a Lark grammar: ``schema`` with perfx's JSON options."""
    if isinstance(schema, Mapping):
        schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
    elif schema is True:
        schema = {"x-guidance": JSON_OPTIONS}
    return "%json " + json.dumps(_plain_json(schema), ensure_ascii=True)


_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """``schema`` with every object that does not say otherwise closed to properties it does not name
    (``"additionalProperties": false``), as OpenAI's strict mode and its SDK's pydantic schemas have them: else
    a small model is free to add keys until max_tokens."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), Mapping):
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def response_format_grammar(response_format: Any, tokenizer: Tokenizer) -> Grammar | None:
    """The grammar of an OpenAI ``response_format``: None for ``{"type": "text"}``, any JSON object for
    ``json_object``, the schema of ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``
    (enforced whether ``strict`` is set or not; strict also closes its objects: closed_objects)."""
    schema = response_format_schema(response_format)
    if schema is None:
        return None
    return json_schema_grammar(schema, tokenizer)


def response_format_schema(response_format: Any) -> Mapping[str, Any] | bool | None:
    """The JSON schema an OpenAI ``response_format`` asks for (None: free text); GrammarError when malformed."""
    if not isinstance(response_format, Mapping) or not isinstance(response_format.get("type"), str):
        raise GrammarError('response_format must be an object like {"type": "json_object"}')
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise GrammarError('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}')
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise GrammarError("response_format json_schema.name must be a string")
        if not isinstance(spec.get("strict", False), (bool, type(None))):
            raise GrammarError("response_format json_schema.strict must be true or false")
        schema = spec.get("schema", {})  # OpenAI's default: any JSON value
        if not isinstance(schema, (Mapping, bool)):
            raise GrammarError("response_format json_schema.schema must be a JSON schema object")
        return closed_objects(schema) if spec.get("strict") else schema
    raise GrammarError(f"response_format type {kind!r} is not one of text, json_object, json_schema")


def _plain_json(value: Any) -> Any:
    """``value`` as plain JSON data (a copy: a schema is not changed in place)."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"the JSON schema is not JSON data: {exc}") from None


# -- one sequence's constraint --------------------------------------------------------------------------------


class TokenConstraint:
    """One sequence's place in its grammar: which tokens may come next, advanced by each sampled token."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._bits: np.ndarray | None = None  # the packed mask of the current state, once computed

    def _packed(self) -> np.ndarray:
        if self._bits is None:
            bits = llg_numpy.allocate_token_bitmask(1, self.vocab_size)
            llg_numpy.fill_next_token_bitmask(self.matcher, bits)
            self._bits = bits[0]
        return self._bits

    def allowed(self) -> np.ndarray:
        """(vocab,) bool: the tokens the grammar allows next (end-of-sequence ones once it may end)."""
        packed = self._packed()
        if self.matcher.is_error():
            raise GrammarError(f"the output left its grammar: {self.matcher.get_error()}")
        return np.unpackbits(packed.view(np.uint8), count=self.vocab_size, bitorder="little").view(bool)

    def mask_logits(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` with every token the grammar does not allow next at -inf."""
        allowed = self.allowed()
        if not allowed.any():
            raise GrammarError("the grammar allows no next token")
        out = np.full(logits.shape, -np.inf, dtype=np.float32)
        n = min(len(allowed), logits.shape[-1])
        np.copyto(out[:n], logits[:n], where=allowed[:n])
        return out

    def accept(self, token: int) -> None:
        self._bits = None
        if not self.matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} is not allowed by the grammar: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The grammar allows nothing more: the sequence ends here."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The output so far is a complete sentence of the grammar (it may end here)."""
        return self.matcher.is_accepting()


_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def prefetch_masks(constraints: Sequence[TokenConstraint]) -> None:
    """Compute the next-token masks of several sequences at once, in the engine's threads (without the GIL), so a
    batch's sequences do not wait for each other's masks one by one."""
    todo = [c for c in constraints if c._bits is None and not c.matcher.is_error()]
    if len(todo) < 2:
        return  # one mask is computed as fast where it is needed
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        executor = _executor
    vocab = todo[0].vocab_size
    if any(c.vocab_size != vocab for c in todo):
        return
    bits = llg_numpy.allocate_token_bitmask(len(todo), vocab)
    llg_numpy.fill_next_token_bitmask_par(executor, [(c.matcher, i) for i, c in enumerate(todo)], bits)
    for i, c in enumerate(todo):
        c._bits = bits[i]
