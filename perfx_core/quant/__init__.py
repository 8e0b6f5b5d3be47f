"""Int4 quantization (round-to-nearest and AWQ) into perfx's model format, and perplexity evaluation.

``quantize(src, out, method="awq", group_size=128, calib=None)`` converts a Hugging Face directory or a GGUF
of any family perfx runs (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3);
``perfx_core.quant.eval.perplexity(model, text, ctx, stride)`` scores a loaded model.
"""

from .quantize import METHODS, QuantizeReport, quantize

__all__ = ["METHODS", "QuantizeReport", "quantize"]
