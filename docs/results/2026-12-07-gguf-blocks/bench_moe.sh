#!/bin/bash
# Qwen3-30B-A3B's shape in Q4_0 (random weights, `specmoe models synth --like qwen3-30b-a3b
# --type Q4_0 --out FILE`): specmoe with the file's blocks against llama.cpp, one engine per
# fresh process (never both loaded), decode on decode.py's prompts, then Tt(1, T)/Tt(1, 1).
set -e
cd "$(dirname "$0")"
F=${1:?the synthesised .gguf file}
PY=${PY:-python}
export SPECMOE_KV_CACHE_SPACE=0.5
for r in "decode.py $F gguf" "peer_llama.py $F" "verify_cost.py $F ours" \
         "verify_cost.py $F llama.cpp"; do
  /usr/bin/time -f '{"max_rss_kb": %M}' $PY $r 2>&1 | grep -E '^\{' | tail -2
done
