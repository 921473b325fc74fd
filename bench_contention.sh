#!/usr/bin/env bash
# bench_contention.sh: CPU runs with OpenMP's spinning wait against passive waiting, alone and
# beside a competing CPU load (BENCH.md, "Sharing the CPU"). Two threads per run, as on 2 cores.
#
#   bash bench_contention.sh [BUSY]     # BUSY: competing busy processes (default 2)
#   QUICKSTART=1 bash bench_contention.sh    # also the quick start's first run (below)
#
# Rows: 10 toy-CLIP pretraining steps (toyworld.pretrain, the start of the quick start) and 20 DeAR
# training steps on the toy CLIP's shapes (train.train_step through bench.py's dear_step, 12
# classes, batch 32). Each row prints wall and CPU seconds of the work (imports excluded) and a hash
# of the weights (pretraining) or of the last gradients (training): it must not depend on the
# policy. With QUICKSTART=1, a third row: the README's quick start as a new user runs it the first
# time (`python dear.py --dataset toyworld`, threads as torch picks them, a fresh CLIP cache, data and
# run folder: toy pretraining, head roles, DeAR training, evaluation), whole-process wall and CPU,
# stopped after LIMIT seconds (default 900), and its base / novel / HM. "spin": OMP_WAIT_POLICY unset (OpenMP's default, spinning before it sleeps; the project's
# behaviour before it set a default); "passive": OMP_WAIT_POLICY=PASSIVE, the project's default now.
set -euo pipefail
cd "$(dirname "$0")"
BUSY="${1:-2}"
PYTHON="${PYTHON:-python}"

ROW_PY='
import hashlib, sys, time
t0, c0 = time.time(), time.process_time()
import torch
what = sys.argv[1]
torch.set_num_threads(2)
if what == "pretrain":
    import toyworld
    t0, c0 = time.time(), time.process_time()   # the work only, not the imports
    model, _ = toyworld.pretrain(steps=10, log=None)
    params = list(model.parameters())
else:
    import bench, toyworld
    from types import SimpleNamespace
    args = SimpleNamespace(device="cpu", precision="fp32", no_naive=True, no_breakdown=True)
    b = bench.Bench(args)
    sizes = dict(toyworld.TOY_CONFIG)
    model, net, opt, scaler = bench.build(b, sizes, 3)
    names = bench.classnames(12)
    net.set_classes(names, bench.TEMPLATE)
    g = torch.Generator().manual_seed(0)
    imgs = torch.randn(32, 3, 32, 32, generator=g)
    labels = torch.arange(32) % 12
    net.train()
    t0, c0 = time.time(), time.process_time()
    with bench.train.frozen_weights_in(b.dtype, model):
        for _ in range(20):
            bench.dear_step(net, opt, scaler, imgs, labels, b.dtype)
    params = [p.grad for p in net.parameters() if p.grad is not None]   # lr 0 (bench.build)
h = hashlib.sha256(b"".join(p.detach().contiguous().numpy().tobytes() for p in params))
h = h.hexdigest()[:12]
print(f"{time.time() - t0:.1f} s wall, {time.process_time() - c0:.1f} s CPU, weights {h}")
'

# The quick start in a fresh folder: wall and CPU of the whole process (imports included).
QUICKSTART_PY='
import json, os, resource, subprocess, sys, tempfile, time
limit = float(sys.argv[1])
with tempfile.TemporaryDirectory() as tmp:
    env = dict(os.environ, CLIP_CACHE=os.path.join(tmp, "cache"))
    cmd = [sys.executable, "dear.py", "--dataset", "toyworld", "--root", os.path.join(tmp, "data"),
           "--out", os.path.join(tmp, "runs")]
    t0 = time.time()
    try:
        subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=limit, check=True)
        (res,) = [os.path.join(d, "results.json") for d, _, f in os.walk(tmp) if "results.json" in f]
        r = json.load(open(res))
        got = " / ".join("%.2f" % a for a in [e["accuracy"] for e in r["evals"]] + [r["hm"]])
    except subprocess.TimeoutExpired:
        got = f"stopped after {limit:.0f} s"
    wall = time.time() - t0
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"{wall:.1f} s wall, {ru.ru_utime + ru.ru_stime:.1f} s CPU, base / novel / HM {got}")
'

busy_pids=()
start_busy() {
    for ((i = 0; i < $1; i++)); do "$PYTHON" -c "while True: pass" & busy_pids+=($!); done
}
stop_busy() { for p in "${busy_pids[@]}"; do kill "$p"; done; busy_pids=(); }
trap 'stop_busy 2>/dev/null || true' EXIT

for load in 0 "$BUSY"; do
    start_busy "$load"
    for what in pretrain train; do
        for policy in spin passive; do
            set -- env -u OMP_WAIT_POLICY OMP_NUM_THREADS=2
            [[ $policy == spin ]] || set -- "$@" OMP_WAIT_POLICY=PASSIVE
            r=$("$@" "$PYTHON" -c "$ROW_PY" "$what")
            echo "| $what | $load busy | $policy | $r |"
        done
    done
    if [[ -n ${QUICKSTART:-} ]]; then
        for policy in spin passive; do
            set -- env -u OMP_WAIT_POLICY -u OMP_NUM_THREADS
            [[ $policy == spin ]] || set -- "$@" OMP_WAIT_POLICY=PASSIVE
            r=$("$@" "$PYTHON" -c "$QUICKSTART_PY" "${LIMIT:-900}")
            echo "| quick start | $load busy | $policy | $r |"
        done
    fi
    stop_busy
done
