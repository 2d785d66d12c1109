#!/usr/bin/env bash
# Multi-node `doplus unlearn` under SLURM through `accelerate launch` (DDP), preemption-safe.
#
#   RECIPE=recipes/tofu/llama2-7b/npo_gd.yaml OUT=runs/npo-llama2 sbatch recipes/cluster/slurm_unlearn.sh
#   FSDP=1 RECIPE=... sbatch recipes/cluster/slurm_unlearn.sh     # FSDP2 full shard of weights, gradients and
#                                                                 # optimizer states (accelerate_fsdp.yaml)
#
# SLURM sends SIGTERM two minutes before the time limit or on preemption (--signal); every process of the run
# stops after the same step, checkpoints/step-N/ is written (under FSDP each process adds its own shards) and
# the job exits with 143. With --requeue the job comes back and this script finds the checkpoint and adds
# --resume, which continues bit-for-bit where it stopped (a changed configuration or another number of
# processes is refused, naming what differs). OUT must be on storage every node sees.
# Written for this cluster shape; adapt the #SBATCH lines to yours. Not exercised on a real cluster by CI.
#SBATCH --job-name=doplus-unlearn
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@120
#SBATCH --requeue
#SBATCH --output=%x-%j.out
set -euo pipefail

RECIPE=${RECIPE:?set RECIPE=recipes/...yaml}
OUT=${OUT:-runs/${SLURM_JOB_NAME}}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
SAVE_EVERY=${SAVE_EVERY:-50}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}

EXTRA=""
LAUNCH="--multi_gpu --mixed_precision no --dynamo_backend no"
if [ "${FSDP:-0}" = "1" ]; then
    LAUNCH="--config_file recipes/cluster/accelerate_fsdp.yaml"
fi
if [ "$SAVE_EVERY" != "0" ]; then
    EXTRA="$EXTRA --save-every $SAVE_EVERY --keep-last 2"
fi
if compgen -G "$OUT/checkpoints/step-*" > /dev/null; then
    EXTRA="$EXTRA --resume"
fi

srun --kill-on-bad-exit=1 bash -c "accelerate launch $LAUNCH \
    --num_machines $SLURM_NNODES --num_processes $((SLURM_NNODES * GPUS_PER_NODE)) \
    --machine_rank \$SLURM_NODEID --main_process_ip $MASTER_ADDR --main_process_port $MASTER_PORT \
    -m doplus_cli unlearn --recipe $RECIPE --out $OUT $EXTRA"
