"""ds_seqpar: sequence parallelism for DeepSpeed.

    from ds_seqpar import SequenceParallel, SequenceParallelConfig, STRATEGIES
"""
from .comm import CommStats
from .config import SequenceParallelConfig
from .errors import ConfigError
from .sequence_parallel import SequenceParallel
from .strategies import STRATEGIES

__version__ = "0.1.0"

__all__ = ["SequenceParallel", "SequenceParallelConfig", "ConfigError", "STRATEGIES", "CommStats", "__version__"]
