"""Several example scripts in the processes of one launch, each as its own ``python examples/X.py ARGS`` runs:

    deepspeed --num_gpus 4 tests/e2e/examples_launch.py examples/trl_dpo.py ARGS --then examples/hf_trainer.py ARGS

Each script's main() runs in turn with its own argv plus the launcher's --local_rank, under the launcher's
environment, and writes its own output files. Between scripts the process-wide state a Trainer leaves behind
(accelerate's singletons, transformers' ZeRO-3 config) is reset to a fresh process's; the process group stays
up (a script that tears it down, as examples/hf_trainer.py does at its end, goes last). One launch instead of
one per example: starting 4 processes that import transformers, DeepSpeed and TRL is most of each launch on 2
cores (tests/e2e/test_examples_launch.py)."""
import importlib.util
import os
import sys

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))


def scripts(argv):
    """[(script path, its argv)] from ``PATH ARGS --then PATH ARGS ...``; --local_rank goes to every script."""
    local = [a for a in argv if a.startswith("--local_rank")]
    runs = [[]]
    for arg in (a for a in argv if not a.startswith("--local_rank")):
        if arg == "--then":
            runs.append([])
        else:
            runs[-1].append(arg)
    return [(run[0], run[1:] + local) for run in runs]


def main():
    sys.path.insert(0, ROOT)
    from tests.dist.test_hf_trainer import reset_worker_state
    for path, args in scripts(sys.argv[1:]):
        name = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(f"{name}_launched", os.path.join(ROOT, path))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.argv = [path, *args]
        module.main()
        reset_worker_state()


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():     # a live gloo group can abort interpreter shutdown
        torch.distributed.destroy_process_group()
