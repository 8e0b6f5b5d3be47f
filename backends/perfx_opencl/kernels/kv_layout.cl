// The KV cache's layout, (layer, slot, kv_head, position, head_dim): where an entry's first element is.
inline size_t cache_index(int layer, int slot, int kv_head, int pos, int n_slots, int n_kv, int max_seq, int hd) {
    return ((((size_t)layer * n_slots + slot) * n_kv + kv_head) * max_seq + pos) * hd;
}
