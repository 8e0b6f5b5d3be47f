"""Generation on the real SmolLM2 model: streaming, stop conditions, sampling, chat, batching, errors."""

from __future__ import annotations

import numpy as np
import pytest
from backend_availability import open_runtime_or_skip
from golden_text import GOLDEN_TEXT
from logits_tolerance import assert_same_logits

from perfx_core import ContextLengthError, InvalidArgumentError


def test_streamed_text_is_the_decoded_tokens(smollm2):
    generation = smollm2.generate("The sea at night is", max_tokens=24, temperature=0, ignore_eos=True)
    pieces = [event.text for event in generation]
    assert len(generation.token_ids) == generation.stats.generated_tokens > 0
    assert "".join(pieces) == generation.text == smollm2.tokenizer.decode(generation.token_ids)


def test_max_tokens_ends_with_length(smollm2):
    generation = smollm2.generate("Count: 1, 2, 3,", max_tokens=5, temperature=0)
    generation.run()
    assert generation.stats.generated_tokens == 5
    assert generation.stats.finish_reason == "length"


def test_stop_string_truncates_and_stops(smollm2):
    full = smollm2.generate("Count: 1, 2, 3,", max_tokens=20, temperature=0).run()
    assert " 5," in full
    stopped = smollm2.generate("Count: 1, 2, 3,", max_tokens=20, temperature=0, stop=[" 5,"])
    text = stopped.run()
    assert text == full[: full.index(" 5,")]
    assert stopped.stats.finish_reason == "stop"


def test_stats_are_measured(smollm2):
    generation = smollm2.generate("Hello", max_tokens=6, temperature=0, ignore_eos=True)
    generation.run()
    s = generation.stats
    assert s.prompt_tokens == len(smollm2.tokenizer.encode("Hello", add_special=True))
    assert s.generated_tokens == 6
    assert 0 < s.time_to_first_token_s < 60
    assert s.prefill_tokens_per_s > 0 and s.decode_tokens_per_s > 0
    assert s.peak_host_bytes > 100 * 2**20  # the model alone is ~100 MB
    assert s.backend_bytes > 50 * 2**20 and s.backend_peak_bytes >= s.backend_bytes


def test_profile_reports_time_per_op(smollm2):
    generation = smollm2.generate("Hello", max_tokens=3, temperature=0, ignore_eos=True, profile=True)
    generation.run()
    profile = generation.stats.op_profile
    assert {"qkv_proj", "attention_decode", "gate_up_silu", "logits", "linear_add_rmsnorm", "rmsnorm"} <= set(profile)
    assert all(v["seconds"] > 0 and v["calls"] > 0 for v in profile.values())
    assert smollm2.runtime.ops.profile is None  # profiling is switched off again


def test_seeded_sampling_repeats_and_seeds_differ(smollm2):
    def sample(seed):
        return smollm2.generate(
            "Once upon a time",
            max_tokens=12,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            seed=seed,
            ignore_eos=True,
        ).run()

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_chat_uses_the_models_template_and_stops_at_im_end(smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = smollm2.render_chat(messages)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = smollm2.chat_prompt_ids(messages)
    assert ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> and <|im_end|> parsed as special tokens
    generation = smollm2.chat(messages, max_tokens=64, temperature=0)
    text = generation.run()
    assert "Paris" in text
    assert generation.stats.finish_reason == "stop" and "<|im_end|>" not in text


def test_context_overflow_is_a_clear_error(smollm2):
    ids = [42] * 1000
    with pytest.raises(ContextLengthError) as info:
        smollm2.generate(ids, max_tokens=100)
    assert "1000" in str(info.value) and "100" in str(info.value) and "1024" in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1},
        {"top_k": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"min_p": 1},
        {"repetition_penalty": 0},
        {"max_tokens": 0},
        {"seed": -3},
        # beyond what the engine's int32 / uint64 / float32 fields hold: refused, not wrapped or overflowed
        {"top_k": 2**31},
        {"seed": 2**70},
        {"temperature": 1e308},
    ],
)
def test_bad_sampling_arguments(smollm2, kwargs):
    with pytest.raises(InvalidArgumentError):
        smollm2.generate("Hi", **kwargs)


def test_bad_token_ids_rejected(smollm2):
    with pytest.raises(InvalidArgumentError):
        smollm2.logits([1, 2, 10**6])
    with pytest.raises(InvalidArgumentError):
        smollm2.generate([], max_tokens=3)


def test_batched_decode_matches_one_sequence_at_a_time(smollm2):
    """Three sequences at different positions in different slots, decoded in one batch."""
    engine = smollm2.engine
    tok = smollm2.tokenizer
    prompts = [tok.encode(t) for t in ("The sky is", "In 1492, Columbus sailed across the", "def add(a, b):")]
    singles = []
    for prompt in prompts:
        engine.prefill(prompt, slot=0)
        singles.append(engine.decode([prompt[-1]], [0], [len(prompt)])[0])
    for slot, prompt in zip((3, 1, 2), prompts, strict=True):
        engine.prefill(prompt, slot=slot)
    batched = engine.decode([p[-1] for p in prompts], [3, 1, 2], [len(p) for p in prompts])
    for single, row in zip(singles, batched, strict=True):
        np.testing.assert_allclose(row, single, rtol=1e-4, atol=1e-3)


def test_chunked_prefill_matches_one_chunk(smollm2):
    ids = smollm2.tokenizer.encode(GOLDEN_TEXT)[:100]
    whole = smollm2.logits(ids)
    engine = smollm2.engine
    saved = engine.prefill_chunk
    try:
        engine.prefill_chunk = 17
        chunked = smollm2.logits(ids)
    finally:
        engine.prefill_chunk = saved
    assert_same_logits(chunked, whole)


def test_decode_continues_prefill_exactly(smollm2):
    """Logits of prefill(all) at row i equal prefill(prefix) + decode steps: the KV cache is right."""
    ids = smollm2.tokenizer.encode(GOLDEN_TEXT)[:24]
    teacher = smollm2.logits(ids)
    engine = smollm2.engine
    engine.prefill(ids[:20], slot=0)
    for i in range(20, 24):
        step = engine.decode([ids[i]], [0], [i])[0]
        assert_same_logits(step, teacher[i])


def _mixed_step_model(backend: str, smollm2_path):
    from perfx_core.gguf_loader import load_llama_gguf
    from perfx_core.model import LlamaModel

    config, weights, _ = load_llama_gguf(smollm2_path)
    rt = open_runtime_or_skip(backend)  # skips only where OpenCL cannot run at all (and never in CI)
    return LlamaModel(config, weights, rt, n_slots=3, max_seq_len=128, prefill_chunk=32)


@pytest.mark.parametrize("backend", ["numpy", "opencl"])
def test_a_mixed_step_equals_a_prefill_then_a_decode(backend, smollm2_path):
    """decode(..., prompt=chunk) runs a prompt chunk in the decode step's forward pass: the decode rows, the
    chunk's last-token row and every later step match a separate prefill and decode (the cache is the same)."""
    from perfx_core.errors import InvalidArgumentError
    from perfx_core.sampling import engine_params

    model = _mixed_step_model(backend, smollm2_path)
    prompts = ([1, 504, 3458, 282], [1, 7, 88, 912, 34, 2001, 5], [1, 330, 41, 9, 77, 1200, 18, 6, 4000])
    try:
        runs = []
        for mixed in (False, True):
            for slot in (0, 1):
                model.prefill(prompts[slot], slot=slot)
            tokens, positions = [11, 12], [len(prompts[0]), len(prompts[1])]
            if mixed:
                both = model.decode(tokens, [0, 1], positions, prompt=(prompts[2][:5], 2, 0))
                rest = model.decode(tokens[:1], [0], [positions[0] + 1], prompt=(prompts[2][5:], 2, 5))
                rows, prompt_last = both[:2], rest[1]
            else:
                model.prefill(prompts[2][:5], slot=2)
                prompt_last = model.prefill(prompts[2][5:], slot=2, start=5)
                rows = model.decode(tokens, [0, 1], positions)
                model.decode(tokens[:1], [0], [positions[0] + 1])
            after = model.decode([13, 14, 15], [0, 1, 2], [positions[0] + 2, positions[1] + 1, len(prompts[2])])
            picks = model.decode(
                [13, 14], [0, 1], [positions[0] + 3, positions[1] + 2], prompt=([5, 6], 2, 9), argmax=True
            )
            draws = model.decode(
                [13],
                [0],
                [positions[0] + 4],
                prompt=([7], 2, 11),
                sampling=np.stack([engine_params(0.8, 0.0, 3, 0)] * 2),
            )
            runs.append((rows, prompt_last, after, picks, draws))
        for separate, mixed in zip(*runs, strict=True):
            np.testing.assert_allclose(mixed, separate, rtol=2e-3, atol=2e-3)
        assert runs[1][3].shape == (3,) and runs[1][4].shape == (2,)
        with pytest.raises(InvalidArgumentError, match="also decoding"):
            model.decode([1], [0], [20], prompt=([1, 2], 0, 30))
        with pytest.raises(InvalidArgumentError, match="takes 1.."):
            model.decode([1], [0], [20], prompt=([1] * 65, 1, 0))
        with pytest.raises(InvalidArgumentError, match="sampling must be"):
            model.decode([1], [0], [20], prompt=([1], 1, 0), sampling=np.stack([engine_params(1.0, 0.0, 0, 0)]))
    finally:
        model.close()
