"""The main job: train a small causal LM (or a local Hugging Face model, ``--model PATH``) with any
sequence-parallel strategy and ZeRO.

    python -m ds_seqpar.train                       # 4 local CPU ranks: 2 data x 2 sequence, ZeRO-2
    deepspeed --num_gpus 4 --module ds_seqpar.train --deepspeed_config configs/zigzag_zero2.json
    mpirun -np 4 python -m ds_seqpar.train ...      # also srun, torchrun; launch/env.py reads each
    torchrun --nproc_per_node 4 -m ds_seqpar.train ...
    python -m ds_seqpar.train --model configs/models/llama_small.json --deepspeed_config configs/zigzag_zero2.json

The same code runs gloo on CPU and nccl on GPU. ``run_training(dict)`` is what the command line
and the tests call. Order of work (every check that can fail runs before training starts and
fails on every rank with the same message):

  1. read the DeepSpeed config, apply command-line overrides, validate model x strategy
  2. without communication: the launcher's world size against sequence_parallel.size, the length
     and the heads against the strategy (a rank that left early would break its peers' rendezvous)
  3. join torch.distributed as the launcher placed this rank (launch/env.py), on its device;
     SequenceParallel: groups, layout; the HF model's features against the sequence
  4. data (all ranks must hold the same corpus), model, deepspeed.initialize(mpu=sp.mpu)
  5. resume, then train: the batch of step k is a function of k, so a resumed run continues the
     uninterrupted run's trajectory exactly
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, Mapping, Optional

import torch

from .. import comm, strategies, topology
from ..config import ConfigError, SequenceParallelConfig
from ..dynamic import check_dynamic_heads
from ..launch import hosts
from ..memory import MemoryConfig, apply_memory_features
from ..models import CausalLM, ModelConfig
from ..sequence_parallel import SequenceParallel
from . import data, documents, hf_model, preflight
from .args import TrainConfigError, build_parser, resolve_args
from .exits import fail, fail_rank, leave_world
from .preflight import build_ds_config, check_options, reports_errors
from .trainer import Trainer


def run_training(args: Mapping[str, Any], model_factory: Optional[Callable] = None) -> Dict[str, Any]:
    """Train as the command line would with these options; return this rank's summary:
    ``losses`` (this replica's loss per step run), ``mean_losses`` (over replicas), ranks, paths, and
    ``memory_features`` (what apply_memory_features did: tiled MLPs, checkpointed layers, offload).
    ``model_factory(model_cfg, sp, ds_config)``: another way to build the (seeded) own LM, e.g.
    under deepspeed.zero.Init; it goes to deepspeed.initialize as it comes back."""
    opts = resolve_args(args)
    ds_config = build_ds_config(opts)
    sp_cfg = SequenceParallelConfig.from_ds_config(ds_config)
    memory = MemoryConfig.from_ds_config(ds_config, sp_cfg)     # tiled loss/MLP, checkpointing
    hf_config = load_hf_config(opts, sp_cfg, ds_config)        # --model: options checked, no weights yet
    model_cfg = None if hf_config is not None else model_config(opts, sp_cfg)
    lengths = documents.check_options(opts, sp_cfg, hf_config)  # --lengths read and checked, or None
    world = _place_rank(opts)
    if not sp_cfg.is_dynamic:
        sp_cfg.check_world(world)                              # before any rank joins the world,
    check_run(sp_cfg, opts, model_cfg, hf_config)              # so that every rank says it
    _join_world(opts, sp_cfg.timeout_s)
    _warn_placement(sp_cfg)
    # checks size | world before building groups; takes the loss's ZeRO factor from the config
    sp = documents.build_runner(ds_config, *model_heads(model_cfg, hf_config)) if sp_cfg.is_dynamic \
        else SequenceParallel.from_ds_config(ds_config)
    tokens = load_tokens(opts)
    vocab_size = data.vocab_size_of(tokens, opts.vocab_size)
    images = None
    if hf_config is not None:
        hf_model.check_run(sp, opts, hf_config, vocab_size)
        # --images: placeholders, pixels, 3-D positions. Imported here: it loads the HF layer (and
        # with it torch's compiler, about a second of every rank's start) that the own LM never needs
        from .images import RandomImages
        images = RandomImages.of(opts, hf_config, vocab_size, sp.config.tiled_loss_tokens)
    _check_same_data(tokens, sp.groups.seq_data_group)
    torch.manual_seed(opts.seed)                       # same init everywhere; DeepSpeed broadcasts anyway
    if model_factory is not None:
        model_cfg.vocab_size = vocab_size
        model = model_factory(model_cfg, sp, ds_config)
    else:
        # built whole on every rank; under ZeRO-3 deepspeed.initialize partitions it over sp.mpu's
        # data-parallel group, which is every rank (topology.py)
        model = build_model(opts, model_cfg, hf_config, vocab_size, sp).to(sp.device)
    if images is not None:
        images.attach(model.model)
    features = apply_memory_features(model.model if hf_config is not None else model, memory)
    trainer = Trainer(opts, ds_config, sp, model, tokens, images) if lengths is None else \
        documents.DocumentTrainer(opts, ds_config, sp, model, tokens, lengths, documents.runner_of(sp, opts))
    try:
        return dict(trainer.train(), memory_features=features)
    finally:
        trainer.close()


# ---------------------------------------------------------------------------------------------
# setup


def _place_rank(opts) -> int:
    """The world size, without communication: the running world's, or the launcher's (launch/env.py
    reads torchrun, deepspeed, Open MPI, MPICH/Intel MPI, MVAPICH and Slurm into the env:// variables)."""
    from ..launch.env import launch_env
    if comm.is_initialized():
        return comm.world_size()
    os.environ.update(launch_env(os.environ, opts.master_port, opts.local_rank))
    return int(os.environ["WORLD_SIZE"])


def _join_world(opts, timeout_s: float) -> None:
    """Join torch.distributed as _place_rank placed this process, on the launcher's device."""
    import datetime
    import deepspeed
    from ..launch import rendezvous
    from ..deepspeed_shm import skip_deepspeed_shm_op
    from ..launch.env import local_device
    fresh = not comm.is_initialized()
    shm_skipped = skip_deepspeed_shm_op()
    if torch.cuda.is_available():
        # before the process group: NCCL binds its communicator to the current device
        torch.cuda.set_device(local_device(os.environ, torch.cuda.device_count()))
    if fresh:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # every env:// variable is set, so DeepSpeed runs no MPI discovery of its own (which would
        # take the local rank from host names and disagree with Open MPI's); the world group's
        # collectives (DeepSpeed's own) get the same timeout as ours
        rendezvous.join(lambda: deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                                                           timeout=datetime.timedelta(seconds=timeout_s)),
                        os.environ, timeout_s)
    else:
        deepspeed.init_distributed(dist_backend=comm.backend_name())   # adopt the existing world
    # while every host is reachable: the failure path names the hosts of lost ranks, run.json records them
    hosts.gather()
    if not torch.cuda.is_available() and not shm_skipped:
        # kept by DS_SEQPAR_DEEPSPEED_SHM=1: DeepSpeed's CPU all-reduce leaves a 66 MB /dev/shm file per
        # rank behind every job; once every rank has mapped its peers' (the barrier) the names can go
        from ..deepspeed_shm import release_deepspeed_shm
        comm.barrier()
        release_deepspeed_shm(os.environ)
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        # ranks share the machine's cores; oversubscribed intra-op threads only thrash
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", comm.world_size()))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))


def _warn_placement(sp_cfg: SequenceParallelConfig) -> None:
    """Rank 0 says what is wrong with where the ranks run (topology.placement_problems). Warned, not
    refused: all-to-all across hosts gives the same numbers, and on a fast interconnect it is a
    setup users choose (DeepSpeed's Ulysses over several nodes); only the speed suffers."""
    known = hosts.known()
    if not known or comm.global_rank() != 0:
        return
    ulysses = sp_cfg.ulysses_size if sp_cfg.is_dynamic else sp_cfg.effective_ulysses_size
    if sp_cfg.is_dynamic and (ulysses == 1 or len(known) % ulysses):
        return          # dynamic groups are placed by the schedule; only the 2D hybrid's blocks are fixed
    # dynamic: the all-to-all blocks of U ranks are the same at every size, the world's included
    dims = topology.ParallelDims(len(known), len(known) if sp_cfg.is_dynamic else sp_cfg.size, ulysses)
    key = "sequence_parallel.size" if sp_cfg.strategy == "ulysses" else "sequence_parallel.ulysses_size"
    for problem in topology.placement_problems(dims, known, key):
        sys.stderr.write(f"ds_seqpar.train: warning: {problem}\n")


def load_hf_config(opts, sp_cfg: SequenceParallelConfig, ds_config):
    """--model PATH: the Hugging Face config (None without --model), after the options that do not
    go with it are refused."""
    if not opts.model:
        if opts.images:
            raise TrainConfigError(f"--images={opts.images} needs a vision-language --model (e.g. "
                                   f"configs/models/vision/qwen2_5_vl_small.json); the built-in LM reads text only")
        return None
    hf_model.check_options(opts, sp_cfg.strategy)
    return hf_model.load_config(opts)


def build_model(opts, model_cfg: Optional[ModelConfig], hf_config, vocab_size: int, sp=None):
    """The own LM, or the --model one; ``sp=None``: the plain single-process model (the reference)."""
    if hf_config is not None:
        return hf_model.build(opts, hf_config, sp)
    model_cfg.vocab_size = vocab_size
    return CausalLM(model_cfg, sp)


def model_config(opts, sp_cfg: SequenceParallelConfig) -> ModelConfig:
    """Model sizes from the command line; attention kind follows the strategy unless forced."""
    kind = opts.attention
    if kind == "auto":
        kind = "linear" if sp_cfg.strategy == "lasp" else "softmax"
    if (kind == "linear") != (sp_cfg.strategy == "lasp"):
        raise TrainConfigError(f"--attention={kind} does not go with sequence_parallel.strategy="
                               f"{sp_cfg.strategy!r}: linear attention needs 'lasp', softmax attention any of "
                               f"ulysses, ring, zigzag, striped (or --attention auto)")
    try:
        return ModelConfig(dim=opts.dim, n_layers=opts.n_layers, n_heads=opts.n_heads,
                           n_kv_heads=opts.n_kv_heads, mlp_hidden=opts.mlp_hidden, attention=kind,
                           tie_embeddings=not opts.untied)
    except ValueError as err:
        raise TrainConfigError(str(err)) from None


def check_run(sp_cfg: SequenceParallelConfig, opts, model_cfg: Optional[ModelConfig], hf_config) -> None:
    """Steps, length and heads against the strategy, from the config alone: every rank raises the
    same message before joining the world, so none leaves while its peers still build groups. Any
    sequence length works (the layout pads at the end, padding.py)."""
    check_options(opts)
    if hf_config is not None and not sp_cfg.is_dynamic:
        from ..hf.checks import check_heads
        check_heads(hf_config, sp_cfg)
        return
    try:
        if sp_cfg.is_dynamic:
            check_dynamic_heads(sp_cfg, *model_heads(model_cfg, hf_config))
        elif model_cfg.attention == "softmax":
            strategies.check_heads(sp_cfg, model_cfg.n_heads, model_cfg.n_kv_heads)
    except ValueError as err:
        heads, kv_heads = model_heads(model_cfg, hf_config)
        model = (f"--model {opts.model!r}: num_attention_heads={heads}, num_key_value_heads={kv_heads}"
                 if hf_config is not None else f"--seq_len={opts.seq_len}, --n_heads={heads}, --n_kv_heads={kv_heads}")
        raise TrainConfigError(f"{err} ({model}, strategy={sp_cfg.strategy!r}, size={sp_cfg.size})") from None


def model_heads(model_cfg: Optional[ModelConfig], hf_config):
    """(query heads, k/v heads) of the own LM or the --model decoder (dynamic ulysses' group sizes)."""
    if hf_config is None:
        return model_cfg.n_heads, model_cfg.n_kv_heads
    from ..hf.checks import text_config
    tc = text_config(hf_config)
    heads = tc.num_attention_heads
    return heads, getattr(tc, "num_key_value_heads", None) or heads


def load_tokens(opts):
    try:
        if opts.data:
            tokens = data.token_file(opts.data, opts.data_dtype)
        else:
            tokens = data.stdlib_corpus(opts.corpus_bytes)
    except (OSError, ValueError) as err:
        raise TrainConfigError(str(err)) from None
    if tokens.size < opts.seq_len + 1:
        raise TrainConfigError(f"the training data has {tokens.size} tokens, not more than --seq_len="
                               f"{opts.seq_len}; pass a larger --data file or a shorter --seq_len")
    return tokens


def _check_same_data(tokens, world_group) -> None:
    """Ranks on different machines may hold different files: training on them would silently
    diverge from data parallelism, so stop here instead."""
    prints = comm.gather_object(data.fingerprint(tokens), world_group)
    if len(set(prints)) != 1:
        raise TrainConfigError(f"ranks disagree on the training data (size:sha1 per rank: {prints}); use the "
                               f"same Python installation or pass the same --data file on every machine")


# ---------------------------------------------------------------------------------------------
# command line


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = build_parser().parse_args(argv)
    bad = preflight.check(opts)          # before any rank starts; rank 0 alone says it
    if bad is not None:
        return bad
    from ..launch.spawn import spawn_local, under_launcher
    try:
        launched = under_launcher()
    except ConfigError as err:
        return fail(2, f"ds_seqpar.train: error: {err}")
    if not launched and opts.nprocs > 1:
        return spawn_local("ds_seqpar.train", argv, opts.nprocs)
    if opts.quiet or not opts.verbose:
        _quiet_deepspeed()
    owns_world = not comm.is_initialized()
    try:
        run_training(vars(opts))
        if owns_world:
            leave_world()
    except (TrainConfigError, ConfigError) as err:
        # every rank raises the same message before training, without a traceback. Before joining
        # the world it came from the options, the config and the model's files, which every rank
        # reads alike: rank 0 says it, the others leave quietly. After joining, each says its own
        # (a data file may differ between hosts), and rank 0, which hosts the rendezvous store,
        # stays a moment so that peers still reading it (to build a group) reach the same check
        # instead of failing to connect
        joined = comm.is_initialized()
        rank0 = joined and comm.global_rank() == 0
        said = joined or reports_errors(os.environ)
        linger = 1.0 if rank0 else 0.0 if said else preflight.QUIET_LINGER_S
        return fail(2, f"ds_seqpar.train: error: {err}" if said else "", linger_s=linger)
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - say which rank failed, then end the job
        return fail_rank(err)
    return 0


def _quiet_deepspeed() -> None:
    """DeepSpeed's per-rank INFO/WARNING chatter (and torch's deprecation notices about calls inside
    DeepSpeed) buries the progress bar; --verbose keeps it."""
    import logging
    import warnings
    from deepspeed.utils import logger
    logger.setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


if __name__ == "__main__":
    sys.exit(main())
