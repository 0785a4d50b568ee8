#!/usr/bin/env bash
# MPI: mpirun sets OMPI_COMM_WORLD_* (MPICH / Intel MPI: PMI_*, MPI_LOCALRANKID); ds_seqpar takes
# rank, world and local rank from them. The local rank is Open MPI's own (ranks are mapped by
# package, so with more ranks than cores rank 1 may be local rank 2) and picks the CUDA device.
# One node: the rendezvous is 127.0.0.1:--master_port. Several nodes (--hostfile): rank 0 tells its
# host name once over mpi4py, or pass -x MASTER_ADDR=<first host>. A failing rank ends the job.
# --oversubscribe lets 4 ranks share a 2-core laptop; --allow-run-as-root is for containers.
#   launchers/mpirun.sh [NPROC] [CONFIG] [extra train options...]
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${1:-4}
CONFIG=${2:-configs/zigzag_zero2.json}
shift $(( $# > 2 ? 2 : $# ))
exec mpirun --allow-run-as-root --oversubscribe -np "$NPROC" \
    python -m ds_seqpar.train --deepspeed_config "$CONFIG" --master_port "${MASTER_PORT:-29500}" \
    --steps 50 --seq_len 512 "$@"
# Several nodes: add  --hostfile hosts.txt  (Open MPI format: "node-0 slots=8").
