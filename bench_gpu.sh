#!/usr/bin/env bash
# The GPU checks in one command (minutes on one recent GPU; the timeouts below cap it under 8):
#   1. the CUDA-only tests (pytest -m cuda): fp16 and bf16 training steps and evaluation against
#      fp32 on a tiny CLIP, the host waits only at log lines, and fp16 masked attention at ViT-B/16
#      shapes through the fused SDPA kernels against the math kernel;
#   2. bench.py at full ViT-B/16 shapes on the GPU: 10 x 4, 100 x 4 and 1000 classes x 32, training
#      and evaluation images/s, peak memory, in dear.py's default precision (--precision amp: fp16
#      autocast, a GradScaler, the frozen weights stored in fp16); written to BENCH_GPU.md (BENCH.md
#      keeps the CPU numbers).
# Needs torch >= 2.3 with CUDA, torchvision, numpy, pillow, regex, ftfy and pytest. What is missing
# is installed from .whl/ (git ignores that folder) without internet: into the running Python, or,
# where that Python is externally managed (PEP 668) or read-only, into a venv .venv-gpu/ that sees
# the system's packages (its torch with CUDA included). Fill .whl/ where there is internet with the
# command printed for what is missing, e.g.
#   python -m pip download ftfy -d .whl       # brings its one dependency, wcwidth; both pure Python
# Usage: bash bench_gpu.sh [extra bench.py flags, e.g. --precision bf16]; PYTHON=... picks the
# interpreter.
set -uo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || PY=python

# import name:pip name of every package the checks need
NEEDS="torch:torch torchvision:torchvision numpy:numpy PIL:pillow regex:regex ftfy:ftfy"
NEEDS="$NEEDS pytest:pytest"

# the pip names of the packages $1 cannot import, space-separated (one interpreter start)
missing() {
    "$1" -c '
import importlib.util, sys
for pair in sys.argv[1:]:
    name, pip = pair.split(":")
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        print(" " + pip, end="")
' $NEEDS 2>/dev/null || echo " $NEEDS" | sed 's/ [^ :]*:/ /g'
}

# 0 if pip may install into $1's own site-packages (not externally managed, and writable)
can_install_into() {
    "$1" - <<'EOF'
import os, sys, sysconfig
in_venv = sys.prefix != sys.base_prefix
managed = os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
sys.exit(0 if (in_venv or not managed) and os.access(sysconfig.get_path("purelib"), os.W_OK) else 1)
EOF
}

need=$(missing "$PY")
if [ -n "$need" ]; then
    if ! can_install_into "$PY"; then
        echo "$PY is externally managed or read-only: installing into .venv-gpu/ instead" >&2
        [ -x .venv-gpu/bin/python ] || "$PY" -m venv --system-site-packages .venv-gpu \
            || { echo "cannot make a venv with $PY (Debian/Ubuntu: apt install python3-venv)" >&2
                 exit 2; }
        PY=.venv-gpu/bin/python
        need=$(missing "$PY")
    fi
    if [ -n "$need" ]; then
        # shellcheck disable=SC2086  # one word per package
        "$PY" -m pip install -q --no-index --find-links .whl $need 2>/dev/null
        need=$(missing "$PY")
    fi
    if [ -n "$need" ]; then
        echo "missing:$need (and .whl/ holds no wheel of them); where there is internet run" >&2
        echo "  python -m pip download$need -d .whl" >&2
        echo "then copy .whl/ here and run bash bench_gpu.sh again" \
             "(torch: the build for this machine's CUDA)" >&2
        exit 2
    fi
fi
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "no CUDA device visible to torch: bench_gpu.sh is for a GPU machine" >&2; exit 2; }
"$PY" -c "import torch; print('torch', torch.__version__, 'on', torch.cuda.get_device_name())"

tests=0
timeout 150 "$PY" -m pytest -q -m cuda tests/ -p no:cacheprovider || tests=$?
if [ "$tests" = 5 ]; then echo "warning: no test carries @pytest.mark.cuda" >&2; tests=0; fi

bench=0
timeout 270 "$PY" bench.py --device cuda --repeats 10 --out BENCH_GPU.md "$@" || bench=$?
echo "cuda tests: exit $tests; bench: exit $bench (BENCH_GPU.md)"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
