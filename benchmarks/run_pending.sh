#!/usr/bin/env bash
# Runs named items of benchmarks/GPU_PENDING.md on the lent GPU, each under its own time limit, so
# that one item running over loses only itself. Usage (one device `run`, carry [".whl"]):
#     bash benchmarks/run_pending.sh N:150 sana_video:90 V1:150
# Each ITEM:SECONDS runs ITEM's command under `timeout SECONDS`; its stdout+stderr go to
# $OUT/ITEM.log and any JSON it writes to $OUT/ITEM.json. The wheels are installed once (diffusers,
# accelerate, torchao, FlashInfer's) into /tmp/site (each carried folder once a machine). On a fresh checkout, fill .whl first (here):
#     pip download -q --no-deps -d .whl/diff diffusers==0.42.1 accelerate==1.16.0
#     pip download -q --no-deps -d .whl/tao --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 torchao==0.17.0
#     bash scripts/gpu_backends/prepare_fp8_flashinfer.sh        # .whl/fi (item K only)
#     bash scripts/gpu_backends/prepare_fp8_fa3.sh               # scratch/fa3_fp8 (items K3, K4, A8*, A9: carry it too)
#     pip download -q --no-deps -d .whl/cfe --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 nvidia-cudnn-frontend==1.18.0   # backend fp8_cudnn (item A9)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
for d in .whl/diff .whl/tao .whl/fi .whl/cfe; do  # each carried folder once a machine (a later call may carry more)
    if [ -d "$d" ] && [ ! -e "/tmp/site/.done-${d##*/}" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$d"/*.whl \
            && touch "/tmp/site/.done-${d##*/}"
    fi
done
export PYTHONPATH=/tmp/site:$PWD
if [ -e scratch/fa3_fp8/_vllm_fa3_C.abi3.so.xz ]; then  # backend fp8_fa3 (carry scratch/fa3_fp8)
    bash scripts/gpu_backends/fp8_fa3.sh && export USP_DIT_FA3_FP8_LIB=/tmp/fa3_fp8/_vllm_fa3_C.abi3.so
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

cmd_for() {  # ITEM -> its command line (the command each GPU_PENDING.md item names)
    local j="$OUT/$1.json"
    case "$1" in
        N) echo "python3 -m pytest -q --noconftest tests/gpu/test_lse_grad_gpu.py && python3 benchmarks/bench_lse_grad.py" ;;
        compgpu) echo "python3 -m pytest -q -s --noconftest tests/gpu/test_memory_composition_gpu.py" ;;
        sana_video) echo "python3 benchmarks/bench_pipelines.py --model sana_video --warmup 2 --iters 2 --rounds 3 --json $j" ;;
        hostbound) echo "python3 benchmarks/bench_pipelines.py --model pixart,dit,dreamlite,ovis_image --warmup 2 --iters 3 --rounds 5 --json $j" ;;
        dit_host) echo "python3 benchmarks/profile_host.py --model dit" ;;
        ditdiag) echo "python3 benchmarks/diag_host_gap.py --model dit; python3 benchmarks/check_syncs.py --model dit" ;;
        k6sr) echo "python3 benchmarks/bench_pipelines.py --model kandinsky6_sr --warmup 2 --iters 2 --rounds 3 --json $j" ;;
        k5nabla) echo "python3 benchmarks/bench_pipelines.py --model kandinsky5_nabla --warmup 1 --iters 1 --rounds 2 --json $j" ;;
        k5pro) echo "python3 benchmarks/bench_pipelines.py --model kandinsky5_nabla_pro --warmup 1 --iters 1 --rounds 1 --json $j" ;;
        wa2) echo "python3 benchmarks/bench_pipelines.py --model wan_animate2 --warmup 1 --iters 1 --rounds 2 --json $j" ;;
        V1) echo "python3 benchmarks/bench_vae.py --model ltx2,sana_wm_ltx2,qwen_image21,hunyuan_image,hunyuan_image_refiner,sana_dcae --parts 2,4,8 --warmup 1 --rounds 3 --json $j" ;;
        V2) echo "python3 benchmarks/bench_vae.py --model wan22 --parts 2,4,8 --warmup 1 --rounds 1 --json $j" ;;
        V4a) echo "python3 benchmarks/bench_vae.py --model hunyuan_video15_480p --parts 2,4,8 --warmup 1 --rounds 1 --json $j" ;;
        V4b) echo "python3 benchmarks/bench_vae.py --model hunyuan_video15 --parts 2 --skip-stock --warmup 1 --rounds 1 --json $j" ;;
        V6) echo "python3 benchmarks/bench_vae.py --vae minimax_h3 --parts 2,4,8 --warmup 1 --rounds 2 --json $j" ;;
        V7) echo "python3 benchmarks/bench_vae.py --model allegro --parts 2,4,8 --warmup 0 --rounds 1 --json $j" ;;
        V8) echo "python3 benchmarks/bench_vae.py --model kandinsky6_sr --parts 2,4,8 --warmup 1 --rounds 1 --json $j" ;;
        V5) echo "python3 benchmarks/bench_vae.py --model cosmos1,easyanimate --parts 2,4,8 --warmup 1 --rounds 1 --json $j" ;;
        vaepeaks) echo "python3 benchmarks/bench_vae.py --vae sd,cogview4,hunyuan_image,sana,qwen_image21,wan22,ltx2,minimax_h3,oobleck,oobleck_48k,same,longcat_audio,music3_vocoder --json $j" ;;
        K) echo "python3 benchmarks/bench_fp8_step.py --model hunyuan_video --compile --warmup 1 --rounds 2" ;;
        K2) echo "python3 benchmarks/bench_fp8_step.py --model hunyuan_video --compile --recipe-only --warmup 1 --rounds 1 --json $j" ;;
        K3) echo "python3 benchmarks/bench_fp8_step.py --model wan --compile --recipe-only --backend fp8_fa3 --warmup 1 --rounds 2 --json $j" ;;
        K4) echo "python3 benchmarks/bench_fp8_step.py --model hunyuan_video --compile --recipe-only --backend fp8_fa3 --warmup 1 --rounds 1 --json $j" ;;
        K5) echo "python3 -m pytest -q --noconftest tests/gpu/test_fp8_attention_gpu.py -k 'finite_at or compiled_equals'; python3 benchmarks/diag_fp8_nonfinite.py --model hunyuan_video --backend fp8_fa3 --json $j" ;;
        K5c) echo "python3 benchmarks/diag_fp8_nonfinite.py --model hunyuan_video --backend fp8_fa3 --compile --json $j" ;;
        A8) echo "python3 -m pytest -q --noconftest tests/gpu/test_fp8_attention_gpu.py -k fa3 && python3 benchmarks/bench_attention.py --suite backends --shapes wan,hunyuan_video,flux --backends sdpa_cudnn,fa3_varlen,fp8_fa3,fp8_fa3_kernel --out $j" ;;
        A9) echo "python3 benchmarks/bench_attention.py --suite backends --shapes wan,hunyuan_video,flux --backends sdpa_cudnn,fa3_varlen,fp8_fa3_kernel,fp8_cudnn,fp8_cudnn_kernel --out $j; python3 -m pytest -q -s --noconftest tests/gpu/test_fp8_attention_gpu.py -k cudnn" ;;
        A9len) echo "python3 benchmarks/diag_fp8_length.py --backends fp8_cudnn,fp8_fa3,fp8_flashinfer --json $j" ;;
        A8ring) echo "python3 benchmarks/bench_attention.py --suite ring --shapes flux,hunyuan_video --backend fp8_fa3 --out $j" ;;
        *) return 1 ;;
    esac
}

for spec in "$@"; do
    item=${spec%%:*}; limit=${spec#*:}
    cmd=$(cmd_for "$item") || { echo "unknown item $item" >&2; continue; }
    echo "=== $item (limit ${limit}s): $cmd"
    start=$(date +%s)
    timeout "$limit" bash -c "$cmd" >"$OUT/$item.log" 2>&1
    rc=$?
    echo "=== $item rc=$rc in $(( $(date +%s) - start ))s"
    tail -n 25 "$OUT/$item.log"
done
