#!/bin/bash
# The Qwen2.5-Coder pair's Q4_K_M files (`specmoe models install qwen2.5-coder`): specmoe
# with the files' blocks (plain, draft 0.5B, prompt lookup) and dequantised to float32,
# against llama.cpp (plain, prompt lookup), each run a fresh process, the order reversed
# in the second repetition (the float32 run, slow, in the first only); then Tt(1, T)/Tt(1, 1)
# of the target in both engines. One JSON line per run.
set -e
cd "$(dirname "$0")"
M=${SPECMOE_MODELS:-~/.cache/specmoe/models}
T=$M/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
D=$M/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
PY=${PY:-python}
export SPECMOE_KV_CACHE_SPACE=0.5
runs=("decode.py $T gguf" "peer_llama.py $T" "decode.py $T gguf $D 4" "peer_llama.py $T lookup"
      "decode.py $T gguf ngram 4" "decode.py $T none")
for rep in 1 2; do
  order=("${runs[@]}")
  if [ $rep = 2 ]; then order=(); for ((i=${#runs[@]}-1; i>=0; i--)); do order+=("${runs[$i]}"); done; fi
  for r in "${order[@]}"; do
    if [ $rep = 2 ] && [ "$r" = "decode.py $T none" ]; then continue; fi
    $PY $r 2>/dev/null | tail -1
  done
done
$PY verify_cost.py $T ours 2>/dev/null | tail -1
$PY verify_cost.py $T llama.cpp 2>/dev/null | tail -1
