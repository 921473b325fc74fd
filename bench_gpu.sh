#!/usr/bin/env bash
# The GPU checks in one command (a few minutes on one recent GPU; the timeouts below cap it under 8):
#   1. the CUDA-only tests (fp16 and bf16 training steps and evaluation against fp32 on a tiny CLIP);
#   2. bench.py at full ViT-B/16 shapes on the GPU: 10 x 4, 100 x 4 and 1000 classes x 32, training and
#      evaluation images/s, peak memory, in dear.py's default precision (--precision amp: fp16 autocast, a
#      GradScaler, the frozen weights stored in fp16); written to BENCH_GPU.md (BENCH.md keeps the CPU numbers).
# Needs torch >= 2.3 with CUDA, torchvision, numpy, pillow, regex and pytest. A machine without internet and
# without ftfy installs it from .whl/ (git ignores that folder); fill it where there is internet with
#   python -m pip download ftfy -d .whl       # brings its one dependency, wcwidth; both are pure Python
# Usage: bash bench_gpu.sh [extra bench.py flags, e.g. --precision bf16]
set -uo pipefail
cd "$(dirname "$0")"
if ! python -c "import ftfy" 2>/dev/null; then
    python -m pip install --no-index --find-links .whl ftfy \
        || { echo "ftfy is missing and .whl/ holds no wheel of it; see the top of bench_gpu.sh" >&2; exit 2; }
fi
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "no CUDA device visible to torch: bench_gpu.sh is for a GPU machine" >&2; exit 2; }
python -c "import torch; print('torch', torch.__version__, 'on', torch.cuda.get_device_name())"

tests=0
timeout 150 python -m pytest -q -m cuda tests/ -p no:cacheprovider || tests=$?
if [ "$tests" = 5 ]; then echo "warning: no test carries @pytest.mark.cuda" >&2; tests=0; fi

bench=0
timeout 270 python bench.py --device cuda --repeats 10 --out BENCH_GPU.md "$@" || bench=$?
echo "cuda tests: exit $tests; bench: exit $bench (BENCH_GPU.md)"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
