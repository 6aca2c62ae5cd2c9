# shellcheck shell=bash
# Ray on the nodes of one slurm job, sourced by train.sbatch.
#
# Every Ray process of the job runs inside an srun step this job started (`ray start --block`),
# and stop_ray stops exactly those steps by their PIDs: never `ray stop`, which would stop every
# Ray on the node, another job's included. Settings (environment variables, with defaults):
#   RAY_PORT=6379                 the head's GCS port
#   RAY_CLIENT_PORT=10001         the head's Ray client server port
#   RAY_NODE_PORTS=0              node manager / object manager / agent / metrics ports of every
#                                 node (0: each process, Ray's workers too, picks a free one; set
#                                 a base port, e.g. 20000, when a firewall needs them fixed:
#                                 base, base+1, ... base+5, and workers Ray's 10002-19999)
#   RAY_OBJECT_STORE_BYTES=       object store per node (empty: Ray's default, 30% of memory)
#   RAY_CPUS_PER_NODE=$SLURM_CPUS_ON_NODE, RAY_GPUS_PER_NODE=$SLURM_GPUS_ON_NODE
#   RAY_TMP=/tmp/ray_$SLURM_JOB_ID  Ray's session and log directory on each node
#   RAY_WAIT_S=300                how long the nodes may take to join
#   RAY_STOP_WAIT_S=60            how long Ray may take to stop before its steps are killed

RAY_PORT="${RAY_PORT:-6379}"
RAY_CLIENT_PORT="${RAY_CLIENT_PORT:-10001}"
RAY_NODE_PORTS="${RAY_NODE_PORTS:-0}"
RAY_OBJECT_STORE_BYTES="${RAY_OBJECT_STORE_BYTES:-}"
RAY_CPUS_PER_NODE="${RAY_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-}}"
RAY_GPUS_PER_NODE="${RAY_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}"
RAY_TMP="${RAY_TMP:-/tmp/ray_${SLURM_JOB_ID}}"
RAY_WAIT_S="${RAY_WAIT_S:-300}"
RAY_STOP_WAIT_S="${RAY_STOP_WAIT_S:-60}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"   # every Ray process of the job must agree

ray_step_pids=()   # the srun steps running `ray start --block`, one per node

# The IP address NODE reaches the others with (its first address).
node_ip() {
  srun --nodes=1 --ntasks=1 -w "$1" hostname --ip-address | awk '{print $1}'
}

# `ray start` arguments every node shares; the node's own IP is $1.
ray_node_args() {
  local ip="$1" base="$RAY_NODE_PORTS" p=(0 0 0 0 0 0) i
  if [ "$base" -ne 0 ]; then
    for i in 0 1 2 3 4 5; do p[i]=$((base + i)); done
  fi
  ray_args=(--node-ip-address="$ip" --temp-dir="$RAY_TMP" --num-gpus="$RAY_GPUS_PER_NODE"
            --node-manager-port="${p[0]}" --object-manager-port="${p[1]}"
            --dashboard-agent-listen-port="${p[2]}" --dashboard-agent-grpc-port="${p[3]}"
            --metrics-export-port="${p[4]}" --runtime-env-agent-port="${p[5]}" --block)
  if [ "$base" -eq 0 ]; then   # workers too: Ray's fixed range would be shared on a shared node
    ray_args+=(--min-worker-port=0 --max-worker-port=0)
  fi
  if [ -n "$RAY_CPUS_PER_NODE" ]; then ray_args+=(--num-cpus="$RAY_CPUS_PER_NODE"); fi
  if [ -n "$RAY_OBJECT_STORE_BYTES" ]; then
    ray_args+=(--object-store-memory="$RAY_OBJECT_STORE_BYTES")
  fi
}

# Wait (at most RAY_WAIT_S) until the cluster at $1 has $2 nodes with their GPUs; fail at
# once if a Ray step has exited.
wait_for_ray() {
  python -m ragen_mega.ray.wait_cluster --address "$1" --nodes "$2" \
    --gpus-per-node "$RAY_GPUS_PER_NODE" --timeout-s "$RAY_WAIT_S" \
    --step-pids "${ray_step_pids[@]}"
}

# start_ray NODE...: the head on the first node, then a worker on each other node; returns once
# all have joined. Sets ray_address (HEAD_IP:PORT).
start_ray() {
  local head="$1" ip node
  ip="$(node_ip "$head")"
  ray_address="$ip:$RAY_PORT"
  echo "ragen_mega: Ray head on $head ($ray_address), $# node(s), Ray logs in $RAY_TMP on each"
  ray_node_args "$ip"
  srun --nodes=1 --ntasks=1 -w "$head" ray start --head --port="$RAY_PORT" \
    --ray-client-server-port="$RAY_CLIENT_PORT" --include-dashboard=false "${ray_args[@]}" &
  ray_step_pids+=("$!")
  wait_for_ray "$ray_address" 1
  shift
  for node in "$@"; do
    ray_node_args "$(node_ip "$node")"
    srun --nodes=1 --ntasks=1 -w "$node" ray start --address="$ray_address" "${ray_args[@]}" &
    ray_step_pids+=("$!")
  done
  wait_for_ray "$ray_address" "$(($# + 1))"
}

# Stop the Ray steps this job started (SIGTERM: `ray start --block` then stops its node's Ray
# processes); kill the ones still there after RAY_STOP_WAIT_S.
stop_ray() {
  local pid waited=0
  if [ "${#ray_step_pids[@]}" -eq 0 ]; then return 0; fi
  echo "ragen_mega: stopping this job's Ray (steps ${ray_step_pids[*]})"
  kill -TERM "${ray_step_pids[@]}" 2>/dev/null || true
  for pid in "${ray_step_pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "$RAY_STOP_WAIT_S" ]; do
      sleep 1
      waited=$((waited + 1))
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  ray_step_pids=()
}
