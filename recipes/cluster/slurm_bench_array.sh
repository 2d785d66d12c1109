#!/usr/bin/env bash
# A `doplus bench schemes` grid as a SLURM job array: one run of the grid per array task, checkpointed and requeued.
#
#   BENCH="--recipe recipes/tofu/llama2-7b/npo_gd.yaml --schemes joint,alternate,dualoptim,doplus --seeds 0,1,2 \
#          --task-ids 1,2,3 --out bench/npo-llama2" bash recipes/cluster/slurm_bench_array.sh
#
# Started with bash (not sbatch), the script submits itself as an array over the runs of the grid still to do, as
# `doplus bench schemes $BENCH --list-runs --indexes pending,failed` gives them (STATES=failed: only the failed
# ones; MAX_AT_ONCE=8: at most 8 tasks at a time). Nothing to do is said in one line, and nothing is submitted.
# Each array task then runs `doplus bench schemes $BENCH --run-index $SLURM_ARRAY_TASK_ID`: that run alone, trained
# and evaluated, into the bench's folder; the task that ends the last run writes SCHEMES.md, SCHEMES.json and the
# figures. Watch the grid with `--list-runs`; write the tables from the runs done so far with `--summarize`.
#
# Stopping and requeueing, as recipes/cluster/slurm_unlearn.sh does for one run: two minutes before the time limit
# (--signal=B:USR1@120) the trap sends SIGTERM to the bench, its run stops after the current step with a
# checkpoint, and the task requeues itself (`scontrol requeue JOB_TASK`); on preemption SLURM sends SIGTERM and
# requeues the task (PreemptMode=REQUEUE). A requeued task resumes its run from its newest checkpoint; a run that is
# done is skipped. A task whose run another task holds (the same index submitted twice) stops in one line (exit 2).
# A failed run (exit 1: its log is OUT/runs/NAME.log, why in OUT/runs/NAME.failed.json) is not requeued: fix the
# cause, then STATES=failed bash recipes/cluster/slurm_bench_array.sh.
#
# BENCH is split on spaces (keep paths free of them). OUT must be on storage every node sees. For runs of several
# processes each, add --num-processes N to BENCH and ask for N GPUs below. Adapt the #SBATCH lines to your cluster.
#SBATCH --job-name=doplus-bench
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus=1
#SBATCH --cpus-per-task=8
#SBATCH --time=12:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%A_%a.out
set -euo pipefail

BENCH=${BENCH:?set BENCH to the arguments of doplus bench schemes, e.g. BENCH="--recipe R.yaml --out bench/R"}
# shellcheck disable=SC2206  # BENCH holds several arguments
ARGS=($BENCH)

if [ -z "${SLURM_ARRAY_TASK_ID:-}" ]; then  # started by hand: submit the array
    STATES=${STATES:-pending,failed}
    INDEXES=$(doplus bench schemes "${ARGS[@]}" --list-runs --indexes "$STATES")
    if [ -z "$INDEXES" ]; then
        echo "no run of the grid is $STATES: nothing to submit (doplus bench schemes $BENCH --list-runs shows it)"
        exit 0
    fi
    echo "submitting runs $INDEXES of the grid"
    exec sbatch --array="$INDEXES${MAX_AT_ONCE:+%$MAX_AT_ONCE}" "$0"
fi

REQUEUE=0
on_time_limit() {
    REQUEUE=1
    kill -TERM "$BENCH_PID"  # the bench hands it to its run: a checkpoint, then exit 143
}
trap on_time_limit USR1

doplus bench schemes "${ARGS[@]}" --run-index "$SLURM_ARRAY_TASK_ID" &
BENCH_PID=$!
trap ':' TERM  # on preemption: wait for the run to checkpoint instead of dying before it

set +e
wait "$BENCH_PID"
STATUS=$?
while kill -0 "$BENCH_PID" 2> /dev/null; do  # a trapped signal interrupts `wait`: wait again for the bench
    wait "$BENCH_PID"
    STATUS=$?
done
set -e

if [ "$REQUEUE" = 1 ]; then
    echo "time limit near: run $SLURM_ARRAY_TASK_ID checkpointed, requeueing ${SLURM_ARRAY_JOB_ID}_$SLURM_ARRAY_TASK_ID"
    scontrol requeue "${SLURM_ARRAY_JOB_ID}_$SLURM_ARRAY_TASK_ID"
fi
exit "$STATUS"
