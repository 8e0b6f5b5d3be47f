"""Perplexity: sliding-window bookkeeping, and `perfx eval ppl` giving one answer for every model format."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
from tiny_gguf import write_tiny_llama_gguf

import perfx_core
from perfx_core.errors import InvalidArgumentError
from perfx_core.formats.hf_export import gguf_to_hf
from perfx_core.quant.cli_commands import add_commands
from perfx_core.quant.eval import perplexity, perplexity_of_ids


class Recorder:
    """A fake model: logits that put probability p on the true next token; records each window it is given."""

    def __init__(self, ids: list[int], vocab: int = 10, p: float = 0.5):
        self.ids, self.vocab, self.p, self.windows = ids, vocab, p, []

    def logits(self, window: list[int]) -> np.ndarray:
        self.windows.append(list(window))
        start = next(i for i in range(len(self.ids)) if self.ids[i : i + len(window)] == window)
        out = np.full((len(window), self.vocab), np.log((1 - self.p) / (self.vocab - 1)))
        for j in range(len(window) - 1):
            out[j, self.ids[start + j + 1]] = np.log(self.p)
        out[-1, :] = 0.0  # the last row predicts past the window: never scored
        return out


@pytest.mark.parametrize("n, ctx, stride", [(20, 8, 4), (20, 8, 8), (20, 8, 1), (7, 16, 8), (9, 8, 3), (2, 2, 1)])
def test_every_token_after_the_first_is_scored_once(n, ctx, stride):
    ids = list(range(n))  # distinct, so the recorder can locate each window
    fake = Recorder(ids, vocab=n + 1, p=0.25)
    result = perplexity_of_ids(fake.logits, ids, ctx, stride)
    assert result.tokens == n - 1
    assert math.isclose(result.ppl, 4.0, rel_tol=1e-9)
    assert all(len(w) <= ctx for w in fake.windows)
    assert fake.windows[0] == ids[: min(ctx, n)]


def test_windows_slide_by_stride_and_stop_at_the_end():
    ids = list(range(20))
    fake = Recorder(ids, vocab=21)
    perplexity_of_ids(fake.logits, ids, ctx=8, stride=4)
    # Window [4, 12) re-reads 4..7 as context and scores only 8..11; the last window ends at the text's end.
    assert [(w[0], w[-1] + 1) for w in fake.windows] == [(0, 8), (4, 12), (8, 16), (12, 20)]
    fake = Recorder(ids, vocab=21)
    perplexity_of_ids(fake.logits, ids, ctx=8, stride=8)  # no overlap: each window starts on its last context token
    assert [(w[0], w[-1] + 1) for w in fake.windows] == [(0, 8), (7, 15), (14, 20)]


def test_uniform_model_has_perplexity_vocab_size():
    result = perplexity_of_ids(lambda w: np.zeros((len(w), 37)), list(range(30)), ctx=10, stride=5)
    assert math.isclose(result.ppl, 37.0, rel_tol=1e-9) and result.tokens == 29


def test_bad_arguments():
    with pytest.raises(InvalidArgumentError):
        perplexity_of_ids(lambda w: np.zeros((len(w), 3)), [1, 2, 3], ctx=1, stride=1)
    with pytest.raises(InvalidArgumentError):
        perplexity_of_ids(lambda w: np.zeros((len(w), 3)), [1, 2, 3], ctx=4, stride=5)
    with pytest.raises(InvalidArgumentError):
        perplexity_of_ids(lambda w: np.zeros((len(w), 3)), [1], ctx=4, stride=2)


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="perfx")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_eval_ppl_cli_is_the_same_for_gguf_and_hf_directory(tmp_path, capsys):
    tiny = write_tiny_llama_gguf(tmp_path / "tiny.gguf", tensor_type="F32", seed=5)
    hf = gguf_to_hf(tiny.path, tmp_path / "hf")
    text = tmp_path / "text.txt"
    text.write_text("the hat is on the chair and the cat is in the hat. " * 6)
    results = []
    for model in (tiny.path, hf):
        assert run_cli("eval", "ppl", str(model), "--text", str(text), "--ctx", "32", "--stride", "16", "--json") == 0
        results.append(json.loads(capsys.readouterr().out))
    assert results[0]["tokens"] == results[1]["tokens"] > 32
    assert math.isclose(results[0]["ppl"], results[1]["ppl"], rel_tol=1e-4)
    # The API agrees with the CLI, and a full-context window gives the plain teacher-forced perplexity.
    model = perfx_core.load(hf, context_length=256)
    api = perplexity(model, text.read_text(), ctx=32, stride=16)
    assert math.isclose(api.ppl, results[1]["ppl"], rel_tol=1e-9)
    ids = model.tokenizer.encode(text.read_text(), add_special=True)
    logits = model.logits(ids).astype(np.float64)
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True))
        - logits.max(1, keepdims=True)
    )
    direct = math.exp(-np.mean(logp[np.arange(len(ids) - 1), ids[1:]]))
    assert math.isclose(perplexity(model, text.read_text(), ctx=256).ppl, direct, rel_tol=1e-6)
    with pytest.raises(InvalidArgumentError):
        run_cli("eval", "ppl", str(hf), "--text", str(tmp_path / "missing.txt"))
