"""Which long-context memory features a run uses, read from the DeepSpeed JSON.

    "sequence_parallel": {..., "tiled_loss_tokens": 2048, "tiled_mlp_tokens": 2048}   (0 = off)
    "activation_checkpointing": {"cpu_checkpointing": true}

The tiled loss and MLP are keys of ds_seqpar's own section (config.py). Checkpointing uses
DeepSpeed's own ``activation_checkpointing`` section: its presence checkpoints every decoder layer,
and ``cpu_checkpointing`` keeps the checkpoints in host memory. DeepSpeed's other keys in that
section describe its partitioned-activation buffers, which ds_seqpar does not use (the sequence
ranks already split the activations): a value other than the default is refused with the reason,
rather than silently ignored.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from ..config import ConfigError, SequenceParallelConfig, load_ds_config

KEY = "activation_checkpointing"
# DeepSpeed's key -> why ds_seqpar cannot honour a non-default value
_UNSUPPORTED = {
    "partition_activations": "it splits checkpoints over model-parallel ranks; here the sequence ranks already "
                             "hold disjoint tokens, so each rank's checkpoints are its own",
    "contiguous_memory_optimization": "it packs DeepSpeed's partitioned checkpoints into one buffer",
    "number_checkpoints": "it sizes DeepSpeed's contiguous checkpoint buffer; ds_seqpar checkpoints every "
                          "decoder layer",
    "synchronize_checkpoint_boundary": "it is a CUDA synchronisation inside DeepSpeed's checkpoint function",
    "profile": "it times DeepSpeed's checkpoint function",
}


class ActivationCheckpointingConfig(BaseModel):
    """DeepSpeed's ``activation_checkpointing`` section, as ds_seqpar reads it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_checkpointing: bool = False
    """Keep the checkpoints (everything the forward saves) in host memory, pinned on CUDA; copied
    back in the backward. On CPU there is nothing to move."""

    partition_activations: bool = False
    """Must stay false (see _UNSUPPORTED)."""

    contiguous_memory_optimization: bool = False
    """Must stay false."""

    number_checkpoints: Optional[int] = None
    """Must stay unset."""

    synchronize_checkpoint_boundary: bool = False
    """Must stay false."""

    profile: bool = False
    """Must stay false."""

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> "ActivationCheckpointingConfig":
        for key, why in _UNSUPPORTED.items():
            value = getattr(self, key)
            if value not in (False, None):
                raise ConfigError(f"{KEY}.{key}={value!r} is not supported by ds_seqpar: {why}; remove it (keys "
                                  f"honoured: cpu_checkpointing)")
        return self


@dataclass(frozen=True)
class MemoryConfig:
    """The memory features of one run; all off by default."""

    tiled_loss_tokens: int = 0          # local tokens per chunk of the fused LM head + loss
    tiled_mlp_tokens: int = 0           # local tokens per chunk of every decoder layer's MLP
    checkpointing: bool = False         # checkpoint every decoder layer
    cpu_checkpointing: bool = False     # ... and keep the checkpoints in host memory

    @classmethod
    def from_ds_config(cls, ds_config, sp_config: Optional[SequenceParallelConfig] = None) -> "MemoryConfig":
        ds = load_ds_config(ds_config)
        sp_config = sp_config or SequenceParallelConfig.from_ds_config(ds)
        ckpt = parse_checkpointing(ds.get(KEY))
        return cls(tiled_loss_tokens=sp_config.tiled_loss_tokens, tiled_mlp_tokens=sp_config.tiled_mlp_tokens,
                   checkpointing=ckpt is not None, cpu_checkpointing=bool(ckpt and ckpt.cpu_checkpointing))

    def as_dict(self) -> dict:
        return asdict(self)


def parse_checkpointing(section: Any) -> Optional[ActivationCheckpointingConfig]:
    """None when the section is absent (no checkpointing); else the validated section."""
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ConfigError(f"{KEY} must be an object like {{\"cpu_checkpointing\": true}} (or {{}}), got {section!r}")
    try:
        return ActivationCheckpointingConfig(**dict(section))
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(section)"
        if e["type"] == "extra_forbidden":
            known = ", ".join(ActivationCheckpointingConfig.model_fields)
            lines.append(f"{KEY}.{loc} is not a known key (value {e['input']!r}); known keys: {known}")
        elif e["type"] == "value_error" and isinstance(e.get("ctx", {}).get("error"), ConfigError):
            lines.append(str(e["ctx"]["error"]))
        else:
            lines.append(f"{KEY}.{loc}={e['input']!r}: {e['msg']}")
    return "; ".join(lines)


__all__ = ["ActivationCheckpointingConfig", "MemoryConfig", "parse_checkpointing", "KEY"]
