#!/usr/bin/env bash
# Wheels for `python3 -m benchmarks gpu-check` on a GPU machine without network, into .whl-gpu/ (git-ignored, carried
# to the machine; the check's env step installs them offline into its work folder's site/, first on PYTHONPATH):
#   benchmarks/gpu_wheels.sh          torchacco's needs the machine lacks (torchdata)
#   benchmarks/gpu_wheels.sh titan    also torchtitan 0.2.2 (0.3.0 does not import with torch 2.11), the needs of it
#                                     the machine lacks, and its test assets: the tokenizer from its git tag (without
#                                     GitHub from TITAN_GIT, a torchtitan git directory), c4_test as a word salad
# The machine must already have: Python $PYVER with a CUDA build of torch >= 2.9 (far over what can be carried),
# tokenizers, safetensors, tensorboard, pytest and setuptools (torchacco's offline editable install), and for
# torchtitan triton, einops, pyarrow, pandas, fsspec, huggingface-hub, httpx, xxhash and pillow. The env step's probe
# lists what is missing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/.whl-gpu"
PYVER="${PYVER:-3.12}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
WHEELS=("torchdata==0.11.0")
if [ "${1:-}" = "titan" ]; then
  # datasets' own pins for dill and multiprocess (one version of each, or the offline install stops); no tomli on 3.12
  WHEELS+=("torchtitan==0.2.2" "datasets==4.7.0" "dill==0.4.0" "multiprocess==0.70.18" "tyro==1.0.16"
           "docstring-parser" "typeguard" "shtab")
elif [ -n "${1:-}" ]; then
  echo "torchacco: error: unknown argument '$1'; run with no argument or with 'titan'" >&2
  exit 2
fi
mkdir -p "$OUT"
for spec in "${WHEELS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$OUT" "$spec"
done
ASSETS="$OUT/titan/tests/assets"
if [ "${1:-}" = "titan" ]; then
  mkdir -p "$ASSETS/tokenizer" "$ASSETS/c4_test"
  if [ -s "$ASSETS/tokenizer/tokenizer.json" ]; then
    :  # fetched before
  elif git clone -q --depth 1 --branch v0.2.2 https://github.com/pytorch/torchtitan "$OUT/titan-src" 2>/dev/null; then
    cp -r "$OUT/titan-src/tests/assets/tokenizer" "$OUT/titan-src/tests/assets/c4_test" "$ASSETS/"
    rm -rf "$OUT/titan-src"
  elif [ -n "${TITAN_GIT:-}" ]; then
    for f in tokenizer.json tokenizer_config.json; do
      git --git-dir "$TITAN_GIT" show "HEAD:tests/assets/tokenizer/$f" >"$ASSETS/tokenizer/$f"
    done
  else
    echo "torchacco: error: GitHub is out of reach for torchtitan's test tokenizer; set TITAN_GIT to a torchtitan git directory" >&2
    exit 1
  fi
  # throughput does not depend on the text: a word salad in c4_test's JSON-lines shape
  [ -s "$ASSETS/c4_test/data.json" ] || "$PY" - "$ASSETS/c4_test/data.json" <<'PYEOF'
import json, random, sys
words = "the king and queen of a land far away went to see the sea with their horse dog cat bird".split()
rng = random.Random(0)
with open(sys.argv[1], "w") as f:
    for i in range(3000):
        f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(300))}) + "\n")
PYEOF
fi
size=$(du -sm "$OUT" | cut -f1)
ls "$OUT"
echo "$OUT: $size MiB (the device tool carries 64 MiB with the working tree)"
[ "$size" -lt 60 ] || { echo "torchacco: error: $OUT is $size MiB, too large to carry" >&2; exit 1; }
