#!/bin/bash
# The one launcher behind every job script in slurm/: runs pretrain/main.py on all nodes and
# GPUs of the allocation, saves and requeues on pre-emption or time limit.
#
#   slurm/launch.sh CONFIG [--set key=value ...]       (inside an sbatch job, from the repo root)
#
# What it does, in order:
#   1. reads the run folder from the config (this also checks the config before anything
#      starts on 32 GPUs) and links the job's Slurm log into it;
#   2. derives the rendezvous from Slurm: MASTER_ADDR = address of the first node of
#      `scontrol show hostnames $SLURM_JOB_NODELIST`, MASTER_PORT from the job id,
#      WORLD_SIZE = nodes x tasks per node;
#   3. starts one process per GPU (or per task on CPU nodes, gloo) with `srun`: RANK,
#      LOCAL_RANK, WORLD_SIZE come from SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS. With
#      PRETRAIN_LAUNCHER=deepspeed it writes a hostfile and starts DeepSpeed's own launcher;
#   4. on SIGUSR1 (the job's `--signal=B:USR1@600` before its time limit, or `scancel
#      --signal=USR1 --batch`) forwards the signal to the training processes, which save a
#      checkpoint and exit with 99; then it requeues the job (`scontrol requeue`). The
#      requeued job runs this same command and resumes from RUN/checkpoints/latest.
#      SIGTERM (scancel, pre-emption by Slurm) is forwarded too: the trainer saves, but the
#      launcher does not requeue. A run that finished its iterations exits 0;
#   5. when the trainers exit 124 (the hang watchdog: no step completed within
#      train.hang_timeout; every rank wrote its stacks to RUN/hang/), requeues the job too,
#      at most PRETRAIN_MAX_HANG_REQUEUES times per job; the requeued job resumes from the
#      last checkpoint (a hang is often a node or the network; one that recurs stops there).
#
# Settings (environment; defaults in brackets):
#   PRETRAIN_PYTHON     Python command [.venv/bin/python if present, else python3]; see slurm/env.sh
#   PRETRAIN_ENTRY      training script [pretrain/main.py]
#   PRETRAIN_LAUNCHER   srun | deepspeed [srun]
#   PRETRAIN_DS_LAUNCHER  DeepSpeed's multi-node backend when PRETRAIN_LAUNCHER=deepspeed
#                       [slurm; pdsh needs passwordless ssh between nodes]
#   PRETRAIN_MAX_REQUEUES  stop requeueing after this many restarts [100]
#   PRETRAIN_MAX_HANG_REQUEUES  requeue a job whose training hung (exit 124) at most this
#                       many times [3]; counted in RUN/hang/requeues-JOBID
#   MASTER_PORT         rendezvous port [10000 + job id mod 20000: below Linux's ephemeral
#                       ports, which another process's connection may hold]
#   NCCL_* / TORCH_NCCL_* / OMP_NUM_THREADS   see "Communication" below; your values win
set -euo pipefail

EXIT_PREEMPTED=99   # pretrain/train/trainer.py: checkpoint saved, run not finished
EXIT_HUNG=124       # pretrain/train/watchdog.py: no step completed in time; stacks in RUN/hang/

log() { echo "[launch $(date -u +%FT%TZ)] $*"; }
die() { echo "[launch] error: $*" >&2; exit 2; }

CONFIG=${1:-}
[ -n "$CONFIG" ] || die "usage: slurm/launch.sh CONFIG [--set key=value ...]"
shift
[ -n "${SLURM_JOB_ID:-}" ] || die "not inside a Slurm job; submit the job script with sbatch (see docs/slurm.md)"
[ -f "$CONFIG" ] || die "config $CONFIG not found from $(pwd); submit from the repository root (cd REPO && sbatch slurm/NAME.sh)"

# ---------------------------------------------------------------- signals
# USR1 (the header's --signal=B:USR1@600 before the time limit, or `scancel --signal=USR1
# --batch` by hand) means: checkpoint, then requeue. TERM comes from Slurm itself (scancel,
# the time limit itself, pre-emption, whose requeue Slurm does): checkpoint, and do not
# requeue, or `scancel` could never stop a job. Either goes to every step of the job, i.e.
# the training processes (not back to this batch shell).
got_usr1=0
got_term=0
interrupted=0
CHILD=
# shellcheck disable=SC2317  # called by the traps below
forward() {
  interrupted=1
  if [ "$1" = USR1 ]; then got_usr1=1; else got_term=1; fi
  log "got SIG$1: asking the training processes to checkpoint and stop"
  scancel --signal="$1" "$SLURM_JOB_ID" 2>/dev/null || { [ -n "$CHILD" ] && kill -s "$1" "$CHILD" 2>/dev/null; } || true
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

# shellcheck source=slurm/env.sh
source slurm/env.sh
ENTRY=${PRETRAIN_ENTRY:-pretrain/main.py}

# ---------------------------------------------------------------- run folder and log
# The run folder is logging.run_dir of the config after the --set overrides.
RUN_DIR=$("${PY[@]}" tools/study.py run-dir "$CONFIG" "$@") || die "cannot read the run folder of $CONFIG (message above)"
mkdir -p "$RUN_DIR"
# Slurm writes the job's output where #SBATCH --output says (slurm/logs/, which exists in
# every checkout: Slurm fails a job whose log folder is missing). Link it into the run.
STDOUT=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *StdOut=//p' | head -n 1)
if [ -n "$STDOUT" ] && [ -f "$STDOUT" ]; then
  ln -sfn "$(readlink -f "$STDOUT")" "$RUN_DIR/slurm-$SLURM_JOB_ID.out"
fi

# ---------------------------------------------------------------- topology
mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
NNODES=${#HOSTS[@]}
# Slurm's own address for the node: the name alone may not resolve (simulated nodes).
MASTER_ADDR=$(scontrol show node "${HOSTS[0]}" 2>/dev/null | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p' | head -n 1)
export MASTER_ADDR=${MASTER_ADDR:-${HOSTS[0]}}
# Below the ephemeral range (32768-60999), where a socket of any process could already hold
# it; pretrain/train/distributed.py slurm_master_port is the same rule for a bare srun.
export MASTER_PORT=${MASTER_PORT:-$((10000 + SLURM_JOB_ID % 20000))}
# Tasks per node: --ntasks-per-node of the job; else one per GPU; else one.
GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-0}
TASKS_PER_NODE=${SLURM_NTASKS_PER_NODE:-}
if [ -z "$TASKS_PER_NODE" ]; then
  if [ "$GPUS_PER_NODE" -gt 0 ]; then TASKS_PER_NODE=$GPUS_PER_NODE; else TASKS_PER_NODE=1; fi
fi
WORLD_SIZE=$((NNODES * TASKS_PER_NODE))

# ---------------------------------------------------------------- communication
# One place for the settings every node needs. Cluster-specific ones (NCCL_SOCKET_IFNAME,
# NCCL_IB_HCA, ...) belong in the job script's environment or the site's modules.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # a dead rank fails the job instead of hanging it
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
export PYTHONUNBUFFERED=1   # log lines appear as they happen
export PYTHONFAULTHANDLER=1 # a crashing rank prints its Python stack

log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) config $CONFIG $* run $RUN_DIR"
log "nodes $NNODES (${HOSTS[*]}) x $TASKS_PER_NODE tasks = world size $WORLD_SIZE; gpus/node $GPUS_PER_NODE; master $MASTER_ADDR:$MASTER_PORT"

# ---------------------------------------------------------------- start
launcher=${PRETRAIN_LAUNCHER:-srun}
case $launcher in
  srun)
    # --kill-on-bad-exit=0 (also against a site's KillOnBadExit=1): the first rank to exit
    # 99 after a pre-emption checkpoint must not get the others killed while they still
    # finish theirs. A crashed rank still ends the job: the others' next collective times
    # out (TORCH_NCCL_ASYNC_ERROR_HANDLING, set above) and they exit.
    SRUN_ARGS=(--nodes="$NNODES" --ntasks-per-node="$TASKS_PER_NODE" --ntasks="$WORLD_SIZE"
               --kill-on-bad-exit=0 --export=ALL)
    # srun does not inherit the job's --cpus-per-task since Slurm 22.05.
    [ -n "${SLURM_CPUS_PER_TASK:-}" ] && SRUN_ARGS+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
    # The wrapper execs, so the signals srun forwards reach python itself.
    # shellcheck disable=SC2016  # expanded by each task's shell, not here
    srun "${SRUN_ARGS[@]}" bash -c \
      'export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE; exec "$@"' \
      launch "${PY[@]}" -u "$ENTRY" --config "$CONFIG" "$@" &
    ;;
  deepspeed)
    HOSTFILE=$RUN_DIR/hostfile-$SLURM_JOB_ID
    for h in "${HOSTS[@]}"; do echo "$h slots=$TASKS_PER_NODE"; done > "$HOSTFILE"
    "${PY[@]}" -m deepspeed.launcher.runner --hostfile "$HOSTFILE" --launcher "${PRETRAIN_DS_LAUNCHER:-slurm}" \
      --no_ssh_check --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
      "$ENTRY" --config "$CONFIG" "$@" &
    ;;
  *) die "PRETRAIN_LAUNCHER=$launcher is unknown; use srun or deepspeed" ;;
esac
CHILD=$!
# A signal that came before the processes existed reaches them now.
[ "$got_usr1" = 1 ] && forward USR1
[ "$got_term" = 1 ] && forward TERM

# bash runs a trap only between commands, so the launcher waits in `wait`, which a trapped
# signal interrupts; then it waits again for the processes to save and exit.
while :; do
  interrupted=0
  rc=0
  wait "$CHILD" || rc=$?
  [ "$interrupted" = 1 ] || break
done
trap - USR1 TERM

# 99: the trainer checkpointed on a signal (ours, or one sent to the steps directly). Killed
# by our USR1 (exit 128 + signal) before it installed its handler: no new checkpoint, but
# the last one is intact, so requeueing is right as well.
if [ "$got_term" = 0 ] && { [ "$rc" -eq "$EXIT_PREEMPTED" ] || { [ "$got_usr1" = 1 ] && [ "$rc" -gt 128 ]; }; }; then
  restarts=${SLURM_RESTART_COUNT:-0}
  if [ "$restarts" -ge "${PRETRAIN_MAX_REQUEUES:-100}" ]; then
    log "stopped (exit $rc); not requeueing: already restarted $restarts times (PRETRAIN_MAX_REQUEUES)"
    exit "$rc"
  fi
  log "stopped for pre-emption (exit $rc); requeueing job $SLURM_JOB_ID (it resumes from $RUN_DIR)"
  scontrol requeue "$SLURM_JOB_ID" || { log "scontrol requeue failed; submit the same script again, it resumes"; exit "$rc"; }
  exit 0
fi
# 124: the hang watchdog ended a run whose steps stopped completing. srun reports the highest
# exit code of its tasks, so a rank whose collective broke under it (exit 1) does not hide it.
if [ "$got_term" = 0 ] && [ "$rc" -eq "$EXIT_HUNG" ]; then
  restarts=${SLURM_RESTART_COUNT:-0}
  count_file=$RUN_DIR/hang/requeues-$SLURM_JOB_ID
  hangs=$(cat "$count_file" 2>/dev/null || echo 0)
  max_hangs=${PRETRAIN_MAX_HANG_REQUEUES:-3}
  if [ "$hangs" -ge "$max_hangs" ] || [ "$restarts" -ge "${PRETRAIN_MAX_REQUEUES:-100}" ]; then
    log "training hung (exit $rc; stacks in $RUN_DIR/hang/); not requeueing: $hangs hang requeues (PRETRAIN_MAX_HANG_REQUEUES=$max_hangs), $restarts restarts (PRETRAIN_MAX_REQUEUES)"
    exit "$rc"
  fi
  mkdir -p "$RUN_DIR/hang"
  echo $((hangs + 1)) > "$count_file.tmp" && mv "$count_file.tmp" "$count_file"
  log "training hung (exit $rc; stacks in $RUN_DIR/hang/); requeueing job $SLURM_JOB_ID (hang requeue $((hangs + 1)) of $max_hangs; it resumes from the last checkpoint)"
  scontrol requeue "$SLURM_JOB_ID" || { log "scontrol requeue failed; submit the same script again, it resumes"; exit "$rc"; }
  exit 0
fi
if [ "$got_term" = 1 ] && [ "$rc" -eq "$EXIT_PREEMPTED" ]; then
  log "stopped by Slurm's SIGTERM; checkpoint saved. Slurm requeues a pre-empted or \`scontrol requeue\`d job itself; after scancel or a time limit, sbatch the same script to resume"
  exit "$rc"
fi
log "training exited with $rc"
exit "$rc"
