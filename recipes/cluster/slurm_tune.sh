#!/usr/bin/env bash
# A `doplus tune` study as a SLURM job array: every task one worker of the same study, checkpointed and requeued.
#
#   TUNE="--recipe recipes/tofu/llama2-7b/npo_gd.yaml --space lr=log:1e-6:1e-4 --space beta=0.05:0.5 \
#         --objective OVR --trials 32 --out tune/npo-llama2" bash recipes/cluster/slurm_tune.sh
#   WORKERS=8 bash recipes/cluster/slurm_tune.sh --recipe recipes/tofu/llama2-7b/npo_gd.yaml \
#          --space lr=log:1e-6:1e-4 --objective OVR --constraint "MU>=0.9*start" \
#          --trials 32 --out "tune/npo llama2"     # the same arguments given to the script: for values holding spaces
#
# Started with bash (not sbatch), the script submits itself as an array of WORKERS tasks (default 4;
# MAX_AT_ONCE=2: at most 2 tasks at a time), passing sbatch the script's own arguments for its tasks. Check the
# command first with `doplus tune ARGS --dry-run`.
# Each array task runs the same `doplus tune $TUNE`: one worker of the study. --trials is the study's budget,
# shared by every worker on its storage, so the workers ask for trials in turn until the study holds that many
# finished ones, however many tasks run at once. The default storage is a journal file, DIR/study.journal, read
# and written by every worker with no server. DIR must be on storage every node sees, whose file locks hold across
# nodes (docs/cluster.md), and so must the journal (or give --storage a database server's URL). Each worker writes
# TUNE.md, TUNE.json and best.yaml from every trial in the study when it ends, so the task that ends last leaves
# them for the whole study. Submitting the same arguments again continues the study: a finished one runs nothing
# and only writes its outputs again.
#
# Stopping and requeueing, as recipes/cluster/slurm_bench_array.sh does for its runs: two minutes before the time
# limit (--signal=B:USR1@120) the trap sends SIGTERM to the worker, its trial's run stops after the current step
# with a checkpoint, the trial is ended as interrupted with its values queued to run again, the worker exits (143)
# and the task requeues itself (`scontrol requeue JOB_TASK`); on preemption SLURM sends SIGTERM and requeues the
# task (PreemptMode=REQUEUE). A requeued task runs the same command again: it joins the study and asks for the
# next trial. A worker killed outright (a node failure) leaves its trial running in the study; the next worker
# that asks ends it as interrupted and runs its values again. A worker that stops with exit 1 (several trials in
# a row failed; their logs are DIR/trials/NNNN.log) is not requeued: fix the cause, then submit again.
#
# The arguments of `doplus tune` are the script's own arguments when it has any, else TUNE split on whitespace
# (no glob expansion; keep the values in TUNE free of spaces). Either way each one reaches doplus as one argument,
# never through a command string. Adapt the #SBATCH lines to your cluster.
#SBATCH --job-name=doplus-tune
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
    TUNE=${TUNE:?set TUNE to the arguments of doplus tune, e.g. TUNE=\"--recipe R.yaml --space lr=0:1 --objective OVR\"}
    read -r -d '' -a ARGS <<< "$TUNE" || true  # split on whitespace (newlines too), without glob expansion
fi

if [ -z "${SLURM_ARRAY_TASK_ID:-}" ]; then  # started by hand: submit the array
    WORKERS=${WORKERS:-4}
    if ! [[ "$WORKERS" =~ ^[1-9][0-9]*$ ]]; then
        echo "WORKERS=$WORKERS: the number of array tasks, a whole number of at least 1" >&2
        exit 2
    fi
    echo "submitting $WORKERS workers of the study: doplus tune ${ARGS[*]}"
    exec sbatch --array="0-$((WORKERS - 1))${MAX_AT_ONCE:+%$MAX_AT_ONCE}" "$0" "$@"
fi

REQUEUE=0
# shellcheck disable=SC2329  # the USR1 trap below invokes it; shellcheck misses that before the script's final exit
on_time_limit() {
    REQUEUE=1
    kill -TERM "$TUNE_PID"  # the worker hands it to its trial's run: a checkpoint, the trial interrupted, exit 143
}
trap on_time_limit USR1

trap ':' TERM  # on preemption: wait for the trial to checkpoint instead of dying before it
# (set before the worker starts: a signal that came between the two would end this shell first; the
# worker itself starts with the default action, as a trap's handler is not inherited)
doplus tune "${ARGS[@]}" &
TUNE_PID=$!

set +e
wait "$TUNE_PID"
STATUS=$?
while kill -0 "$TUNE_PID" 2> /dev/null; do  # a trapped signal interrupts `wait`: wait again for the worker
    wait "$TUNE_PID"
    STATUS=$?
done
set -e

if [ "$REQUEUE" = 1 ]; then
    echo "time limit near: worker $SLURM_ARRAY_TASK_ID stopped its trial, requeueing" \
         "${SLURM_ARRAY_JOB_ID}_$SLURM_ARRAY_TASK_ID"
    scontrol requeue "${SLURM_ARRAY_JOB_ID}_$SLURM_ARRAY_TASK_ID"
fi
exit "$STATUS"
