"""Activation-aware weight quantization (AWQ, Lin et al. 2023) for one block of any family perfx runs, in NumPy.

Per group of linears that read the same input, a per-input-channel scale ``s = mean|x| ** alpha`` (alpha on a
20-point grid over [0, 1]) is chosen to minimise the output error of the quantized layers; the weights'
columns are multiplied by s and 1/s is folded into whatever produces the input (an RMSNorm weight, or the
rows of the previous linear and its bias), which leaves the float model unchanged. Then, per output row and
group, the weight range is shrunk (clipped) by the ratio in 1.0 ... 0.5 that minimises that group's output
error. Quantization is int4, asymmetric, with an integer zero point, as weights.quantize_rtn stores it.

Why each fold is exact in every family (perfx_core.quant.forward is the block they preserve):

- q/k/v: attn_norm's output feeds only wq, wk, wv. RMSNorm weights are stored as applied ((1 + w) already
  added for Gemma), so dividing the stored weight by s divides the norm's output by s. The biases (Qwen2) add
  after the projection, the q/k norms (Qwen3, Gemma 3) act on its output: neither sees the scale.
- o: wo reads the attention output, a per-channel mix of v over positions (softmax weights come from q, k
  only), so dividing v's rows, and its bias, by s divides wo's input by s. Gemma's post-attention norm acts on
  wo's output, which is unchanged.
- gate/up: ffn_norm (Gemma's pre-feedforward norm) feeds only w_gate and w_up.
- down: w_down reads act(gate) * up; dividing up's rows by s divides that product by s for any activation of
  the gate. Gemma's post-feedforward norm acts on w_down's output, which is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..config import LlamaConfig
from ..weights import Int4Weight, int4_from_scale_zero
from .forward import BlockInputs

SCALE_GRID = 20  # alphas: linspace(0, 1, 20)
CLIP_RATIOS = tuple(1.0 - i / 20 for i in range(11))  # 1.0, 0.95, ..., 0.5


def quantize_groups(
    w: np.ndarray, group_size: int, max_abs: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes uint8 (rows, cols), scale float32 (rows, groups) rounded to fp16, integer zero float32 (rows, groups)).

    Same rule as weights.quantize_rtn (the range always includes 0); ``max_abs`` clips each group first.
    """
    rows, cols = w.shape
    groups = w.reshape(rows, cols // group_size, group_size)
    if max_abs is not None:
        groups = np.clip(groups, -max_abs[:, :, None], max_abs[:, :, None])
    lo = np.minimum(groups.min(axis=2), 0.0)
    hi = np.maximum(groups.max(axis=2), 0.0)
    scale = ((hi - lo) / 15.0).astype(np.float16).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1.0))
    zero = np.clip(np.round(-lo / scale), 0, 15)
    q = np.clip(np.round(groups / scale[:, :, None]) + zero[:, :, None], 0, 15)
    return q.reshape(rows, cols).astype(np.uint8), scale, zero.astype(np.float32)


def fake_quantize(w: np.ndarray, group_size: int, max_abs: np.ndarray | None = None) -> np.ndarray:
    """The float32 values int4 quantization turns w into."""
    q, scale, zero = quantize_groups(w, group_size, max_abs)
    rows, cols = w.shape
    g = q.reshape(rows, cols // group_size, group_size).astype(np.float32)
    return ((g - zero[:, :, None]) * scale[:, :, None]).reshape(rows, cols)


def to_int4(w: np.ndarray, group_size: int, max_abs: np.ndarray | None = None) -> Int4Weight:
    q, scale, zero = quantize_groups(w, group_size, max_abs)
    return int4_from_scale_zero(q, scale, zero, group_size)


class InputStats:
    """What the searches need of a linear's input x (tokens, in) to score a weight error dW (rows, in).

    The mean squared output error over tokens, mean_t |x_t dW^T|^2, is computed from x itself when there are
    few tokens, else from the Gram matrix x^T x / N (cost independent of the number of calibration tokens).
    """

    def __init__(self, x: np.ndarray):
        n, d = x.shape
        self.n = n
        self.x: np.ndarray | None = np.ascontiguousarray(x, dtype=np.float32) if n <= d else None
        self.gram: np.ndarray | None = None
        if self.x is None:
            x64 = x.astype(np.float64)
            self.gram = (x64.T @ x64 / n).astype(np.float32)

    def row_error(self, dw: np.ndarray) -> np.ndarray:
        """(rows,) mean squared output error of each output row."""
        if self.x is not None:
            return np.mean((self.x @ dw.T) ** 2, axis=0)
        return np.sum((dw @ self.gram) * dw, axis=1)

    def group_grams(self, group_size: int, scale: np.ndarray) -> np.ndarray:
        """(groups, g, g) diagonal blocks of the Gram matrix of x / scale."""
        d = scale.shape[0]
        n_groups = d // group_size
        if self.gram is not None:
            blocks = np.stack(
                [
                    self.gram[k * group_size : (k + 1) * group_size, k * group_size : (k + 1) * group_size]
                    for k in range(n_groups)
                ]
            )
        else:
            xg = self.x.reshape(self.n, n_groups, group_size).transpose(1, 0, 2)  # (G, N, g)
            blocks = xg.transpose(0, 2, 1) @ xg / np.float32(self.n)
        inv = (1.0 / scale).astype(np.float32).reshape(n_groups, group_size)
        return (blocks * inv[:, :, None] * inv[:, None, :]).astype(np.float32)


def search_scale(
    stats: InputStats,
    x_mean: np.ndarray,
    weights: list[np.ndarray],
    group_sizes: list[int],
    channel_of: np.ndarray | None = None,
) -> tuple[np.ndarray, float, float]:
    """The best AWQ scale for linears ``weights`` (each (out, in)) that all read the input described by ``stats``.

    ``x_mean``: mean |x| per input channel, over all calibration tokens. ``channel_of`` maps each input channel
    to a scale index when several channels must share one scale (v -> o under grouped-query attention).
    Returns (scale per scale index, error at alpha = 0 (plain RTN), best error); errors are summed over outputs.
    """
    if channel_of is None:
        channel_of = np.arange(x_mean.shape[0])
    counts = np.bincount(channel_of)
    stat = np.bincount(channel_of, weights=x_mean) / counts
    best, best_s, rtn_err = np.inf, np.ones(len(counts), np.float32), np.inf
    for alpha in np.linspace(0.0, 1.0, SCALE_GRID):
        s = np.maximum(stat, 1e-4) ** alpha
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        full = s[channel_of]
        err = 0.0
        for w, g in zip(weights, group_sizes, strict=True):
            err += float(np.sum(stats.row_error(w - fake_quantize(w * full, g) / full)))
        if alpha == 0.0:
            rtn_err = err
        if err < best:
            best, best_s = err, s
    return best_s, rtn_err, best


def search_clip(grams: np.ndarray, w: np.ndarray, group_size: int) -> np.ndarray:
    """Per (row, group) clipping bound max|w| * ratio minimising that group's output error.

    ``grams``: (groups, g, g) Gram blocks of the (scaled) input, from InputStats.group_grams.
    """
    rows, cols = w.shape
    n_groups = cols // group_size
    wg = w.reshape(rows, n_groups, group_size)
    org_max = np.abs(wg).max(axis=2)  # (rows, G)
    best_max = org_max.copy()
    best_err = np.full((rows, n_groups), np.inf, dtype=np.float32)
    for ratio in CLIP_RATIOS:
        bound = org_max * np.float32(ratio)
        dw = (wg - fake_quantize(w, group_size, bound).reshape(rows, n_groups, group_size)).transpose(
            1, 0, 2
        )  # (G, r, g)
        err = np.sum((dw @ grams) * dw, axis=2).T  # (r, G)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_max = np.where(better, bound, best_max)
    return best_max


@dataclass
class BlockReport:
    """Output errors (mean squared, summed over a group's outputs) before and after the scale search."""

    rtn_error: dict[str, float] = field(default_factory=dict)
    awq_error: dict[str, float] = field(default_factory=dict)


def awq_block(
    w: dict[str, np.ndarray],
    inputs: BlockInputs,
    config: LlamaConfig,
    group_sizes: dict[str, int],
    loss_tokens: np.ndarray,
) -> tuple[dict[str, Int4Weight], BlockReport]:
    """Scale, clip and quantize one block's linears; ``w`` (float32) gets its norms, weights and v bias rescaled
    in place.

    ``loss_tokens`` index the rows of ``inputs`` used to measure output errors in both searches.
    """
    report = BlockReport()
    gs = group_sizes
    group = config.n_heads // config.n_kv_heads
    # o's input channel (head h, dim d) comes from v's row (kv head h // group, d).
    head = np.arange(config.q_dim) // config.head_dim
    v_row_of_o_in = (head // group) * config.head_dim + np.arange(config.q_dim) % config.head_dim

    stats = {
        key: InputStats(x[loss_tokens])
        for key, x in (("attn", inputs.attn_in), ("o", inputs.o_in), ("ffn", inputs.ffn_in), ("down", inputs.down_in))
    }

    def search(
        name: str, key: str, x: np.ndarray, names: list[str], channel_of: np.ndarray | None = None
    ) -> np.ndarray:
        x_mean = np.abs(x).mean(axis=0)
        s, rtn_err, err = search_scale(stats[key], x_mean, [w[n] for n in names], [gs[n] for n in names], channel_of)
        report.rtn_error[name], report.awq_error[name] = rtn_err, err
        return s

    # Scales are all searched on the float model's activations, then folded (the float function is unchanged).
    s_qkv = search("qkv", "attn", inputs.attn_in, ["wq", "wk", "wv"])
    s_vo = search("o", "o", inputs.o_in, ["wo"], v_row_of_o_in)
    s_ffn = search("gate_up", "ffn", inputs.ffn_in, ["w_gate", "w_up"])
    s_down = search("down", "down", inputs.down_in, ["w_down"])

    w["attn_norm"] = w["attn_norm"] / s_qkv
    for n in ("wq", "wk", "wv"):
        w[n] = w[n] * s_qkv
    w["wv"] = w["wv"] / s_vo[:, None]
    if config.qkv_bias:  # v = x wv^T + bv: the bias divides with the rows, or v would not be v / s
        w["bv"] = w["bv"] / s_vo
    w["wo"] = w["wo"] * s_vo[v_row_of_o_in]
    w["ffn_norm"] = w["ffn_norm"] / s_ffn
    w["w_gate"], w["w_up"] = w["w_gate"] * s_ffn, w["w_up"] * s_ffn
    w["w_up"] = w["w_up"] / s_down[:, None]
    w["w_down"] = w["w_down"] * s_down

    x_of = {  # each linear's input after folding: the float input divided by its scale
        "wv": ("attn", s_qkv),
        "wo": ("o", s_vo[v_row_of_o_in]),
        "w_gate": ("ffn", s_ffn),
        "w_up": ("ffn", s_ffn),
        "w_down": ("down", s_down),
    }
    out: dict[str, Int4Weight] = {}
    for n in ("wq", "wk"):  # as published: q/k are not clipped (their error is hard to judge without softmax)
        out[n] = to_int4(w[n], gs[n])
    for n, (key, s) in x_of.items():
        bound = search_clip(stats[key].group_grams(gs[n], s), w[n], gs[n])
        out[n] = to_int4(w[n], gs[n], bound)
    return out, report
