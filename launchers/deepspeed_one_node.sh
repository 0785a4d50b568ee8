#!/usr/bin/env bash
# One node with the deepspeed launcher: NPROC ranks (GPUs; on a CPU-only machine DeepSpeed starts
# NPROC CPU processes and ds_seqpar picks gloo). The launcher sets RANK/LOCAL_RANK/WORLD_SIZE
# and appends --local_rank; the world is data x sequence: NPROC / sequence_parallel.size replicas.
#   launchers/deepspeed_one_node.sh [NPROC] [CONFIG] [extra train options...]
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${1:-4}
CONFIG=${2:-configs/zigzag_zero2.json}
shift $(( $# > 2 ? 2 : $# ))
exec deepspeed --num_gpus "$NPROC" --module ds_seqpar.train --deepspeed_config "$CONFIG" \
    --steps 50 --seq_len 512 "$@"
