"""Golden test: perfx against Hugging Face transformers (PyTorch, CPU) loading the same GGUF file."""

from __future__ import annotations

import numpy as np
import pytest
from golden_text import GOLDEN_TEXT

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    )
    model.eval()
    return model


def nmse(a: np.ndarray, ref: np.ndarray) -> float:
    a, ref = a.astype(np.float64), ref.astype(np.float64)
    return float(np.sum((a - ref) ** 2) / np.sum(ref**2))


def test_logits_match_transformers(smollm2, hf_model):
    ids = smollm2.tokenizer.encode(GOLDEN_TEXT)[:128]
    assert len(ids) == 128
    ours = smollm2.logits(ids)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0].numpy()
    assert ours.shape == theirs.shape == (128, 49152)
    error = nmse(ours, theirs)
    agreement = float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))
    print(f"NMSE {error:.2e}, top-1 agreement {agreement:.3f}")
    assert error < 1e-3
    assert agreement >= 0.99


def test_greedy_generation_says_paris(smollm2, hf_model):
    generation = smollm2.generate("The capital of France is", max_tokens=8, temperature=0)
    text = generation.run()
    assert "Paris" in text
    prompt = smollm2.tokenizer.encode("The capital of France is", add_special=True)
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
    assert generation.token_ids == theirs.tolist()[: len(generation.token_ids)]
