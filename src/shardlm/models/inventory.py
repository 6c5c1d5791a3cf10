"""Every checkpoint tensor of a model, by name and shape, computed from ModelArgs alone.

The planner counts bytes from this list (no weights, no model object), so it also covers families
the runtime cannot run yet (Mixtral). A test checks it against the meta-device model's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.models.args import ModelArgs


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as stored in a Hugging Face checkpoint."""

    name: str
    """Checkpoint name, e.g. "model.layers.3.mlp.up_proj.weight"."""
    shape: tuple[int, ...]
    """Full (unsharded) shape."""
    layer: int | None
    """Decoder layer index, or None for the embedding, the final norm and the LM head."""
    part: str
    """What it belongs to: "embed", "attention", "mlp", "experts", "norm" or "head"."""
    linear: bool
    """True for a linear-layer weight (what weight-only quantization applies to)."""

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n


def _attention(a: ModelArgs, p: str, i: int) -> list[TensorInfo]:
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    out = [TensorInfo(f"{p}.self_attn.q_proj.weight", (q, a.dim), i, "attention", True),
           TensorInfo(f"{p}.self_attn.k_proj.weight", (kv, a.dim), i, "attention", True),
           TensorInfo(f"{p}.self_attn.v_proj.weight", (kv, a.dim), i, "attention", True),
           TensorInfo(f"{p}.self_attn.o_proj.weight", (a.dim, q), i, "attention", True)]
    if a.attention_bias:
        out += [TensorInfo(f"{p}.self_attn.{n}_proj.bias", (w,), i, "attention", False)
                for n, w in (("q", q), ("k", kv), ("v", kv))]
    if a.o_bias:
        out.append(TensorInfo(f"{p}.self_attn.o_proj.bias", (a.dim,), i, "attention", False))
    return out


def _mlp(a: ModelArgs, p: str, i: int) -> list[TensorInfo]:
    f = a.intermediate_size
    if a.is_moe:  # Mixtral: a router plus n_experts gated MLPs named w1 (gate), w3 (up), w2 (down)
        out = [TensorInfo(f"{p}.block_sparse_moe.gate.weight", (a.n_experts, a.dim), i, "mlp", False)]
        for e in range(a.n_experts):
            x = f"{p}.block_sparse_moe.experts.{e}"
            out += [TensorInfo(f"{x}.w1.weight", (f, a.dim), i, "experts", True),
                    TensorInfo(f"{x}.w2.weight", (a.dim, f), i, "experts", True),
                    TensorInfo(f"{x}.w3.weight", (f, a.dim), i, "experts", True)]
        return out
    out = [TensorInfo(f"{p}.mlp.gate_proj.weight", (f, a.dim), i, "mlp", True),
           TensorInfo(f"{p}.mlp.up_proj.weight", (f, a.dim), i, "mlp", True),
           TensorInfo(f"{p}.mlp.down_proj.weight", (a.dim, f), i, "mlp", True)]
    if a.mlp_bias:
        out += [TensorInfo(f"{p}.mlp.{n}_proj.bias", (w,), i, "mlp", False)
                for n, w in (("gate", f), ("up", f), ("down", a.dim))]
    return out


def layer_tensors(a: ModelArgs, i: int) -> list[TensorInfo]:
    """Tensors of decoder layer `i`."""
    p = f"model.layers.{i}"
    norms = [TensorInfo(f"{p}.{n}.weight", (a.dim,), i, "norm", False)
             for n in ("input_layernorm", "post_attention_layernorm")]
    return norms[:1] + _attention(a, p, i) + norms[1:] + _mlp(a, p, i)


def outer_tensors(a: ModelArgs) -> dict[str, TensorInfo]:
    """The tensors outside the decoder layers by part: "embed", "norm" (final) and "head" (absent when tied)."""
    out = {"embed": TensorInfo("model.embed_tokens.weight", (a.vocab_size, a.dim), None, "embed", False),
           "norm": TensorInfo("model.norm.weight", (a.dim,), None, "norm", False)}
    if not a.tie_embeddings:
        out["head"] = TensorInfo("lm_head.weight", (a.vocab_size, a.dim), None, "head", True)
    return out


def tensor_inventory(a: ModelArgs) -> list[TensorInfo]:
    """All checkpoint tensors in model order; a tied LM head is not listed (it is the embedding)."""
    outer = outer_tensors(a)
    out = [outer["embed"]]
    for i in range(a.n_layers):
        out += layer_tensors(a, i)
    out.append(outer["norm"])
    if "head" in outer:
        out.append(outer["head"])
    return out


def parameter_count(a: ModelArgs) -> int:
    """Parameters of the model (a tied embedding counted once)."""
    return sum(t.numel for t in tensor_inventory(a))
