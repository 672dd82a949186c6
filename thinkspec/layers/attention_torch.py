"""Reference attention backend: gather each sequence's paged KV, then torch SDPA.

Slow by design (a Python loop over sequences) and simple enough to trust: it is the ground
truth for the fused kernels. Runs on CPU and GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from thinkspec.layers.forward_context import AttentionMetadata


def store_kvcache(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = padding row, not written
) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[valid].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[valid].to(v_cache.dtype)


class TorchAttentionBackend:
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] or empty
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] or empty
        meta: AttentionMetadata,
        scale: float,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [T, Hq, D]; rows outside every sequence (padding) are zero
        has_cache = k_cache.numel() > 0
        if has_cache and not kv_stored:
            store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.zeros_like(q)
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        for b, seq_len in enumerate(seq_lens):
            start, end = starts[b], starts[b + 1]
            qlen = end - start
            if qlen == 0:
                continue
            if qlen > seq_len:
                raise ValueError(f"sequence {b}: query_len={qlen} exceeds seq_len={seq_len}")
            if has_cache:
                block_size = k_cache.shape[1]
                blocks = meta.block_tables[b, : (seq_len + block_size - 1) // block_size].long()
                keys = k_cache[blocks].flatten(0, 1)[:seq_len]  # [L, Hkv, D]
                values = v_cache[blocks].flatten(0, 1)[:seq_len]
            else:
                # No pool yet (e.g. a profiling run): only whole prompts can attend, to themselves.
                if qlen != seq_len:
                    raise ValueError("attention without a KV cache needs query_len == seq_len")
                keys, values = k[start:end], v[start:end]
            out[start:end] = _causal_sdpa(q[start:end], keys, values, scale)
        return out


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [Lq, Hq, D] at the last Lq positions of k/v: [L, Hkv, D] -> [Lq, Hq, D]
    qlen, seq_len = q.shape[0], k.shape[0]
    q_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)
    k_pos = torch.arange(seq_len, device=q.device)
    mask = k_pos[None, :] <= q_pos[:, None]  # [Lq, L] bool, True = attend
    group = q.shape[1] // k.shape[1]
    k = k.to(q.dtype).repeat_interleave(group, dim=1)
    v = v.to(q.dtype).repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return o.transpose(0, 1)


class PaddedTorchAttentionBackend:
    """Decode and verify steps as one batched SDPA over padded [B, max_query_len, max_seq_len].

    The same math as TorchAttentionBackend without its Python loop over sequences, for steps whose
    queries are all short (single-token decode, k+1-token verification); steps with a long query
    (prefill chunks), or no KV pool yet, go to the loop backend. Everything stays on the device:
    the only host values used are meta.max_query_len / meta.max_seq_len.
    """

    max_query_len = 16

    def __init__(self) -> None:
        self.loop = TorchAttentionBackend()

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] or empty
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] or empty
        meta: AttentionMetadata,
        scale: float,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [T, Hq, D]; padding rows are zero
        if k_cache.numel() == 0 or meta.max_query_len > self.max_query_len:
            return self.loop.forward(q, k, v, k_cache, v_cache, meta, scale, kv_stored)
        if not kv_stored:
            store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        num_seqs, q_max, seq_max = meta.num_seqs, max(1, meta.max_query_len), meta.max_seq_len
        dev = q.device
        starts = meta.query_start_loc.long()  # [B+1]
        seq_lens = meta.seq_lens.long()  # [B]
        # Token t -> (sequence b, query slot j); padding tokens (past the last sequence) get b = B.
        t = torch.arange(num_tokens, device=dev)
        b = torch.searchsorted(starts[1:], t, right=True)  # [T]
        valid = b < num_seqs
        j = (t - starts[b.clamp(max=num_seqs - 1)]).clamp(0, q_max - 1)
        q_pad = q.new_zeros(num_seqs + 1, q_max, num_heads, head_dim)  # row B: a sink for padding
        q_pad[b, j] = q

        block_size = k_cache.shape[1]
        tables = meta.block_tables[:, : -(-seq_max // block_size)].long().clamp(min=0)  # [B, nblk]
        key_pos = torch.arange(seq_max, device=dev)
        in_seq = (key_pos[None, :] < seq_lens[:, None])[:, :, None, None]  # [B, L, 1, 1]
        # Slots past a sequence's end may hold anything (stale or unwritten): zero them.
        keys = torch.where(in_seq, k_cache[tables].flatten(1, 2)[:, :seq_max], 0).to(q.dtype)
        values = torch.where(in_seq, v_cache[tables].flatten(1, 2)[:, :seq_max], 0).to(q.dtype)
        group = num_heads // keys.shape[2]
        keys = keys.repeat_interleave(group, dim=2)  # [B, L, Hq, D]
        values = values.repeat_interleave(group, dim=2)
        q_len = starts[1:] - starts[:-1]
        q_pos = (seq_lens - q_len)[:, None] + torch.arange(q_max, device=dev)[None, :]  # [B, Qmax]
        mask = key_pos[None, None, :] <= q_pos[:, :, None]  # [B, Qmax, L]; key 0 always allowed
        o = F.scaled_dot_product_attention(
            q_pad[:num_seqs].transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None],
            scale=scale,
        ).transpose(1, 2)  # [B, Qmax, Hq, D]
        out = o[b.clamp(max=num_seqs - 1), j]
        return torch.where(valid[:, None, None], out, 0)
