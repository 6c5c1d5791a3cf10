"""ModelSource: a checkpoint folder with its family and shape, read once by the driver and sent to ranks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardlm.models.args import ModelArgs, read_config
from shardlm.models.registry import FAMILIES, Family, args_for_config
from shardlm.quant_spec import checkpoint_quantization


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights are and what they are (picklable; torch-free)."""

    folder: str
    """An ordinary Hugging Face checkpoint folder, or per-rank files written by `shardlm shard`."""
    family_name: str
    """The registry family (FAMILIES key)."""
    args: ModelArgs
    """The model's shape, from its config.json."""
    quantization: str | None = None
    """"int8"/"int4" when the checkpoint stores quantized linear weights (`shardlm convert --quantization`)."""

    @classmethod
    def open(cls, folder: str | Path) -> "ModelSource":
        """Read `folder`'s config.json; ModelConfigError for an unknown architecture or a bad config."""
        cfg = read_config(Path(folder))
        family, args = args_for_config(cfg)
        return cls(str(folder), family.name, args, checkpoint_quantization(cfg))

    @property
    def family(self) -> Family:
        """The registry entry of its family."""
        return FAMILIES[self.family_name]
