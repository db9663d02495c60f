#!/usr/bin/env bash
# The GPU tables of docs/benchmarks.md that #38 asks for, one table set per call of the
# lent machine (each meant for one call of at most 10 minutes; NP=4 alone where a set at
# NP "2 4" runs long), every contender in the same run:
#
#   bench/gpu_tables.sh scaling   ResNet-50 at batch 32 and 64 and the transformer, on 2
#                                 and 4 GPUs: hvd, DDP, both with fp16 compression, and
#                                 no communication (scaling efficiency; last losses)
#   bench/gpu_tables.sh small     blocking allreduce from 4 KB to 1 GB against NCCL's
#                                 process group, on 2 and 4 GPUs, twice
#   bench/gpu_tables.sh compile   ResNet-50 at batch 64 under torch.compile, hvd against DDP
#   bench/gpu_tables.sh backend   (#35) the torch.distributed backend "hvd" against NCCL's
#                                 process group: all_reduce, DDP ResNet-50, FSDP2 on a
#                                 24-layer transformer (step time and peak memory)
#   bench/gpu_tables.sh observe   (#34) ResNet-50 with the straggler measurement off and
#                                 on, alternating runs (its overhead)
#   bench/gpu_tables.sh profile   (#38) where a ResNet-50 step's time goes at batch 32 and
#                                 64, on the host and the GPU: hvd, DDP, no communication
#
# NP: the GPU counts (default 2, and 4 with 4 GPUs). Every run's whole output goes to
# $BENCH_OUT (default $OUT on the lent machine, else /tmp/gpu_tables), so that a call cut
# short or an output cut to its tail still leaves the tables; stdout gets the table lines.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:?"usage: bench/gpu_tables.sh scaling|small|compile|backend|observe|profile"}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
out=${BENCH_OUT:-${OUT:-/tmp/gpu_tables}}
mkdir -p "$out"
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
NP=${NP:-2 $([ "$ngpu" -ge 4 ] && echo 4)}
T0=$SECONDS
n=0
run() {  # run LIMIT ARGS...: one benchmark, its log kept, its table lines shown
  local limit=$1; shift
  n=$((n + 1))
  local log="$out/$what.$n.log"
  echo "== [$((SECONDS - T0)) s] $*" | tee "$log"
  timeout -k 5 "$limit" python3 "$@" >>"$log" 2>&1 || echo "(exit $?)" | tee -a "$log"
  grep -E "^(resnet|transformer|allreduce|profile|(host|gpu|nccl|profiled) [a-z]+ +[0-9.]+| {13,}[a-z][a-z0-9 -]*$|  +(img|seq)/s/GPU|  *size|  *[0-9]+ [KMG]B|[a-z0-9-]+ +[0-9.]+ +[0-9.]+ |.*(ratio|efficiency):|#|  *all_reduce|  *[0-9]+[KMG] |DDP|FSDP2|synthetic|stragglers o|on / off)" \
    "$log"
}
for np in $NP; do
  case $what in
    scaling)
      run 120 bench/train_gpu.py --np "$np" --model resnet50 --batch-size 32 --iters 7 --no-comm --fp16-allreduce
      run 120 bench/train_gpu.py --np "$np" --model resnet50 --batch-size 64 --iters 7 --no-comm --fp16-allreduce
      run 150 bench/train_gpu.py --np "$np" --model transformer --batch-size 8 --iters 6 --no-comm --fp16-allreduce
      ;;
    small)
      for i in 1 2; do run 90 bench/allreduce_gpu.py --np "$np"; done
      ;;
    compile)
      run 240 bench/train_gpu.py --np "$np" --model resnet50 --batch-size 64 --iters 5 --compile
      ;;
    backend)
      run 240 bench/torch_distributed.py --np "$np" --device cuda --model resnet50 --rounds 3 \
        --fsdp2-layers 24 --fsdp2-width 1024 --fsdp2-tokens 4096
      ;;
    profile)
      run 150 bench/profile_gpu.py --np "$np" --batch-size 32
      run 150 bench/profile_gpu.py --np "$np" --batch-size 64
      ;;
    observe)
      run 280 bench/observe_overhead.py --what stragglers --np "$np" --model resnet50 --rounds 3
      ;;
    *) echo "unknown table set: $what" >&2; exit 2 ;;
  esac
done
echo "done in $((SECONDS - T0)) s; logs in $out"
