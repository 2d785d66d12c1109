#!/usr/bin/env bash
# Multi-node `doplus unlearn` under SLURM through `accelerate launch` (DDP or FSDP2), checkpointed and requeued.
#
#   RECIPE=recipes/tofu/llama2-7b/npo_gd.yaml OUT=runs/npo-llama2 sbatch recipes/cluster/slurm_unlearn.sh
#   FSDP=1 RECIPE=... sbatch recipes/cluster/slurm_unlearn.sh     # FSDP2 full shard of weights, gradients and
#                                                                 # optimizer states (accelerate_fsdp.yaml)
#
# Effective batch: the recipe's batch_size x grad_accum is the effective batch on one process. On
# NODES x GPUS_PER_NODE processes (GPUS_PER_NODE: SLURM's count for the node, else 8) this script passes
# --grad-accum so that batch_size x grad_accum x processes stays that number (llama2-7b: 4 x 32 = 128 on 1 GPU;
# 4 x 2 x 16 = 128 on 2 nodes of 8), and refuses to start (exit code 2) when it does not divide evenly. Set
# EFFECTIVE_BATCH to choose another.
#
# Stopping and requeueing. SLURM's --requeue brings the job back after a preemption or a node failure, not after
# its time limit (a TIMEOUT job ends for good). So the job asks for SIGUSR1 in the batch shell two minutes before
# the limit (--signal=B:USR1@120); the trap below sends SIGTERM to the job's steps (each node's `accelerate
# launch`, which hands it to its workers), every doplus process stops after the same step and writes
# checkpoints/step-N/ (under FSDP each process its own shards), and the script then requeues its own job with
# `scontrol requeue`. On preemption SLURM sends SIGTERM to the steps itself and requeues the job (the cluster's
# PreemptMode must be REQUEUE, and its GraceTime long enough to write a checkpoint). When the job starts again and
# OUT holds OUT/.doplus-run.json (the record a run writes before anything else), the script adds --resume: the run
# continues bit-for-bit from its newest checkpoint, or starts again from the beginning when it was stopped before
# its first one (a changed configuration or another number of processes is refused, naming what differs). OUT
# must be on storage every node sees; the run holds it with a lock, so a requeued job that overlaps a manual start
# stops in one line.
#
# RECIPE, OUT and every other value reach `accelerate launch` as separate arguments, never through a command
# string: a path may hold spaces or any other character. Adapt the #SBATCH lines to your cluster.
#SBATCH --job-name=doplus-unlearn
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
set -euo pipefail

RECIPE=${RECIPE:?set RECIPE=recipes/...yaml}
OUT=${OUT:-runs/${SLURM_JOB_NAME}}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
SAVE_EVERY=${SAVE_EVERY:-50}
# the first node; sed reads the whole list (head would close the pipe early: SIGPIPE, fatal under pipefail)
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
MASTER_PORT=${MASTER_PORT:-29500}
PROCESSES=$((SLURM_NNODES * GPUS_PER_NODE))

# --grad-accum that keeps the recipe's effective batch on $PROCESSES processes
RECIPE_BATCH=$(python -c "import sys; from doplus_cli.commands.unlearn import UnlearnConfig; \
from doplus_cli.config import resolve_config; c = resolve_config(sys.argv[1], {}, UnlearnConfig); \
print(c.batch_size, c.grad_accum)" "$RECIPE")
read -r BATCH ACCUM <<< "$RECIPE_BATCH"
EFFECTIVE_BATCH=${EFFECTIVE_BATCH:-$((BATCH * ACCUM))}
if [ $((EFFECTIVE_BATCH % (BATCH * PROCESSES))) -ne 0 ]; then
    echo "effective batch $EFFECTIVE_BATCH is not a multiple of batch_size $BATCH x $PROCESSES processes" \
         "($SLURM_NNODES nodes x $GPUS_PER_NODE GPUs); set EFFECTIVE_BATCH, or change the node or GPU count" >&2
    exit 2
fi
GRAD_ACCUM=$((EFFECTIVE_BATCH / (BATCH * PROCESSES)))

EXTRA=(--grad-accum "$GRAD_ACCUM")
LAUNCH=(--multi_gpu --mixed_precision no --dynamo_backend no)
if [ "${FSDP:-0}" = "1" ]; then
    LAUNCH=(--config_file recipes/cluster/accelerate_fsdp.yaml)
fi
if [ "$SAVE_EVERY" != "0" ]; then
    EXTRA+=(--save-every "$SAVE_EVERY" --keep-last 2)
fi
if [ -f "$OUT/.doplus-run.json" ]; then  # a run started here: from its newest checkpoint, or again from the start
    EXTRA+=(--resume)
fi

REQUEUE=0
# shellcheck disable=SC2329  # the USR1 trap below invokes it; shellcheck misses that before the script's final exit
on_time_limit() {
    REQUEUE=1
    scancel --signal=TERM "$SLURM_JOB_ID"  # the steps' processes, not this shell: they checkpoint and exit 143
}
trap on_time_limit USR1

trap ':' TERM  # on preemption: wait for the steps to checkpoint instead of dying before them
# (set before the launch: a signal that came between the two would end this shell first; the launched
# processes start with the default action, as a trap's handler is not inherited)
# Each node's machine rank is SLURM_NODEID in that node's own environment, so it is expanded by the step's shell,
# whose command is the fixed string below; every other value reaches it as a positional argument ("$@").
# shellcheck disable=SC2016  # single quotes on purpose: $SLURM_NODEID and $@ expand on each node, not here
srun --kill-on-bad-exit=1 bash -c 'exec accelerate launch --machine_rank "$SLURM_NODEID" "$@"' doplus-node \
    "${LAUNCH[@]}" --num_machines "$SLURM_NNODES" --num_processes "$PROCESSES" \
    --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" \
    -m doplus_cli unlearn --recipe "$RECIPE" --out "$OUT" "${EXTRA[@]}" &
SRUN=$!

set +e
wait "$SRUN"
STATUS=$?
while kill -0 "$SRUN" 2> /dev/null; do  # a trapped signal interrupts `wait`: wait again for srun itself
    wait "$SRUN"
    STATUS=$?
done
set -e

if [ "$REQUEUE" = 1 ]; then
    echo "time limit near: checkpoint written, requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$STATUS"
