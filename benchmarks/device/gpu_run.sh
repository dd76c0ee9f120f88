#!/bin/bash
# gpu_check on a lent GPU machine (the device tool's `run`), from the repository's root:
#
#     bash benchmarks/device/gpu_run.sh PARTS [SECONDS]
#
# That machine has torch, triton and transformers but not msgspec, pyzmq or gguf, and no
# network: their wheels (Python 3.12) come in .gpu/wheels. The package is staged as the wheel
# lays it out (kvscope/engine, ...), as `make stage` does, with benchmarks/ beside it (it is not
# installed: `python -m benchmarks.device.gpu_check` from the stage's root). The embedded GGUF (98 MB) is larger
# than one call may carry (64 MiB), so it comes in parts, .gpu/model_a and .gpu/model_b, over
# two calls to the same warm machine; each call keeps what it brought in /tmp/kvscope-gguf, and
# the GGUF is used once every part is there and its sha256 matches .gpu/wheels/gguf.sha256.
# Without it the e2e and device parts run on a tiny random Llama instead (said in the log).
# Results: $OUT/gpu_check.json and $OUT/gpu_check.log, written as the run goes.
set -u
PARTS=${1:-kernels,decode}
LIMIT=${2:-540}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT" /tmp/kvscope-gguf
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/wheels/*.whl >"$OUT/pip.log" 2>&1 || echo "pip failed (see pip.log)"
rm -rf /tmp/kvscope-stage && mkdir -p /tmp/kvscope-stage
cp -r kvscope /tmp/kvscope-stage/kvscope
for d in engine kernels ipc app kvmath; do cp -r "$d" "/tmp/kvscope-stage/kvscope/$d"; done
cp -r benchmarks /tmp/kvscope-stage/benchmarks
export PYTHONPATH=/tmp/kvscope-stage:/tmp/site

cp .gpu/model_*/*.part* /tmp/kvscope-gguf/ 2>/dev/null
GGUF=/tmp/kvscope-gguf/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$GGUF" ] && [ -f "$GGUF.part00" ] && [ -f "$GGUF.part01" ]; then
    cat "$GGUF.part00" "$GGUF.part01" >"$GGUF.tmp"
    if [ "$(sha256sum "$GGUF.tmp" | cut -d' ' -f1)" = "$(cat .gpu/wheels/gguf.sha256)" ]; then
        mv "$GGUF.tmp" "$GGUF"
    else
        echo "GGUF parts do not match their sha256" | tee -a "$OUT/gpu_check.log"
    fi
fi
MODEL=$GGUF
if [ ! -f "$GGUF" ]; then
    MODEL=/tmp/kvscope-tiny-llama
    echo "model: the GGUF parts are not all here ($(ls /tmp/kvscope-gguf | tr '\n' ' '));" \
        "e2e and device run on a tiny random llama" | tee -a "$OUT/gpu_check.log"
    (cd /tmp/kvscope-stage && python3 -c "from pathlib import Path; from \
kvscope.testing.tiny_models import save_tiny_model; save_tiny_model(Path('$MODEL'), 'llama', \
seed=3, vocab_size=256)" >>"$OUT/gpu_check.log" 2>&1)
fi

{ nvidia-smi; python3 -c "import torch, triton, transformers; print('torch', \
torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } \
    >>"$OUT/gpu_check.log" 2>&1
# From the staged tree: run at the checkout's root, `python -m` would import its kvscope/ folder,
# which holds no subpackages (they are the root's folders, mapped only by an install).
(cd /tmp/kvscope-stage && timeout "$LIMIT" python3 -m benchmarks.device.gpu_check \
    --parts "$PARTS" --out "$OUT" --model "$MODEL" 2>&1 | grep -v -e 'it/s\]' -e '^Loading weights'
    echo "gpu_check exit: ${PIPESTATUS[0]}")
