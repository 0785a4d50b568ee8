#!/usr/bin/env bash
# Several nodes with the deepspeed launcher and a hostfile (see launchers/hostfile.example).
# 16 ranks with sequence_parallel.size=4 -> 4 data-parallel replicas; Ulysses/hybrid groups are
# consecutive ranks, so they stay inside a node where all-to-all is fastest.
#   launchers/deepspeed_multi_node.sh HOSTFILE [CONFIG] [extra train options...]
set -euo pipefail
cd "$(dirname "$0")/.."
HOSTFILE=${1:?usage: $0 HOSTFILE [CONFIG] [options]}
CONFIG=${2:-configs/zigzag_zero2.json}
shift $(( $# > 2 ? 2 : $# ))
exec deepspeed --hostfile "$HOSTFILE" --master_port "${MASTER_PORT:-29500}" --module ds_seqpar.train \
    --deepspeed_config "$CONFIG" --sp_size 4 --steps 1000 --seq_len 32768 "$@"
