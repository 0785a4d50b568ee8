"""The ``"sequence_parallel"`` key of a DeepSpeed JSON config: one typed, self-validating section.

Every error names the key, the bad value and what would be valid (with the nearest valid name
for a misspelt one), so that a user who mistypes a strategy or a size learns the fix from the
message alone. Nothing here talks to processes; the checks that need the world size (``size``
dividing it) take it as an argument. Nothing here imports torch either: the main job validates a
config with this module before a rank loads torch and DeepSpeed (train/preflight.py), so the names
of the strategies and kernels are spelled here and the registries are tested against them.
"""
from __future__ import annotations

import difflib
import json
import os
import re
from typing import Any, Literal, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError

KEY = "sequence_parallel"
# the registries (strategies.STRATEGIES, kernels.get_kernel) import torch; tests/unit/test_config.py
# checks that these names are theirs
STRATEGY_NAMES = ("ulysses", "ring", "zigzag", "striped", "lasp")
RING_STRATEGIES = ("ring", "zigzag", "striped")     # run the ring loop, so also across Ulysses groups
BACKENDS = ("auto", "flash_attn", "torch", "math")
LASP_COMMS = ("allgather", "ring", "allscan")
LINEAR_STRATEGIES = ("lasp", "ulysses")
COMM_DTYPES = ("auto", "fp32", "bf16", "fp16")
DYNAMIC = "dynamic"             # size: each document gets the group its length needs (docs/dynamic.md)
DS_COMM_DTYPE_KEY = "seq_parallel_communication_data_type"     # DeepSpeed's own key, same values


class SequenceParallelConfig(BaseModel):
    """Schema of ``"sequence_parallel": {...}`` in a DeepSpeed config."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: str = "ulysses"
    """How attention is split across ranks: ulysses | ring | zigzag | striped | lasp."""

    size: Union[int, Literal["dynamic"]] = 1
    """Sequence-parallel degree; the data-parallel degree is world_size / size. "dynamic": every
    document of a global batch runs on a group just large enough for its length under
    ``max_tokens_per_rank`` (docs/dynamic.md; ds_seqpar.dynamic builds and runs it)."""

    max_tokens_per_rank: Optional[int] = Field(default=None, ge=1, strict=True)
    """With size "dynamic" (required there, refused otherwise): the most tokens of one micro-batch
    a rank holds; a document of L tokens runs on the smallest group of g ranks with g x this >= L."""

    ulysses_size: int = Field(default=1, ge=1)
    """> 1 with ring/zigzag/striped: 2D hybrid, Ulysses all-to-all inside groups of this many
    neighbouring ranks and the ring across the groups. Must divide ``size``; with size "dynamic",
    the groups whose size it divides run the hybrid, smaller ones the ring alone (docs/dynamic.md)."""

    backend: str = "auto"
    """Local attention kernel: auto | flash_attn | torch | math. ``auto`` picks flash_attn on CUDA
    when installed, else torch, and logs what it picked."""

    lasp_comm: str = "allgather"
    """LASP state exchange: allgather (LASP-2) | ring (LASP-1) | allscan (All-Scan: one running state
    pipelined through the ranks in blocks; bytes per rank constant in P)."""

    linear_strategy: str = "lasp"
    """How a hybrid model's linear-attention and convolution layers are split (``strategy`` keeps
    choosing the softmax layers'): lasp (state passing, exchanged as ``lasp_comm`` says; the
    convolutions get a halo of the previous tokens) | ulysses (head all-to-all: whole sequences of
    a P-th of the heads, the simple baseline)."""

    overlap: bool = True
    """Post the next ring / state transfer before computing on the current block (and Ulysses' next
    head chunk before computing the current one: ulysses_chunks)."""

    ulysses_chunks: Union[int, Literal["auto"]] = "auto"
    """Ulysses and the 2D hybrid's Ulysses half: a rank's heads after the all-to-all run in this many
    chunks of whole K/V groups, chunk i+1's all-to-all in flight while chunk i computes, forward and
    backward (exact: heads are independent). "auto": the count the cost model prices fastest for the
    device and shapes (cost/chunks.py; 1 on CPU ranks, whose transfers share the compute's cores);
    1 (or overlap false): no chunks. A count must divide the k/v heads a rank holds (checked when the
    heads are known: strategies.check_heads)."""

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

    @field_validator("size", mode="before")
    @classmethod
    def _size_word(cls, value):
        if isinstance(value, str) and value != DYNAMIC and not value.strip().isdigit():
            raise ConfigError(f"{KEY}.size={value!r} is not valid; an integer >= 1 or {DYNAMIC!r}")
        return value

    @field_validator("ulysses_chunks", mode="before")
    @classmethod
    def _chunks_word(cls, value):
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ConfigError(f"{KEY}.ulysses_chunks={value!r} is not valid; 'auto' or an integer >= 1 (1: no head "
                          f"chunks)")

    @model_validator(mode="after")
    def _check_choices(self) -> "SequenceParallelConfig":
        _check_choice("strategy", self.strategy, STRATEGY_NAMES)
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("lasp_comm", self.lasp_comm, LASP_COMMS)
        _check_choice("linear_strategy", self.linear_strategy, LINEAR_STRATEGIES)
        _check_choice("comm_dtype", self.comm_dtype, COMM_DTYPES)
        if not self.overlap and self.ulysses_chunks not in ("auto", 1):
            raise ConfigError(f"{KEY}.ulysses_chunks={self.ulysses_chunks} overlaps each head chunk's all-to-all with "
                              f"the previous chunk's attention, and overlap=false turns overlap off; set overlap "
                              f"true or ulysses_chunks 1")
        if self.is_dynamic or self.max_tokens_per_rank is not None:
            _check_dynamic(self)
            return self
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
    def is_dynamic(self) -> bool:
        return self.size == DYNAMIC

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
        if self.is_dynamic:
            raise ConfigError(f"{KEY}.size={DYNAMIC!r} is run by ds_seqpar.dynamic.DynamicSequenceParallel "
                              f"(docs/dynamic.md); SequenceParallel and this entry point take an integer size")
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
        if ds_size is not None and not cfg.is_dynamic and int(ds_size) != cfg.size:
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


def _check_dynamic(cfg: "SequenceParallelConfig") -> None:
    """size "dynamic" needs max_tokens_per_rank, and that key needs it; the 2D hybrid takes a ring
    strategy (which of the groups run it is the world's business: schedule.family)."""
    if not cfg.is_dynamic:
        raise ConfigError(f"{KEY}.max_tokens_per_rank={cfg.max_tokens_per_rank} goes with size={DYNAMIC!r} only "
                          f"(size={cfg.size} splits every sequence over that many ranks); remove it or set "
                          f"size={DYNAMIC!r}")
    if cfg.max_tokens_per_rank is None:
        raise ConfigError(f"{KEY}.size={DYNAMIC!r} needs {KEY}.max_tokens_per_rank (an integer >= 1: the most "
                          f"tokens one rank holds in a micro-batch, e.g. 4096); it is missing")
    if cfg.ulysses_size != 1 and cfg.strategy not in RING_STRATEGIES:
        raise ConfigError(f"{KEY}.ulysses_size={cfg.ulysses_size} with size={DYNAMIC!r} is the 2D hybrid, which "
                          f"runs a ring strategy ({', '.join(RING_STRATEGIES)}) across the all-to-all blocks; "
                          f"strategy={cfg.strategy!r} needs ulysses_size=1")


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
        raise ConfigError(f"{KEY}.{field}={value!r} is not valid{did_you_mean(value, valid)}; "
                          f"choose one of: {', '.join(valid)}")


def did_you_mean(value: Any, valid) -> str:
    """' (did you mean 'striped'?)' for a near miss of one of ``valid``, else ''."""
    close = difflib.get_close_matches(str(value).lower(), list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def load_ds_config(ds_config) -> Mapping[str, Any]:
    if isinstance(ds_config, Mapping):
        return ds_config
    path = os.fspath(ds_config)
    if not os.path.exists(path):
        raise ConfigError(f"DeepSpeed config file {path!r} does not exist")
    return read_json(path)


def read_json(path: str) -> Any:
    """The file's JSON; a syntax error names the file, line and column. Comments are refused, not
    skipped: DeepSpeed and transformers read the same file with a strict parser, so a config that
    only this package could read would fail later, in their code."""
    with open(path) as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        lines = text.splitlines()
        line = lines[err.lineno - 1] if err.lineno <= len(lines) else ""
        hint = "; JSON has no comments: remove the // or /* */ comment" if _has_comment(line) else ""
        raise ConfigError(f"{path}:{err.lineno}:{err.colno}: not valid JSON: {err.msg}{hint}\n"
                          f"    {line.strip()}") from None


def _has_comment(line: str) -> bool:
    """A // or /* outside the line's strings."""
    outside = "".join(re.split(r'"(?:[^"\\]|\\.)*"', line))
    return "//" in outside or "/*" in outside


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


__all__ = ["SequenceParallelConfig", "ConfigError", "KEY", "STRATEGY_NAMES", "RING_STRATEGIES", "BACKENDS",
           "LASP_COMMS", "LINEAR_STRATEGIES", "COMM_DTYPES", "DYNAMIC", "check_sizes", "did_you_mean", "read_json"]
