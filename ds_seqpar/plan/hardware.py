"""Hardware profiles: one JSON file per GPU kind under profiles/, each naming its sources.

A profile has three parts: ``sources`` (the vendor datasheets the numbers come from),
``datasheet_peaks`` (the numbers as the datasheet states them, dense peaks: a figure quoted "with
sparsity" is halved), and ``assumed`` (what this model assumes on top: the fraction of a peak a
real kernel or collective reaches, per-message latencies, memory the runtime keeps). Only the
``assumed`` part is a guess; it is kept apart so that a user can replace it with measured values
(a custom JSON passed as ``--gpu path.json``, same keys).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Mapping

from ..config import ConfigError

PROFILE_DIR = os.path.join(os.path.dirname(__file__), "profiles")
GB = 1e9
PEAK_KEYS = ("memory_gb", "bf16_tflops", "tf32_tflops", "hbm_tb_s", "nvlink_gb_s_per_direction",
             "inter_node_gb_s_per_gpu", "pcie_gb_s_per_direction", "host_memory_gb_per_node")
ASSUMED_KEYS = ("usable_memory_fraction", "runtime_reserve_gb", "matmul_efficiency", "attention_efficiency",
                "nvlink_efficiency", "inter_node_efficiency", "alpha_intra_us", "alpha_inter_us",
                "cpu_adam_params_per_s")
# assumed keys a profile may leave out, with the value taken then; comm_overlap: the share of a step's
# compute a transfer hides behind (1: NCCL on its own channels; 0: CPU gloo ranks, one set of cores)
OPTIONAL_ASSUMED = {"comm_overlap": 1.0}


class PlanError(ConfigError):
    """Input ``ds-seqpar plan`` cannot work with; the message says what would."""


@dataclass(frozen=True)
class Link:
    """alpha-beta: a message of m bytes takes alpha + m / beta seconds."""

    alpha_s: float
    beta_bytes_s: float

    def time(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.alpha_s + nbytes / self.beta_bytes_s if nbytes > 0 else 0.0


@dataclass(frozen=True)
class Gpu:
    name: str
    description: str
    sources: Mapping[str, str]
    peaks: Mapping[str, float]
    assumed: Mapping[str, float]

    @property
    def usable_bytes(self) -> float:
        """Device memory a step may use: the datasheet capacity times the usable fraction (allocator
        fragmentation), less the runtime's reserve (CUDA context, NCCL buffers)."""
        a = self.assumed
        return self.peaks["memory_gb"] * GB * a["usable_memory_fraction"] - a["runtime_reserve_gb"] * GB

    def flops_s(self, dtype: str, kind: str = "matmul") -> float:
        """Sustained FLOP/s assumed for a matmul ("matmul") or an attention kernel ("attention")."""
        peak = self.peaks["bf16_tflops" if dtype in ("bf16", "fp16") else "tf32_tflops"] * 1e12
        return peak * self.assumed[f"{kind}_efficiency"]

    @property
    def intra(self) -> Link:
        a = self.assumed
        return Link(a["alpha_intra_us"] * 1e-6, self.peaks["nvlink_gb_s_per_direction"] * GB * a["nvlink_efficiency"])

    @property
    def inter(self) -> Link:
        a = self.assumed
        return Link(a["alpha_inter_us"] * 1e-6, self.peaks["inter_node_gb_s_per_gpu"] * GB * a["inter_node_efficiency"])

    @property
    def pcie_bytes_s(self) -> float:
        return self.peaks["pcie_gb_s_per_direction"] * GB

    @property
    def host_bytes_per_node(self) -> float:
        return self.peaks["host_memory_gb_per_node"] * GB


def known_gpus():
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))


def from_dict(raw: Mapping[str, Any], where: str) -> Gpu:
    for part, keys in (("datasheet_peaks", PEAK_KEYS), ("assumed", ASSUMED_KEYS)):
        missing = [k for k in keys if k not in raw.get(part, {})]
        if missing:
            raise PlanError(f"--gpu {where}: {part} lacks {', '.join(missing)} (see ds_seqpar/plan/profiles/h100.json "
                            f"for every key)")
    if not raw.get("sources"):
        raise PlanError(f"--gpu {where}: name the sources of the numbers under \"sources\"")
    return Gpu(str(raw.get("name", where)), str(raw.get("description", "")), dict(raw["sources"]),
               {k: float(raw["datasheet_peaks"][k]) for k in PEAK_KEYS},
               {**{k: float(raw["assumed"][k]) for k in ASSUMED_KEYS},
                **{k: float(raw["assumed"].get(k, v)) for k, v in OPTIONAL_ASSUMED.items()}})


def load_gpu(name_or_path: str) -> Gpu:
    """A profile by name (h100, h200, b200, a100) or a custom JSON file with the same keys."""
    is_path = name_or_path.endswith(".json") or os.sep in name_or_path
    path = name_or_path if is_path else os.path.join(PROFILE_DIR, f"{name_or_path.lower()}.json")
    if not os.path.exists(path):
        what = "no such file" if is_path else "not a known GPU"
        raise PlanError(f"--gpu {name_or_path!r}: {what}; choose one of {', '.join(known_gpus())} or pass a JSON "
                        f"profile with the keys of ds_seqpar/plan/profiles/h100.json")
    return from_dict(read_json(path, "gpu"), name_or_path if is_path else name_or_path.lower())


def read_json(path: str, flag: str) -> Any:
    """The JSON file given to ``--flag``, or a PlanError naming the flag."""
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as err:
            raise PlanError(f"--{flag} {path!r} is not valid JSON: {err}") from None


def describe(gpu: Gpu) -> Dict[str, Any]:
    return {"name": gpu.name, "description": gpu.description, "sources": dict(gpu.sources),
            "datasheet_peaks": dict(gpu.peaks), "assumed": dict(gpu.assumed)}


__all__ = ["Gpu", "Link", "PlanError", "describe", "known_gpus", "load_gpu", "read_json"]
