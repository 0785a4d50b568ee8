#!/usr/bin/env bash
# torchrun (elastic launcher): sets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT.
# One node:  launchers/torchrun.sh [NPROC] [CONFIG] [extra train options...]
# Many nodes: run this on every node with NNODES=<n> RDZV=<head-node>:29500 in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${1:-4}
CONFIG=${2:-configs/zigzag_zero2.json}
shift $(( $# > 2 ? 2 : $# ))
if [[ -n "${RDZV:-}" ]]; then
    RDZV_ARGS=(--nnodes "${NNODES:?set NNODES}" --rdzv_backend c10d --rdzv_endpoint "$RDZV")
else
    RDZV_ARGS=(--standalone)
fi
exec torchrun "${RDZV_ARGS[@]}" --nproc_per_node "$NPROC" -m ds_seqpar.train \
    --deepspeed_config "$CONFIG" --steps 50 --seq_len 512 "$@"
