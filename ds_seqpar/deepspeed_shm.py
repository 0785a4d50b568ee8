"""DeepSpeed's CPU shared-memory all-reduce op: kept from building, or its /dev/shm names released.

On the CPU accelerator DeepSpeed's comm backend (``deepspeed.init_distributed``, or accelerate starting it for
the Trainer) JIT-compiles a C++ all-reduce op the first time a process starts it on a machine, and every rank
then maps a 66 MB /dev/shm buffer that nobody removes. Training under ds_seqpar never calls the one verb that
uses it (DeepSpeed's inference all-reduce, for AutoTP), so the main job, the rank pool, the benches and the
Trainer integration skip it; ``DS_SEQPAR_DEEPSPEED_SHM=1`` keeps it, and the main job then releases the names.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional


def deepspeed_shm_buffer(env: Mapping[str, str], uid: Optional[int] = None) -> str:
    """The /dev/shm file DeepSpeed's CPU shared-memory all-reduce (its shm comm op) creates for this
    rank at init_distributed and never removes: 66 MB of RAM per rank per job, until reboot."""
    uid = os.getuid() if uid is None else uid
    return (f"/dev/shm/deepspeed_allreduce_buffer_{uid}_{env.get('MASTER_ADDR')}_{env.get('MASTER_PORT')}_"
            f"{env.get('RANK')}")


KEEP_DEEPSPEED_SHM = "DS_SEQPAR_DEEPSPEED_SHM"


def skip_deepspeed_shm_op(env: Mapping[str, str] = os.environ) -> bool:
    """Keep DeepSpeed from building and starting its CPU shared-memory op (see above); return whether it was
    skipped. Call before DeepSpeed's comm backend exists. Without the op DeepSpeed's inference all-reduce
    falls back to the process group's, the same sum. DeepSpeed reads its op table
    (``deepspeed.ops.__compatible_ops__``, computed once and kept so that edits persist) when the backend
    starts; on GPUs the op does not exist and nothing changes."""
    import torch
    if env.get(KEEP_DEEPSPEED_SHM, "0") == "1" or torch.cuda.is_available():
        return False
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    cpu = get_accelerator().device_name() == "cpu"
    builder = get_accelerator().get_op_builder("ShareMemCommBuilder") if cpu else None
    if builder is None:
        return False
    deepspeed.ops.__compatible_ops__[builder.NAME] = False
    return True


def release_deepspeed_shm(env: Mapping[str, str]) -> bool:
    """Unlink this rank's DeepSpeed shm buffer name. Call it once every rank is past
    init_distributed (a barrier): each has then mapped its peers' buffers, and a mapping outlives
    the name, so the all-reduce keeps working and the memory goes back when the job ends."""
    path = deepspeed_shm_buffer(env)
    if os.path.exists(path):
        os.unlink(path)
        return True
    return False


__all__ = ["KEEP_DEEPSPEED_SHM", "deepspeed_shm_buffer", "release_deepspeed_shm", "skip_deepspeed_shm_op"]
