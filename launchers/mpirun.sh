#!/usr/bin/env bash
# MPI: no RANK/WORLD_SIZE in the environment, so deepspeed.init_distributed discovers them via
# mpi4py (rank 0's hostname becomes MASTER_ADDR; --master_port sets the rendezvous port).
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
