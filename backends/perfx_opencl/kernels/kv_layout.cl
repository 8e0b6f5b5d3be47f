// What every attention kernel shares: the KV cache's layout, (layer, slot, kv_head, position, head_dim), and the
// optional features of the families beyond Llama, as build options of the kernel (ops.py _feature_defines):
// -DWINDOW=W: a query at position p sees the keys at p - W + 1 .. p (sliding-window layers);
// -DSOFTCAP=C (a float literal): a score s becomes C * tanh(s / C) before the softmax (Gemma 2).
// (The other feature, a custom score scale, is the kernels' score_scale argument.)
inline size_t cache_index(int layer, int slot, int kv_head, int pos, int n_slots, int n_kv, int max_seq, int hd) {
    return ((((size_t)layer * n_slots + slot) * n_kv + kv_head) * max_seq + pos) * hd;
}

#ifdef WINDOW
#define WINDOW_START(pos) max(0, (pos) - (WINDOW) + 1)  // the first key position a query at pos sees
#else
#define WINDOW_START(pos) 0
#endif
// A score s in units of `unit` (1, or log2(e) for kernels that work in exp2) soft-capped in natural units.
#ifdef SOFTCAP
#define CAPPED(s, unit) ((SOFTCAP) * (unit) * tanh((s) / ((SOFTCAP) * (unit))))
#else
#define CAPPED(s, unit) (s)
#endif
