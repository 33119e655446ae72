#!/usr/bin/env bash
# The GPU check, in two halves (docs/gpu.md).
#
#   tools/gpu_check.sh wheels   here, with network: the cp312 wheels a bare GPU machine lacks
#                               (megatron-core, pydantic) into .whl/, and their total size
#   tools/gpu_check.sh device   there, in the checkout with .whl/ beside it: install them,
#                               `megatron-gspo preflight --size h200 --json`, then `pytest -m gpu`;
#                               results under $OUT (default ./gpu-check), a summary last
#
# Made for the lent H200 (Python 3.12 with torch, transformers, sentencepiece, safetensors,
# click, PyYAML, matplotlib, tensorboard, httpx, psutil, tqdm, numpy and pytest installed, no
# network), inside 8 minutes. On a machine without CUDA the device half runs as far as it can:
# preflight at --size tiny and the GPU tier's skips, each saying why (the dry run).
#
# PYTHON picks the interpreter (default python3); MCORE the megatron-core version of the
# wheels (default 0.19.2).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
MCORE=${MCORE:-0.19.2}

wheels() {
  rm -rf .whl && mkdir -p .whl
  local platforms=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
  done
  # --no-deps: each one the machine lacks is named; the rest (numpy, packaging, typing
  # extensions) are already there.
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl \
    "megatron-core==$MCORE" "pydantic>=2.7,<3" pydantic-core annotated-types typing-inspection \
    "typing-extensions>=4.16"
  # pydantic pins the pydantic-core it was built against: keep that one.
  local want
  want=$(unzip -p .whl/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
  if [ -n "$want" ] && ! ls .whl/pydantic_core-"$want"-* >/dev/null 2>&1; then
    rm -f .whl/pydantic_core-*
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp "${platforms[@]}" -d .whl "pydantic-core==$want"
  fi
  ls -l .whl
  local tree wheels_mb
  wheels_mb=$(du -sm .whl | cut -f1)
  tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  echo "wheels: ${wheels_mb} MiB; with the tracked tree: $(( wheels_mb + tree / 1048576 )) MiB (limit 64)"
}

device() {
  OUT=${OUT:-gpu-check}
  mkdir -p "$OUT"
  export PYTHONUNBUFFERED=1
  local site=/tmp/gspo-site
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  "$PYTHON" - <<'PY' | tee "$OUT/versions.txt"
import importlib.metadata as m, sys, torch
names = ["torch", "megatron-core", "pydantic", "transformers", "transformer-engine", "vllm"]
def v(n):
    try:
        return m.version(n)
    except m.PackageNotFoundError:
        return "absent"
print("python", sys.version.split()[0], "|", ", ".join(f"{n} {v(n)}" for n in names))
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PY
  local size=h200
  if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    size=tiny
    echo "no CUDA here: preflight at --size tiny (a dry run of this half)" | tee -a "$OUT/versions.txt"
  fi
  local rc_pre=0 rc_gpu=0
  timeout 300 "$PYTHON" -m megatron_gspo preflight --size "$size" --json "$OUT/preflight.json" \
    > "$OUT/preflight.txt" 2>&1 || rc_pre=$?
  tail -40 "$OUT/preflight.txt"
  timeout 230 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -rs \
    --junitxml "$OUT/gpu-tier.xml" tests/test_gpu.py > "$OUT/gpu-tier.txt" 2>&1 || rc_gpu=$?
  tail -60 "$OUT/gpu-tier.txt"
  echo
  echo "== summary =="
  grep -h "^preflight:" "$OUT/preflight.txt" || echo "preflight: no summary line (exit $rc_pre)"
  echo "preflight exit $rc_pre; gpu tier exit $rc_gpu: $(tail -1 "$OUT/gpu-tier.txt")"
}

case "${1:-}" in
  wheels) wheels ;;
  device) device ;;
  *) echo "usage: $0 wheels|device" >&2; exit 2 ;;
esac
