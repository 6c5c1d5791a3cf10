"""Model families: how to read each one's config, build it, split it, and name its tensors."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from shardlm.models import llama_config
from shardlm.models.args import ModelArgs, ModelConfigError
from shardlm.models.presets import PRESETS
from shardlm.parallel.styles import Colwise, ColwiseHeads, Rowwise, RowwiseHeads, Style, VocabEmbedding, VocabHead

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Family:
    """One registry entry: everything shardlm needs to know about a model family."""

    name: str
    architectures: tuple[str, ...]
    """Hugging Face `architectures` values this family runs."""
    args_from_hf: Callable[[dict[str, Any]], ModelArgs]
    model_ref: str | None
    """"module:Class" of the single-device model; None for a family that is planned and inspected
    but not run yet. Imported on first use, so that reading configs and planning import no torch."""
    tp_plan: dict[str, Style]
    """Module-name pattern -> tensor-parallel style."""
    checkpoint_name: Callable[[str], str]
    """Model parameter name -> tensor name in the family's checkpoints."""
    presets: dict[str, dict[str, Any]]
    """Named HF-style configs (random-weight shapes for tests and benchmarks)."""

    @property
    def model_class(self) -> "Callable[[ModelArgs], nn.Module] | None":
        """The single-device model class (imports it, and torch, on first use), or None."""
        if self.model_ref is None:
            return None
        module, _, name = self.model_ref.partition(":")
        return getattr(importlib.import_module(module), name)


LLAMA_TP_PLAN: dict[str, Style] = {
    "model.embed_tokens": VocabEmbedding(),
    "model.layers.*.self_attn.q_proj": ColwiseHeads("q"),
    "model.layers.*.self_attn.k_proj": ColwiseHeads("kv"),
    "model.layers.*.self_attn.v_proj": ColwiseHeads("kv"),
    "model.layers.*.self_attn.o_proj": RowwiseHeads(),
    "model.layers.*.mlp.gate_proj": Colwise(),
    "model.layers.*.mlp.up_proj": Colwise(),
    "model.layers.*.mlp.down_proj": Rowwise(),
    "lm_head": VocabHead(),
}

LLAMA_PRESETS: dict[str, dict[str, Any]] = {k: v for k, v in PRESETS.items() if "num_local_experts" not in v}

MIXTRAL_TP_PLAN: dict[str, Style] = {
    **{k: v for k, v in LLAMA_TP_PLAN.items() if ".mlp." not in k},
    # Each expert's MLP is split like a dense one (TP inside the experts); the router is replicated.
    "model.layers.*.block_sparse_moe.experts.*.w1": Colwise(),
    "model.layers.*.block_sparse_moe.experts.*.w3": Colwise(),
    "model.layers.*.block_sparse_moe.experts.*.w2": Rowwise(),
}

FAMILIES: dict[str, Family] = {
    "llama": Family(
        name="llama",
        architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
        args_from_hf=llama_config.args_from_hf,
        model_ref="shardlm.models.llama:LlamaForCausalLM",
        tp_plan=LLAMA_TP_PLAN,
        checkpoint_name=lambda name: name,  # module names already follow HF checkpoints
        presets=LLAMA_PRESETS,
    ),
    "mixtral": Family(
        name="mixtral",
        architectures=("MixtralForCausalLM",),
        args_from_hf=llama_config.args_from_hf,
        model_ref=None,  # planned and inspected; the runtime does not run mixture-of-experts yet
        tp_plan=MIXTRAL_TP_PLAN,
        checkpoint_name=lambda name: name,
        presets={k: v for k, v in PRESETS.items() if "num_local_experts" in v},
    ),
}


def supported_architectures() -> list[str]:
    """Every Hugging Face architecture name some family runs."""
    return sorted(a for f in FAMILIES.values() for a in f.architectures)


def family_for_config(cfg: dict[str, Any]) -> Family:
    """The family that runs this HF config, or a ModelConfigError listing the supported ones."""
    archs = cfg.get("architectures") or []
    for fam in FAMILIES.values():
        if any(a in fam.architectures for a in archs):
            return fam
    raise ModelConfigError(
        f"architecture {', '.join(archs) or '(none given)'} is not supported; supported architectures: "
        f"{', '.join(supported_architectures())}"
    )


def args_for_config(cfg: dict[str, Any]) -> tuple[Family, ModelArgs]:
    """Family and ModelArgs for an HF config dict."""
    fam = family_for_config(cfg)
    return fam, fam.args_from_hf(cfg)


def require_runnable(family: Family, args: ModelArgs) -> None:
    """Raise ModelConfigError when the runtime cannot run this family yet (it can still be planned)."""
    if family.model_ref is None:
        raise ModelConfigError(
            f"{args.architecture} ({family.name}, mixture-of-experts) can be inspected and planned, but the runtime "
            f"does not run it yet; runnable architectures: {', '.join(FAMILIES['llama'].architectures)}")
