# shellcheck shell=bash
# The body of every sbatch recipe in slurm/: they set parameters and source this file, so the
# CPU test job and a 64-GPU job run the same lines.
#
# What it does, in order:
#   1. splits the job's nodes: the first TRAINER_NODES train, the next ROLLOUT_NODES serve
#      (`megatron-gspo launch` makes the same split from the same node list);
#   2. starts one `launch --role rollout` per rollout node (its vLLM servers), if any;
#   3. starts one `launch --role trainer` per trainer node (torchrun ... train), which waits
#      for the servers' /health before training and gets their URLs in
#      MEGATRON_GSPO_VLLM_URLS;
#   4. waits for the trainer. A rollout node's servers that exit are restarted by their
#      `launch --role rollout` (the trainer sends them its current weights before they serve
#      again); a rollout step that ends (its servers given up, its node lost) is logged and
#      the trainer goes on with the other servers; with fewer than rollout.vllm.min_servers
#      serving it checkpoints and exits 75, and the job requeues itself. When every rollout
#      step has ended, the trainer is stopped (it saves) and the job fails, not requeued;
#   5. on exit, success or not, stops the servers (trap EXIT).
#
# Signals. USR1 (sbatch --signal=B:USR1@SECONDS, the time limit is near): the trainer step is
# sent SIGTERM (it finishes its step, saves, exits 75) and the job requeues itself;
# the next run resumes from the checkpoint. TERM (pre-emption, `scontrol requeue`, scancel):
# Slurm signals every process of the job at once; the trainer saves if the site's KillWait /
# GraceTime allows, and Slurm decides whether the job comes back.
#
# Logs: the batch log (sbatch --output), and one file per role and node in
# $LOG_DIR/<role>-<node>.log, appended to across requeues.

set -euo pipefail

: "${RECIPE:?set RECIPE to a recipe file}"
: "${SLURM_JOB_ID:?run this under sbatch}"
# The command line of the CLI; e.g. "python -m megatron_gspo.cli" to run the checkout itself.
GSPO=${GSPO:-megatron-gspo}
VENV=${VENV:-}
ROLLOUT_NODES=${ROLLOUT_NODES:-0}
ROLLOUT_GPUS=${ROLLOUT_GPUS:-0}
REWARD_NODES=${REWARD_NODES:-0}
REWARD_PORT=${REWARD_PORT:-8100}
REWARD_MODEL=${REWARD_MODEL:-}
TRAINER_NODES=${TRAINER_NODES:-$((SLURM_JOB_NUM_NODES - ROLLOUT_NODES - REWARD_NODES))}
GPUS_PER_NODE=${GPUS_PER_NODE:-0}
NPROC_PER_NODE=${NPROC_PER_NODE:-}
MASTER_PORT=${MASTER_PORT:-}
VLLM_PORT=${VLLM_PORT:-8000}
VLLM_MODEL=${VLLM_MODEL:-}
VLLM_MODEL_FROM_RECIPE=${VLLM_MODEL_FROM_RECIPE:-}
VLLM_TP=${VLLM_TP:-}
VLLM_ARGS=${VLLM_ARGS:-}
ROLLOUT_WAIT=${ROLLOUT_WAIT:-1800}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-300}
REQUEUE_ON_TIMELIMIT=${REQUEUE_ON_TIMELIMIT:-1}
STEPS=${STEPS:-}
TRAIN_ARGS=${TRAIN_ARGS:-}
OUTPUT_DIR=${OUTPUT_DIR:-runs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}}
LOG_DIR=${LOG_DIR:-logs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}}

if [ -n "$VENV" ]; then
  # shellcheck disable=SC1091
  source "$VENV/bin/activate"
fi

log() { printf '%s batch: %s\n' "$(date '+%F %T')" "$*"; }

mkdir -p "$LOG_DIR" "$OUTPUT_DIR"

# The job's key. Every vLLM server of this job answers (weight updates included) only callers
# that present it; the trainer does. A fresh one per run, handed to every step through the
# environment (srun passes it on), never on a command line, where other users could read it.
if [ -z "${MEGATRON_GSPO_VLLM_KEY:-}" ]; then
  MEGATRON_GSPO_VLLM_KEY=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
fi
export MEGATRON_GSPO_VLLM_KEY
log "job $SLURM_JOB_ID (${SLURM_JOB_NAME}) run $((${SLURM_RESTART_COUNT:-0} + 1)) on" \
  "$SLURM_JOB_NODELIST; recipe $RECIPE; output $OUTPUT_DIR; logs $LOG_DIR"

# 1. Roles.
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if [ $((TRAINER_NODES + ROLLOUT_NODES + REWARD_NODES)) -gt "${#nodes[@]}" ] ||
  [ "$TRAINER_NODES" -lt 1 ]; then
  log "error: $TRAINER_NODES trainer + $ROLLOUT_NODES rollout + $REWARD_NODES reward nodes do" \
    "not fit in ${#nodes[@]} allocated node(s)"
  exit 1
fi
trainers=("${nodes[@]:0:TRAINER_NODES}")
rollouts=("${nodes[@]:TRAINER_NODES:ROLLOUT_NODES}")
rewards=("${nodes[@]:TRAINER_NODES+ROLLOUT_NODES:REWARD_NODES}")
join() {
  local IFS=,
  echo "$*"
}
log "trainer nodes: $(join "${trainers[@]}") (rendezvous on ${trainers[0]})"

launch_args=(--trainer-nodes "$TRAINER_NODES" --rollout-nodes "$ROLLOUT_NODES"
  --rollout-gpus "$ROLLOUT_GPUS" --vllm-port "$VLLM_PORT"
  --reward-nodes "$REWARD_NODES" --reward-port "$REWARD_PORT")
[ -n "$MASTER_PORT" ] && launch_args+=(--master-port "$MASTER_PORT")
[ -n "$NPROC_PER_NODE" ] && launch_args+=(--nproc-per-node "$NPROC_PER_NODE")
# Both roles need it: servers start one per VLLM_TP GPUs, the trainer lists their URLs.
[ -n "$VLLM_TP" ] && launch_args+=(--vllm-tp "$VLLM_TP")
rollout_args=()
[ -n "$VLLM_MODEL" ] && rollout_args+=(--vllm-model "$VLLM_MODEL")
[ -n "$VLLM_MODEL_FROM_RECIPE" ] && rollout_args+=(--vllm-model-from-recipe "$VLLM_MODEL_FROM_RECIPE")
[ -n "$VLLM_ARGS" ] && rollout_args+=(--vllm-args "$VLLM_ARGS")
train_args=(--output-dir "$OUTPUT_DIR" --shutdown-timeout "$SHUTDOWN_TIMEOUT"
  --rollout-wait "$ROLLOUT_WAIT")
read -r -a gspo <<<"$GSPO"
read -r -a extra <<<"$TRAIN_ARGS"
[ -n "$STEPS" ] && extra+=(--steps "$STEPS")

# One task per node; --overlap lets the rollout and trainer steps share a node (single-node
# split); all the node's CPUs and no binding, so torchrun's ranks are not pinned to one core.
step_args=(--ntasks-per-node=1 --overlap --cpu-bind=none --open-mode=append
  --cpus-per-task="${SLURM_CPUS_ON_NODE:-1}")
[ "$GPUS_PER_NODE" -gt 0 ] && step_args+=(--gpus-per-node="$GPUS_PER_NODE")

# 2.-5. Processes, signals and clean-up.
trainer_pid=""
rollout_pids=() # one step per rollout node: a node lost ends its own servers only
reward_pid=""
stop=""

alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }
any_alive() {
  local p
  for p in "$@"; do alive "$p" && return 0; done
  return 1
}

# Signals go to a step through slurmctld (`scancel --signal`), never to srun itself: srun
# answers SIGTERM by killing its step at once, which would lose the checkpoint.
step_ids() { squeue -h -s -j "$SLURM_JOB_ID" -o '%i %j' 2>/dev/null | awk -v n="$1" '$2 == n {print $1}'; }
signal_step() { # name signal
  local id
  for id in $(step_ids "$1"); do scancel --signal="$2" "$id" 2>/dev/null || true; done
}

stop_step() { # name pid...: SIGTERM, then cancel the step(s) after 60 s
  local name=$1
  shift
  any_alive "$@" || return 0
  log "stopping the $name step"
  signal_step "$name" TERM
  for _ in $(seq 60); do
    any_alive "$@" || return 0
    sleep 1
  done
  local id
  for id in $(step_ids "$name"); do scancel "$id" 2>/dev/null || true; done
}

# shellcheck disable=SC2317  # a trap handler: called by the shell, not by a line here
on_exit() {
  local rc=$?
  trap - USR1 TERM
  stop_step trainer "$trainer_pid"
  stop_step rollout ${rollout_pids[@]+"${rollout_pids[@]}"}
  stop_step reward "$reward_pid"
  log "done (exit $rc)"
}
# shellcheck disable=SC2317  # a trap handler: called by the shell, not by a line here
on_usr1() {
  stop=timelimit
  log "time limit near: asking the trainer to checkpoint and stop"
  signal_step trainer TERM
}
# shellcheck disable=SC2317  # a trap handler: called by the shell, not by a line here
on_term() {
  # Pre-emption, requeue or scancel: Slurm signals every step itself; keep waiting for the
  # trainer to save until it exits or KillWait runs out.
  stop=${stop:-term}
  log "SIGTERM (pre-emption, requeue or cancel): waiting for the trainer to checkpoint"
}
trap on_exit EXIT
trap on_usr1 USR1
trap on_term TERM

if [ "$ROLLOUT_NODES" -gt 0 ] || [ "$ROLLOUT_GPUS" -gt 0 ]; then
  if [ "$ROLLOUT_NODES" -gt 0 ]; then serve_on=("${rollouts[@]}"); else serve_on=("${trainers[@]}"); fi
  log "rollout nodes: $(join "${serve_on[@]}") (vLLM on port $VLLM_PORT)"
  for node in "${serve_on[@]}"; do
    srun "${step_args[@]}" --job-name=rollout --nodes=1 --ntasks=1 --nodelist="$node" \
      --output="$LOG_DIR/rollout-$node.log" \
      "${gspo[@]}" launch "$RECIPE" --role rollout "${launch_args[@]}" "${rollout_args[@]}" &
    rollout_pids+=($!)
  done
fi
serving_steps=${#rollout_pids[@]}

if [ "$REWARD_NODES" -gt 0 ]; then
  log "reward nodes: $(join "${rewards[@]}") (the recipe's judge or reward model on port $REWARD_PORT)"
  reward_args=()
  [ -n "$REWARD_MODEL" ] && reward_args+=(--reward-model "$REWARD_MODEL")
  srun "${step_args[@]}" --job-name=reward --nodes="$REWARD_NODES" --ntasks="$REWARD_NODES" \
    --nodelist="$(join "${rewards[@]}")" --output="$LOG_DIR/reward-%N.log" \
    "${gspo[@]}" launch "$RECIPE" --role reward "${launch_args[@]}" "${reward_args[@]}" &
  reward_pid=$!
fi

srun "${step_args[@]}" --job-name=trainer --nodes="$TRAINER_NODES" --ntasks="$TRAINER_NODES" \
  --nodelist="$(join "${trainers[@]}")" --output="$LOG_DIR/trainer-%N.log" \
  "${gspo[@]}" launch "$RECIPE" --role trainer "${launch_args[@]}" "${train_args[@]}" "${extra[@]}" &
trainer_pid=$!

# Poll rather than `wait -n`: that needs bash >= 5.1, which many clusters lack. `sleep & wait`
# keeps the shell interruptible, so USR1/TERM are handled at once.
while alive "$trainer_pid"; do
  left=()
  for pid in ${rollout_pids[@]+"${rollout_pids[@]}"}; do
    if alive "$pid"; then
      left+=("$pid")
      continue
    fi
    rollout_rc=0
    wait "$pid" || rollout_rc=$?
    log "warning: a rollout step ended (status $rollout_rc) while training; the trainer goes" \
      "on with the servers left (rollout.vllm.min_servers); see $LOG_DIR/rollout-*.log"
  done
  rollout_pids=(${left[@]+"${left[@]}"})
  if [ "$serving_steps" -gt 0 ] && [ "${#rollout_pids[@]}" -eq 0 ] && [ -z "$stop" ]; then
    # Nothing in this allocation brings them back, and a requeue would only meet the same
    # failure if it was the servers' command (a wrong model path, vLLM missing): stop here.
    stop=rollout
    log "error: every rollout step ended; stopping the trainer (it saves a checkpoint) and" \
      "ending the job without a requeue; see $LOG_DIR/rollout-*.log"
    stop_step trainer "$trainer_pid"
  fi
  if [ -n "$reward_pid" ] && ! alive "$reward_pid"; then
    reward_pid=""
    log "error: the reward servers exited while training; see $LOG_DIR/reward-*.log"
    exit 1
  fi
  sleep 2 &
  wait $! || true
done
trainer_rc=0
wait "$trainer_pid" || trainer_rc=$?
trainer_pid=""
log "trainer finished with status $trainer_rc"
if [ "$stop" = rollout ]; then
  exit 1
fi

# Exit 75: the trainer stopped after saving a checkpoint ("resume me"; launch passes it on
# through torchrun): on SIGTERM, or by itself when too few rollout servers served. Requeued
# when it was the time-limit warning or the servers; after an external SIGTERM (pre-emption,
# scontrol requeue, scancel) Slurm itself decides.
if [ "$trainer_rc" -eq 75 ] && { [ "$stop" = timelimit ] || [ -z "$stop" ]; } &&
  [ "$REQUEUE_ON_TIMELIMIT" = 1 ]; then
  stop_step rollout ${rollout_pids[@]+"${rollout_pids[@]}"}
  stop_step reward "$reward_pid"
  rollout_pids=()
  reward_pid=""
  log "requeueing job $SLURM_JOB_ID to continue from the checkpoint"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$trainer_rc"
