#!/usr/bin/env bash
# The next GPU lease's measurements, one call per run of the device tool (each ends well inside
# its 10-minute limit): docs/benchmarks-log.md, "What the next GPU lease should run".
#
#   scripts/gpu_lease.sh 0   # the Pallas kernels checked against XLA's forms on the GPU, then
#                            # every open issue's headline figures (about 10 minutes): DLRM-DCNv2
#                            # (own optimizers and SGD), the MLPerf-v1 shape, criteo_kaggle and its
#                            # dynamic step (prefixes, the default, and one path), the fused update's row kernel
#                            # capped (the default) and not, and the cross layers by the kernel
#                            # (DLRM-DCNv2), and criteo_kaggle's
#                            # binary feed against synthetic batches (pinned buffers, then pageable)
#   scripts/gpu_lease.sh 1   # the sparse update's variants: DLRM-DCNv2 (own optimizers, SGD),
#                            # the MLPerf-v1 shape, criteo_kaggle; fused_programs_all, the dot
#                            # interaction's pairs by the kernels (criteo_kaggle, MLPerf-v1), the
#                            # cross layers by the kernel (DLRM-DCNv2),
#                            # fused_again (two processes' bits)
#   scripts/gpu_lease.sh 2   # dynamic tables: the step as is (prefixes) beside the vocabulary step,
#                            # one path (no switch among prefix sizes), and the branches with loops
#                            # and switches in CUDA graphs
#   scripts/gpu_lease.sh 3   # the feed: binary against synthetic, pageable buffers against the
#                            # default's pinned ones, 2 readers, reader processes, a GIL
#                            # switch interval of 0.25 ms
#
# Arguments after the call's number go to gpu_bench.py too (a try-out on CPU: --set
# train.batch_size=1024 --set data.max_rows=20000 --set mesh.devices=1).
#
# What comes back (at most 8 files, under $OUT): the call's log, each run's gpu_bench.json, the
# end-to-end runs' loop traces (train.trace_steps, Perfetto's format) and the optimized HLO of
# each step it timed (gzipped).
set -o pipefail
call=${1:?which call: 0, 1, 2 or 3}
out=${OUT:-/tmp/gpu_lease_out}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
cd "$(dirname "$0")/.."
status=0

# bench RUN ARGS...: one gpu_bench.py run of this call, its JSON as callN-RUN.json
bench() {
    local run=$1 work=/tmp/gpu_lease_$call-$1
    shift
    mkdir -p "$work"
    # (the JSON written straight into $out, again after each config: a call cut short keeps it)
    python scripts/gpu_bench.py --out "$work" --json "$out/call$call-$run.json" "$@" "${extra[@]}" 2>&1 \
        | tee -a "$out/call$call.log" || status=1
    rm -f "$out/call$call-$run.json.part"
    works+=("$work")
}

extra=("${@:2}")
works=()
case $call in
0) # the Pallas kernels against XLA's forms as the GPU compiles them (a timing of a wrong kernel
   # means nothing; about a minute), then every issue's headline (the defaults, then the feed),
   # the levers after: a call cut short by the device tool's limit loses the levers, not the headlines
   timeout 180 python scripts/gpu_check_kernels.py --json "$out/call0-kernels.json" 2>&1 \
       | tee -a "$out/call0.log" || status=1
   bench configs --only configs --configs mlperf_dcnv2_capped,mlperf_dcnv2_capped_sgd,mlperf_v1_capped,criteo_kaggle,criteo_kaggle_dynamic \
       --variants default --train-configs "" --steps 10 --determinism-steps 0
   bench feed --only feed --feed-configs criteo_kaggle --set data.max_rows=500000 \
       --feed-variants "data.host_memory=pageable" --train-steps 300
   bench variants --only configs --configs "" --baseline "$out/call0-configs.json" \
       --variants fused_programs_all:mlperf_dcnv2_capped,cross_fused:mlperf_dcnv2_capped,one_path:criteo_kaggle_dynamic \
       --train-configs "" --steps 10 --determinism-steps 0 ;;
1) bench configs --only configs --configs mlperf_dcnv2_capped,mlperf_dcnv2_capped_sgd,mlperf_v1_capped,criteo_kaggle \
       --variants default,fused_programs_all,pairs_fused:criteo_kaggle+mlperf_v1_capped,cross_fused:mlperf_dcnv2_capped,fused_again \
       --variant-configs mlperf_dcnv2_capped,criteo_kaggle --train-configs "" --steps 20 ;;
2) bench configs --only configs --configs criteo_kaggle,criteo_kaggle_dynamic \
       --variants default,one_path:criteo_kaggle_dynamic,branches_device_control:criteo_kaggle_dynamic \
       --train-configs "" --steps 10 --determinism-steps 0 ;;
3) bench feed --only feed --feed-configs criteo_kaggle --set data.max_rows=500000 \
       --feed-variants "data.host_memory=pageable;data.readers=2;data.reader_processes=true;switch_interval_ms=0.25" \
       --train-steps 400 ;;
*) echo "call $call: 0, 1, 2 or 3" >&2; exit 2 ;;
esac
for work in "${works[@]}"; do
    for trace in "$work"/trace-*.json.gz; do  # the end-to-end runs' loop traces (ui.perfetto.dev)
        [ -e "$trace" ] || continue
        [ "$(ls "$out" | wc -l)" -ge 8 ] && break
        cp "$trace" "$out/"
    done
done
for work in "${works[@]}"; do
    for hlo in "$work"/*.hlo.txt; do  # the steps' programs, most telling first, up to the file limit
        [ -e "$hlo" ] || continue
        [ "$(ls "$out" | wc -l)" -ge 8 ] && break
        gzip -c "$hlo" > "$out/$(basename "$hlo").gz"
    done
done
exit $status
