"""The analytic tensor inventory must list exactly the meta model's parameters, and presets must match
the published parameter counts."""

import pytest
import torch

from shardlm.models.args import ModelConfigError
from shardlm.models.inventory import parameter_count, tensor_inventory
from shardlm.models.presets import PRESETS, preset_config, resolve_config
from shardlm.models.registry import args_for_config
from tests.conftest import RANDOM_MODELS


def _hf_dict(cfg):
    if isinstance(cfg, dict):
        return cfg
    import transformers
    cls_name, kwargs = cfg  # a RANDOM_MODELS entry: (config class, kwargs)
    d = getattr(transformers, cls_name)(**kwargs).to_dict()
    return {**d, "architectures": [cls_name.replace("Config", "ForCausalLM")]}


def _meta_params(cfg):
    cfg = _hf_dict(cfg)
    fam, args = args_for_config(cfg)
    with torch.device("meta"):
        model = fam.model_class(args)
    tied = model.tied_weight_names()
    return args, {n: tuple(p.shape) for n, p in model.named_parameters() if n not in tied}


@pytest.mark.parametrize("cfg", [PRESETS["debug"], PRESETS["smollm2-135m"], PRESETS["llama-3.2-1b"],
                                 PRESETS["qwen2.5-72b"], *RANDOM_MODELS.values()],
                         ids=["debug", "smollm2", "llama32", "qwen72b", *RANDOM_MODELS])
def test_inventory_equals_meta_model(cfg):
    args, params = _meta_params(cfg)
    inv = {t.name: t.shape for t in tensor_inventory(args)}
    assert inv == params


# Published sizes (model cards): 8.03B, 70.6B, 405.9B, 7.25B, 72.7B, 46.7B, 135M.
@pytest.mark.parametrize("name,billions", [("llama-3.1-8b", 8.03), ("llama-3.1-70b", 70.55),
                                           ("llama-3.1-405b", 405.85), ("mistral-7b", 7.25),
                                           ("qwen2.5-72b", 72.71), ("mixtral-8x7b", 46.70),
                                           ("smollm2-135m", 0.1348)])
def test_public_presets_parameter_counts(name, billions):
    _, args = args_for_config(preset_config(name))
    assert parameter_count(args) / 1e9 == pytest.approx(billions, rel=0.005)


def test_mixtral_is_moe_and_not_runnable():
    from shardlm.models.registry import require_runnable
    fam, args = args_for_config(preset_config("mixtral-8x7b"))
    assert args.is_moe and args.n_experts == 8 and args.experts_per_token == 2 and fam.name == "mixtral"
    with pytest.raises(ModelConfigError, match="does not run it yet"):
        require_runnable(fam, args)


def test_unknown_preset_suggests_close_names():
    with pytest.raises(ModelConfigError, match="did you mean llama-3.1-8b"):
        preset_config("llama-3.1-8")
    with pytest.raises(ModelConfigError, match="does not exist"):
        resolve_config("./no/such/folder")
