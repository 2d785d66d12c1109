#!/usr/bin/env bash
# A `doplus bench schemes` grid as a SLURM job array: one run of the grid per array task, checkpointed and requeued.
#
#   BENCH="--recipe recipes/tofu/llama2-7b/npo_gd.yaml --schemes joint,alternate,dualoptim,doplus --seeds 0,1,2 \
#          --task-ids 1,2,3 --out bench/npo-llama2" bash recipes/cluster/slurm_bench_array.sh
#   bash recipes/cluster/slurm_bench_array.sh --recipe recipes/tofu/llama2-7b/npo_gd.yaml --schemes joint,doplus \
#          --out "bench/npo llama2"     # the same arguments given to the script: for paths holding spaces
#
# Started with bash (not sbatch), the script submits itself as an array over the runs of the grid still to do, as
# `doplus bench schemes $BENCH --list-runs --indexes pending,failed` gives them (STATES=failed: only the failed
# ones; MAX_AT_ONCE=8: at most 8 tasks at a time), passing sbatch the script's own arguments for its tasks. Nothing
# to do is said in one line, and nothing is submitted.
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
# The arguments of `doplus bench schemes` are the script's own arguments when it has any, else BENCH split on
# whitespace (no glob expansion; keep the paths in BENCH free of spaces). Either way each one reaches doplus as one
# argument, never through a command string. OUT must be on storage every node sees. For runs of several processes
# each, add --num-processes N to the arguments and ask for N GPUs below. Adapt the #SBATCH lines to your cluster.
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

if [ "$#" -gt 0 ]; then
    ARGS=("$@")
else
    BENCH=${BENCH:?set BENCH to the arguments of doplus bench schemes, e.g. BENCH="--recipe R.yaml --out bench/R"}
    read -r -d '' -a ARGS <<< "$BENCH" || true  # split on whitespace (newlines too), without glob expansion
fi

if [ -z "${SLURM_ARRAY_TASK_ID:-}" ]; then  # started by hand: submit the array
    STATES=${STATES:-pending,failed}
    INDEXES=$(doplus bench schemes "${ARGS[@]}" --list-runs --indexes "$STATES")
    if [ -z "$INDEXES" ]; then
        echo "no run of the grid is $STATES: nothing to submit (doplus bench schemes ${ARGS[*]} --list-runs shows it)"
        exit 0
    fi
    echo "submitting runs $INDEXES of the grid"
    exec sbatch --array="$INDEXES${MAX_AT_ONCE:+%$MAX_AT_ONCE}" "$0" "$@"
fi

REQUEUE=0
# shellcheck disable=SC2329  # the USR1 trap below invokes it; shellcheck misses that before the script's final exit
on_time_limit() {
    REQUEUE=1
    kill -TERM "$BENCH_PID"  # the bench hands it to its run: a checkpoint, then exit 143
}
trap on_time_limit USR1

trap ':' TERM  # on preemption: wait for the run to checkpoint instead of dying before it
# (set before the worker starts: a signal that came between the two would end this shell first; the
# worker itself starts with the default action, as a trap's handler is not inherited)
doplus bench schemes "${ARGS[@]}" --run-index "$SLURM_ARRAY_TASK_ID" &
BENCH_PID=$!

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
