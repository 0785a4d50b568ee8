"""The ``"sequence_parallel"`` key of a DeepSpeed JSON config: one typed, self-validating section.

Every error names the key, the bad value and what would be valid, so that a user who mistypes a
strategy or a size learns the fix from the message alone. Nothing here talks to processes; the
checks that need the world size (``size`` dividing it) take it as an argument.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import ConfigError
from .kernels import BACKENDS
from .strategies import RING_STRATEGIES, STRATEGIES

KEY = "sequence_parallel"
STRATEGY_NAMES = tuple(STRATEGIES)          # the registry is the one list of strategies
LASP_COMMS = ("allgather", "ring")
LINEAR_STRATEGIES = ("lasp", "ulysses")
COMM_DTYPES = ("auto", "fp32", "bf16", "fp16")
DS_COMM_DTYPE_KEY = "seq_parallel_communication_data_type"     # DeepSpeed's own key, same values


class SequenceParallelConfig(BaseModel):
    """Schema of ``"sequence_parallel": {...}`` in a DeepSpeed config."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: str = "ulysses"
    """How attention is split across ranks: ulysses | ring | zigzag | striped | lasp."""

    size: int = Field(default=1, ge=1)
    """Sequence-parallel degree; the data-parallel degree is world_size / size."""

    ulysses_size: int = Field(default=1, ge=1)
    """> 1 with ring/zigzag/striped: 2D hybrid, Ulysses all-to-all inside groups of this many
    neighbouring ranks and the ring across the groups. Must divide ``size``."""

    backend: str = "auto"
    """Local attention kernel: auto | flash_attn | torch | math. ``auto`` picks flash_attn on CUDA
    when installed, else torch, and logs what it picked."""

    lasp_comm: str = "allgather"
    """LASP state exchange: allgather (LASP-2) | ring (LASP-1)."""

    linear_strategy: str = "lasp"
    """How a hybrid model's linear-attention and convolution layers are split (``strategy`` keeps
    choosing the softmax layers'): lasp (state passing, exchanged as ``lasp_comm`` says; the
    convolutions get a halo of the previous tokens) | ulysses (head all-to-all: whole sequences of
    a P-th of the heads, the simple baseline)."""

    overlap: bool = True
    """Post the next ring / state transfer before computing on the current block."""

    timeout_s: float = Field(default=600.0, gt=0)
    """Seconds a collective may wait for a peer before the run stops with an error."""

    comm_dtype: str = "auto"
    """dtype q, k, v and the attention output travel in between ranks: auto (the dtype the model
    gives them: bf16 in a bf16 run, half the bytes of fp32) | fp32 | bf16 | fp16. Otherwise they
    are cast to it for the sequence-parallel attention, whose local kernel then computes in it too.
    Merges, the ring's dK/dV accumulators and LASP states stay fp32 in every case. DeepSpeed's
    seq_parallel_communication_data_type, when present, sets it."""

    tiled_loss_tokens: int = Field(default=0, ge=0)
    """> 0: the LM head and the loss run fused over chunks of this many local tokens, so the
    [tokens, vocab] logits never exist at once (sp.loss_from_hidden); exact. 0 = off."""

    tiled_mlp_tokens: int = Field(default=0, ge=0)
    """> 0: every decoder layer's MLP runs over chunks of this many local tokens in forward and
    backward (memory.tile_mlps); exact. 0 = off."""

    @model_validator(mode="after")
    def _check_choices(self) -> "SequenceParallelConfig":
        _check_choice("strategy", self.strategy, STRATEGY_NAMES)
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("lasp_comm", self.lasp_comm, LASP_COMMS)
        _check_choice("linear_strategy", self.linear_strategy, LINEAR_STRATEGIES)
        _check_choice("comm_dtype", self.comm_dtype, COMM_DTYPES)
        if self.ulysses_size > 1 and self.strategy not in RING_STRATEGIES + ("ulysses",):
            raise ConfigError(
                f"{KEY}.ulysses_size={self.ulysses_size} combines only with a ring strategy "
                f"({', '.join(RING_STRATEGIES)}); strategy={self.strategy!r} needs ulysses_size=1")
        check_sizes(None, self.size, self.ulysses_size)
        if self.strategy == "ulysses" and self.ulysses_size not in (1, self.size):
            raise ConfigError(
                f"{KEY}.ulysses_size={self.ulysses_size} with strategy='ulysses' must be 1 or "
                f"equal to size={self.size}; for a 2D hybrid pick strategy ring, zigzag or striped")
        return self

    @property
    def ring_size(self) -> int:
        """Ranks along the ring dimension (size / ulysses_size); Ulysses alone has none."""
        return 1 if self.strategy == "ulysses" else self.size // self.ulysses_size

    @property
    def effective_ulysses_size(self) -> int:
        return self.size if self.strategy == "ulysses" else self.ulysses_size

    @property
    def is_hybrid(self) -> bool:
        """A ring strategy with ulysses_size > 1 runs as the 2D hybrid (strategies.build)."""
        return self.strategy in RING_STRATEGIES and self.ulysses_size > 1

    def check_world(self, world_size: int) -> None:
        """``size`` must divide the world: world = data-parallel x sequence-parallel."""
        check_sizes(world_size, self.size, self.effective_ulysses_size)

    @classmethod
    def from_ds_config(cls, ds_config: Union[str, os.PathLike, Mapping[str, Any]]) -> "SequenceParallelConfig":
        """Read the key from a DeepSpeed config dict or JSON file; absent key = no parallelism."""
        ds = load_ds_config(ds_config)
        section = ds.get(KEY, {})
        if not isinstance(section, Mapping):
            raise ConfigError(f"{KEY} must be an object like {{\"strategy\": \"ulysses\", \"size\": 2}}, "
                              f"got {section!r}")
        cfg = cls.parse(_with_deepspeed_comm_dtype(section, ds))
        ds_size = ds.get("sequence_parallel_size")
        if ds_size is not None and int(ds_size) != cfg.size:
            raise ConfigError(
                f"DeepSpeed's sequence_parallel_size={ds_size} disagrees with {KEY}.size={cfg.size}; "
                f"set both to the same value or remove sequence_parallel_size")
        return cfg

    @classmethod
    def parse(cls, section: Mapping[str, Any]) -> "SequenceParallelConfig":
        """Validate a plain dict, turning pydantic's report into one ConfigError message."""
        try:
            return cls(**dict(section))
        except ValidationError as err:
            raise ConfigError(_describe(err)) from None


def check_sizes(world_size: Optional[int], size: int, ulysses_size: int = 1) -> None:
    """world = data x sequence ranks and sequence = ring x Ulysses ranks: the one statement of these
    divisibility rules (the config's validation, check_world and topology.ParallelDims call it).
    ``world_size`` None: not known yet (validation before the world exists)."""
    if size < 1 or ulysses_size < 1:
        raise ConfigError(f"{KEY}.size={size} and {KEY}.ulysses_size={ulysses_size} must be >= 1")
    if size % ulysses_size:
        raise ConfigError(
            f"{KEY}.ulysses_size={ulysses_size} must divide {KEY}.size={size}; "
            f"valid ulysses_size values: {_divisors(size)}")
    if world_size is not None and world_size % size:
        raise ConfigError(
            f"{KEY}.size={size} does not divide the world size {world_size}; "
            f"valid sizes for this world: {_divisors(world_size)} "
            f"(or launch a multiple of {size} ranks)")


def _with_deepspeed_comm_dtype(section: Mapping[str, Any], ds: Mapping[str, Any]) -> Mapping[str, Any]:
    """DeepSpeed's seq_parallel_communication_data_type decides comm_dtype unless the section
    sets it; both set must agree (DeepSpeed's default, fp32, is not applied: see comm_dtype)."""
    theirs = ds.get(DS_COMM_DTYPE_KEY)
    if theirs is None:
        return section
    ours = section.get("comm_dtype")
    if ours is not None and ours != theirs:
        raise ConfigError(f"DeepSpeed's {DS_COMM_DTYPE_KEY}={theirs!r} disagrees with {KEY}.comm_dtype={ours!r}; "
                          f"set both to the same value or keep one")
    return dict(section, comm_dtype=theirs)


def _check_choice(field: str, value: str, valid: tuple) -> None:
    if value not in valid:
        raise ConfigError(f"{KEY}.{field}={value!r} is not valid; choose one of: {', '.join(valid)}")


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def load_ds_config(ds_config) -> Mapping[str, Any]:
    if isinstance(ds_config, Mapping):
        return ds_config
    path = os.fspath(ds_config)
    if not os.path.exists(path):
        raise ConfigError(f"DeepSpeed config file {path!r} does not exist")
    with open(path) as f:
        return json.load(f)


def _describe(err: ValidationError) -> str:
    """One line per problem: key, offending value, and what is accepted."""
    fields = list(SequenceParallelConfig.model_fields)
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(section)"
        if e["type"] == "extra_forbidden":
            lines.append(f"{KEY}.{loc} is not a known key (value {e['input']!r}); "
                         f"known keys: {', '.join(fields)}")
        elif e["type"] == "value_error" and isinstance(e.get("ctx", {}).get("error"), ConfigError):
            lines.append(str(e["ctx"]["error"]))
        else:
            lines.append(f"{KEY}.{loc}={e['input']!r}: {e['msg']}")
    return "; ".join(lines)


__all__ = ["SequenceParallelConfig", "ConfigError", "KEY", "STRATEGY_NAMES", "BACKENDS", "LASP_COMMS", "LINEAR_STRATEGIES",
           "COMM_DTYPES",
           "check_sizes"]
