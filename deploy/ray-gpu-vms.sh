#!/usr/bin/env bash
# A Ray cluster of GPU VMs for mecefo-launch --backend ray (mecefo_jax/ray_driver.py): one host
# of the job per VM, all of the VM's GPUs. NOT run on GPU VMs: written from Ray's documentation
# (`ray start`); the driver itself is tested on a Ray cluster of one machine's CPU
# (tests/test_ray.py).
#
# On every VM: the same checkout or image with `pip install -r requirements.txt "jax[cuda12]"
# "ray>=2.60,<3"` (or `pip install ".[ray]"` in the checkout), --out on a filesystem that every VM mounts at
# the same path (NFS, Filestore, GCS FUSE), and the in-memory tier in each VM's own /dev/shm.
#
#   deploy/ray-gpu-vms.sh head                  # on the VM that runs the driver (no GPU used)
#   deploy/ray-gpu-vms.sh worker HEAD_IP        # on each GPU VM
#   deploy/ray-gpu-vms.sh launch HEAD_IP N -- <mecefo-train args>   # on the head
#
# A VM that dies is the death of its host: the others go on at once. The same VM back (ray
# start again), or a new one started with `worker`, rejoins the job at its next agreed step
# (--rejoin-after 0: as soon as Ray lists it).
set -euo pipefail
PORT=${RAY_PORT:-6379}
GPUS=${GPUS:-$(nvidia-smi --list-gpus 2>/dev/null | wc -l)}
case "${1:-}" in
  head)
    ray start --head --port="$PORT" --num-cpus=0 --num-gpus=0 ;;
  worker)
    ray start --address="$2:$PORT" --num-gpus="$GPUS" ;;
  launch)
    head=$2 n=$3
    shift 3
    [ "${1:-}" = -- ] && shift
    exec mecefo-launch --backend ray --address "$head:$PORT" -n "$n" --gpus \
      --devices-per-process "$GPUS" --rejoin-after 0 -- "$@" ;;
  *)
    sed -n '2,17p' "$0"
    exit 2 ;;
esac
