"""ds_seqpar: sequence parallelism for DeepSpeed.

    from ds_seqpar import SequenceParallel, SequenceParallelConfig, STRATEGIES

The names load on first use (PEP 562): ``python -m ds_seqpar.train`` imports this package before
its own code runs, and checks the command line and the config without torch (train/preflight.py),
so that a bad config is reported in well under a second instead of after torch and DeepSpeed load.
"""
from .config import SequenceParallelConfig
from .errors import ConfigError

__version__ = "0.1.0"

__all__ = ["SequenceParallel", "SequenceParallelConfig", "ConfigError", "STRATEGIES", "CommStats", "__version__"]


def __getattr__(name: str):
    if name == "SequenceParallel":
        from .sequence_parallel import SequenceParallel
        return SequenceParallel
    if name == "STRATEGIES":
        from .strategies import STRATEGIES
        return STRATEGIES
    if name == "CommStats":
        from .comm import CommStats
        return CommStats
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
