#!/usr/bin/env bash
# The per-machine figures of issues 22 and 28 (BENCHMARKS.md asks for them on each machine kind at hand),
# in one run: cost curves f(n)/f(1) per GGUF type on the blocks and on llama.cpp, the summary table on the
# blocks (t = 0 and 1) and on the llamacpp backend, plain decoding of the 1B files (and of a
# Qwen3-0.6B-shaped one) against llama.cpp's own, Gemma 3 270M (Q4_K_M, from the `test` extra's package) on
# the blocks against llama.cpp, and draft-model speculative decoding against llama-speculative-simple. About 45 minutes on 2 cores; run it on a quiet machine (nothing else running),
# then copy each figure into BENCHMARKS.md with its command, which each log starts with, and the CPU,
# which OUT/lscpu.txt holds.
#
#     bash benchmarks/machine_figures.sh /tmp/figures            # all of it
#     bash benchmarks/machine_figures.sh /tmp/figures curves     # only the steps whose names contain "curves"
#
# On an AVX-512 machine, the AVX2 code of the project's kernels, of llama.cpp (the backend and the baselines'
# tools) and of torch, with the AVX-512 machine's caches and memory (a proxy for an
# AVX2-only machine, not one):
#
#     SPECSAMPLE_KERNEL_ISA=avx2 SPECSAMPLE_LLAMACPP_VARIANT=haswell ATEN_CPU_CAPABILITY=avx2 bash benchmarks/machine_figures.sh /tmp/figures-avx2
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash benchmarks/machine_figures.sh OUT [STEP-FILTER]}
only=${2:-}
mkdir -p "$out"
. .venv/bin/activate

formats=/tmp/formats
big=/tmp/specsample-1b
qwen3=/tmp/specsample-qwen3
bundled=$(python -c "from specsample.models.loading import bundled_gguf; print(bundled_gguf())")
gemma3=$(python -m specsample.models.packaged)
held_out=(--split odd --skip 6)

# One step: its command, then its output, in OUT/NAME.log; skipped unless NAME contains the filter.
step() {
  local name=$1
  shift
  [[ -z "$only" || "$name" == *"$only"* ]] || return 0
  echo "$(date -u +%H:%M:%S) $name"
  { echo "\$ $*"; "$@"; } >"$out/$name.log" 2>&1 || echo "  failed: see $out/$name.log"
}

{ lscpu; echo; date -u; git log --oneline -1; env | grep -E '^(SPECSAMPLE_|ATEN_CPU_CAPABILITY)' || true; } >"$out/lscpu.txt"
[[ -f "$formats/SmolLM2-135M-Instruct.Q8_0.gguf" ]] || python benchmarks/format_copies.py --out "$formats"
[[ -f "$big/random-1b-Q8_0.gguf" ]] || python benchmarks/make_random_llama_gguf.py --out "$big"
[[ -f "$qwen3/random-qwen3-0.6b-Q8_0.gguf" ]] || python benchmarks/make_random_llama_gguf.py --shape qwen3-0.6b --out "$qwen3"
python -c "from specsample.bench.llamacpp_baselines import tool_path; tool_path('llama-lookup')" 2>/dev/null \
  || bash scripts/build_llamacpp_tools.sh
python -c "from specsample.bench.llamacpp_baselines import tool_path; tool_path('llama-lookup', invariant=True)" 2>/dev/null \
  || PATCHED=1 bash scripts/build_llamacpp_tools.sh

step curves-bundled-Q4_1 specsample bench cost-curve --model "$bundled" --backends gguf,llamacpp --repeats 11
for type in Q4_0 Q8_0 Q4_K_M; do
  step "curves-bundled-$type" specsample bench cost-curve --model "$formats/SmolLM2-135M-Instruct.$type.gguf" \
    --backends gguf,llamacpp --max-n 8 --repeats 11
done
for type in Q4_0 Q8_0; do
  step "curves-1b-$type" specsample bench cost-curve --model "$big/random-1b-$type.gguf" --backends gguf,llamacpp \
    --max-n 8 --repeats 7
  step "curves-qwen3-$type" specsample bench cost-curve --model "$qwen3/random-qwen3-0.6b-$type.gguf" \
    --backends gguf,llamacpp --max-n 8 --repeats 7
done

step curves-gemma3 specsample bench cost-curve --model "$gemma3" --backends gguf,llamacpp --max-n 8 --repeats 11
step summary-gemma3-gguf-t0 specsample bench run --config benchmarks/summary.toml --model "$gemma3" --backend gguf \
  --llamacpp-baselines --no-baselines "${held_out[@]}" --limit 2 --out "$out/summary-gemma3-gguf-t0"

step summary-gguf-t0 specsample bench run --config benchmarks/summary.toml --backend gguf --llamacpp-baselines \
  "${held_out[@]}" --limit 3 --out "$out/summary-gguf-t0"
step summary-gguf-t1 specsample bench run --config benchmarks/summary.toml --backend gguf --llamacpp-baselines \
  "${held_out[@]}" --limit 3 --temperature 1 --out "$out/summary-gguf-t1"
step summary-llamacpp-t0 specsample bench run --config benchmarks/summary.toml --backend llamacpp --llamacpp-baselines \
  "${held_out[@]}" --limit 3 --no-baselines --out "$out/summary-llamacpp-t0"

for backend in llamacpp gguf; do
  for type in Q4_0 Q8_0; do
    step "plain-1b-$type-$backend" specsample bench run --config name=plain-again,drafter=none,k=0 \
      --model "$big/random-1b-$type.gguf" --backend "$backend" --llamacpp-baselines --no-baselines \
      "${held_out[@]}" --limit 1 --max-new-tokens 64 --out "$out/plain-1b-$type-$backend"
  done
  step "plain-qwen3-Q4_0-$backend" specsample bench run --config name=plain-again,drafter=none,k=0 \
    --model "$qwen3/random-qwen3-0.6b-Q4_0.gguf" --backend "$backend" --llamacpp-baselines --no-baselines \
    "${held_out[@]}" --limit 1 --max-new-tokens 64 --out "$out/plain-qwen3-Q4_0-$backend"
done

step draft-model-llamacpp specsample bench run --config benchmarks/draft_model_llamacpp.toml \
  --model "$formats/SmolLM2-135M-Instruct.Q8_0.gguf" --backend llamacpp --llamacpp-baselines "${held_out[@]}" \
  --limit 2 --no-baselines --out "$out/draft-model-llamacpp"
echo "$(date -u +%H:%M:%S) done: $out"
