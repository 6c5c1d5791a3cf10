"""Single-device Llama-family model: Llama 2/3 (incl. llama3 rope scaling), Mistral, Qwen2, SmolLM2.

Module and parameter names follow the Hugging Face checkpoints, so loading is a name lookup.
Parallelism is applied from outside (`shardlm.parallel.tensor`): layers infer their local head
counts from tensor sizes, and `Attention.kv_map` says which local KV head serves each local
query head (a plain GQA grouping on one device, an irregular one under uneven TP splits).
"""

from __future__ import annotations

import math
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.models.args import ModelArgs


class Cache(Protocol):
    """What a layer needs of a KV cache (the runtime's KVCache is one)."""

    def update(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys and values (b, h, s, hd); return every filled slot (b, h, t, hd)."""


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse rotary frequencies (head_dim/2,), with llama3 or linear scaling applied."""
    hd = args.head_dim
    # always on CPU, even inside a meta-device build: scalar ops on meta go through torch._refs,
    # whose first use imports torch._dynamo (~1.4 s of every rank's start-up, measured)
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device="cpu").float() / hd))
    rs = args.rope_scaling
    if rs is None:
        return inv
    if rs["rope_type"] == "linear":
        return inv / float(rs["factor"])
    # llama3: long wavelengths are divided by `factor`, short ones kept, a smooth ramp between.
    factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old_len = float(rs["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(is_mid, mid, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for integer positions (b, s) -> each (b, 1, s, head_dim)."""
    freqs = positions.float()[..., None] * inv_freq[None, None, :]  # (b, s, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (b, s, hd)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (b, h, s, hd) by the half-split convention Hugging Face Llama checkpoints use."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like the reference implementation."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dimension and scale by the learned weight."""
        dtype = x.dtype
        x = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # x * rsqrt(mean(x^2) + eps), in float32
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings and an optional KV cache.

    `prefill_attention`, when a kernel is installed (CPU ranks, shardlm.kernels.fused), computes passes of more
    than one position: prefill_attention(q, k, v, kv_map, mask) -> (b, hq, s, hd), skipping the keys no query of
    a block may see; a position's result does not depend on the rows padded beside it or on where its chunk
    started (csrc/prefill_attn.h). Otherwise SDPA."""

    prefill_attention: Callable | None = None
    qkv_weight: torch.Tensor | None = None
    """q, k and v weights end to end (runtime/projections.py): one product instead of three."""
    qkv_bias: torch.Tensor | None = None
    qkv_split: list[int] | None = None

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        hd = args.head_dim
        self.layer_id = layer_id
        self.head_dim = hd
        self.q_proj = nn.Linear(args.dim, args.n_heads * hd, bias=args.attention_bias)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.attention_bias)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.attention_bias)
        self.o_proj = nn.Linear(args.n_heads * hd, args.dim, bias=args.o_bias)
        self.set_kv_map([h // args.q_per_kv for h in range(args.n_heads)])

    def set_kv_map(self, kv_map: list[int], device: str | torch.device | None = None) -> None:
        """kv_map[i] = local KV head read by local query head i (regular groups on one device)."""
        self.register_buffer("kv_map", torch.tensor(kv_map, dtype=torch.long, device=device), persistent=False)
        hq, hkv = len(kv_map), max(kv_map) + 1
        self.regular_gqa = hq % hkv == 0 and kv_map == [h // (hq // hkv) for h in range(hq)]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                cache: Cache | None) -> torch.Tensor:
        """x (b, s, dim) -> (b, s, dim); mask (b, 1, s, t) is True where a key may be attended."""
        if self.qkv_weight is not None:
            q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split(self.qkv_split, dim=-1)  # (b, s, h*hd) each
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(self.attend(q, k, v, cos, sin, mask, cache))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               mask: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        """Attention from the projected q (b, s, hq*hd), k and v (b, s, hkv*hd): rotary, the cache, then the
        heads' outputs side by side (b, s, hq*hd), before o_proj."""
        b, s, _ = q.shape
        hd = self.head_dim
        q = q.view(b, s, -1, hd).transpose(1, 2)  # (b, hq, s, hd)
        k = k.view(b, s, -1, hd).transpose(1, 2)  # (b, hkv, s, hd)
        v = v.view(b, s, -1, hd).transpose(1, 2)  # (b, hkv, s, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_id, k, v)  # (b, hkv, t, hd)
        if self.prefill_attention is not None and s > 1 and q.device.type == "cpu" and q.dtype == k.dtype:
            out = self.prefill_attention(q.contiguous(), k.contiguous(), v.contiguous(), self.kv_map,
                                         mask.expand(b, 1, s, k.shape[2]).contiguous())  # (b, hq, s, hd)
        else:
            out = grouped_attention(q, k, v, self.kv_map, mask, self.regular_gqa)  # (b, hq, s, hd)
        return out.transpose(1, 2).reshape(b, s, -1)  # (b, s, hq*hd)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_map: torch.Tensor,
                      mask: torch.Tensor, regular: bool) -> torch.Tensor:
    """Scaled dot-product attention where query head i reads KV head kv_map[i].

    Regular groups (each KV head serves the same number of consecutive query heads) copy no K/V: with one position
    a row (decode) a KV head's query heads attend as that many query positions of one head, a plain SDPA call that
    CUDA's memory-efficient kernel also takes (with a mask, SDPA's GQA path is cuDNN's kernel or the math kernel,
    which repeats K/V); with more positions, SDPA's GQA path. Irregular groups (uneven TP splits) gather K/V per
    query head.
    """
    b, hq, s, hd = q.shape
    hkv = k.shape[1]
    if regular and s == 1 and hq != hkv:
        folded = q.reshape(b, hkv, hq // hkv, hd)  # (b, hkv, rep, hd): query head kv*rep + r as position r
        out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask)  # mask (b, 1, 1, t) over the rep rows
        return out.reshape(b, hq, 1, hd)
    if regular:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hq != hkv)
    k = k.index_select(1, kv_map)  # (b, hq, t, hd)
    v = v.index_select(1, kv_map)  # (b, hq, t, hd)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class MLP(nn.Module):
    """Gated SiLU MLP: down(silu(gate(x)) * up(x))."""

    gate_up_weight: torch.Tensor | None = None
    """gate and up weights end to end (runtime/projections.py): one product instead of two."""
    gate_up_bias: torch.Tensor | None = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.dim, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, s, dim) -> (b, s, dim)."""
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)  # (b, s, inter) each
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.))."""

    decode_step: Callable | None = None
    """A whole-block step the runtime may install from outside (the fused CPU decode kernel): called as
    decode_step(layer, x, cos, sin, mask, cache), it returns the block's output, or None when it does not
    apply to this call (the block then runs module by module)."""
    prefill_step: Callable | None = None
    """The same for a pass of several positions a row (the compiled element-wise work of a float32 CPU prefill,
    shardlm.kernels.prefill): called alike, None when it does not apply."""

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.self_attn = Attention(args, layer_id)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, mask, cache):
        """One block; shapes as in `Attention.forward`."""
        if self.decode_step is not None:
            out = self.decode_step(self, x, cos, sin, mask, cache)
            if out is not None:
                return out
        if self.prefill_step is not None:
            out = self.prefill_step(self, x, cos, sin, mask, cache)
            if out is not None:
                return out
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    """Embedding, decoder layers and final norm (the `model.` prefix of HF checkpoints).

    `layers` is keyed by the layer number as a string, so a pipeline stage that keeps layers
    20..29 still names them `model.layers.20...` like the checkpoint. A stage without the
    embedding or the final norm holds None there.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        # On meta, skip nn.Embedding's normal_ init: on a meta tensor it imports torch._dynamo (~1.4 s
        # of every rank's start-up, measured); the weights are loaded afterwards anyway.
        meta = torch.get_default_device().type == "meta"
        weight = torch.empty(args.vocab_size, args.dim) if meta else None
        self.embed_tokens: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim, _weight=weight)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(args, i) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)


class LlamaForCausalLM(nn.Module):
    """The whole decoder with its LM head; `forward` returns logits for the requested positions."""

    decode_stack: Callable | None = None
    """A step through every layer the runtime may install from outside (all fused CPU decode blocks in one
    call): called as decode_stack(x, cos, sin, mask, cache), it returns the layers' output, or None when it does
    not apply to this call (the layers then run one by one)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    def forward(self, inputs: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                cache: Cache | None = None, last_only: bool = False,
                last_index: torch.Tensor | None = None) -> torch.Tensor:
        """Run the layers this model (or pipeline stage) holds.

        inputs: token ids (b, s) when it holds the embedding, else hidden states (b, s, dim) from the
        previous stage; positions (b, s); mask (b, 1, s, t) bool. Returns logits (b, s or 1, vocab)
        float32 when it holds the LM head, else hidden states (b, s, dim) for the next stage. With
        `last_only`, logits of one position per row: the last, or `last_index` (b,) for right-padded rows.
        """
        x = self.model.embed_tokens(inputs) if self.model.embed_tokens is not None else inputs  # (b, s, dim)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        stacked = self.decode_stack(x, cos, sin, mask, cache) if self.decode_stack is not None else None
        if stacked is not None:
            x = stacked
        else:
            for layer in self.model.layers.values():
                x = layer(x, cos, sin, mask, cache)
        if self.lm_head is None:
            return x
        if last_only and last_index is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last_index][:, None]  # (b, 1, dim)
        elif last_only:
            x = x[:, -1:]  # (b, 1, dim)
        x = self.model.norm(x)
        return self.lm_head(x).float()

    def keep_stage(self, start: int, stop: int, first: bool, last: bool) -> None:
        """Drop everything outside one pipeline stage: layers [start, stop), the embedding unless
        `first`, the final norm and LM head unless `last` (call on the meta device, before loading)."""
        self.model.layers = nn.ModuleDict({k: v for k, v in self.model.layers.items() if start <= int(k) < stop})
        if not first:
            self.model.embed_tokens = None
        if not last:
            self.model.norm = None
            self.lm_head = None

    def tied_weight_names(self) -> dict[str, str]:
        """Parameters that alias another one held here and are not loaded on their own (target -> source)."""
        both = self.model.embed_tokens is not None and self.lm_head is not None
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.args.tie_embeddings and both else {}

    def checkpoint_aliases(self) -> dict[str, str]:
        """Parameters read from another tensor's checkpoint entry: a last pipeline stage without the
        embedding reads a tied LM head from `model.embed_tokens.weight`."""
        alone = self.model.embed_tokens is None and self.lm_head is not None
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.args.tie_embeddings and alone else {}

    def reset_buffers(self, device: str | torch.device = "cpu") -> None:
        """Recompute the non-persistent buffers (rotary frequencies, GQA map) after a meta build."""
        self.inv_freq = rope_inv_freq(self.args).to(device)
        for layer in self.model.layers.values():
            layer.self_attn.set_kv_map([h // self.args.q_per_kv for h in range(self.args.n_heads)], device)
