#!/usr/bin/env bash
# run_all.sh: reproduce every table of the DeAR paper with this code.
#
#   bash run_all.sh --root DATA                 # everything, seeds 1-3, one job after another
#   GPUS="0 1 2 3" bash run_all.sh --root DATA  # the same, four jobs at a time, one per GPU
#   bash run_all.sh --list --root DATA          # the job list only (for SLURM arrays / GNU parallel)
#   bash run_all.sh --smoke --out smoke        # the whole pipeline on the toy world, on the CPU
#   bash run_all.sh --toy --out toy            # every table in miniature on the toy world, 5 seeds, CPU
#
# Stages: roles -> b2n -> xd -> fewshot -> ablations -> tables (see --help). Every run is one call of
# dear.py and gets its own folder under --out; a run whose results.json exists is skipped, an
# interrupted one resumes from its checkpoint. Run `bash run_all.sh --help` for all options.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: bash run_all.sh [options] [-- extra dear.py flags]

Reproduces the paper's tables: runs dear.py for every table cell, then tables.py.

Stages (in this order):
  roles      head roles of the backbone (Concept Entropy, entropy.py), once per insertion layer J
  b2n        base-to-novel, 11 datasets x seeds; plus zero-shot CLIP per dataset
  xd         ImageNet source model (16 shots, all classes) evaluated on the 4 ImageNet variants and
             the other 10 datasets (domain generalisation + cross-dataset); plus zero-shot CLIP
  fewshot    1/2/4/8/16 shots on 11 datasets x seeds; plus zero-shot CLIP per dataset
  ablations  base-to-novel on dtd, eurosat, oxford_flowers: --mask generalization-only|none,
             --no-attr-tokens, --lambda-fusion 0, --J 7|11, --beta 0.5|0.7|0.9, --novel-logits cls,
             --roles-control random (Concept Entropy's roles shuffled among each block's heads)
  tables     python tables.py --out OUT  ->  OUT/tables/tables.md and CSV files

Options:
  --root DIR        datasets folder, CoOp layout (default: $DATA or ./data)
  --out DIR         output root: one folder per run, logs in OUT/logs (default: runs)
  --stages LIST     comma-separated stages to run (default: all)
  --skip LIST       comma-separated stages to leave out
  --seeds "1 2 3"   seeds (default: $SEEDS or "1 2 3")
  --backbone NAME   CLIP backbone (default: ViT-B/16)
  --list            print the job list, one full command line per line, and exit
  --check           only check the datasets the stages need: list each one, with the fix for each
                    missing one, and exit (a run checks first too, and stops with a summary)
  --no-check        do not check the datasets before starting
  --smoke           the same stages on the toy world (backbone "toy", 1 seed, tiny epochs, CPU)
  --toy             every table in miniature on the toy world: seeds 1-5, 1/2/4/8/16 shots, transfer
                    to the toy's shifted sets, every ablation plus random and oracle roles (CPU)
  -h, --help        this help

Environment:
  GPUS="0 1 2 3"    run one job per listed GPU at a time (CUDA_VISIBLE_DEVICES per job);
                    unset: one job after another, dear.py picks the device (--device auto)
  SEEDS, DATA       defaults of --seeds and --root
  PYTHON            the python to use (default: python)
  DEAR_PY           the dear.py script to call (default: dear.py next to this script)

Finished runs are skipped ("skip (done)"); interrupted runs resume (--resume is always passed);
failed runs are listed at the end with their logs, and the script exits 1. Rerunning the same
command is always safe.
EOF
}

die() { echo "run_all.sh: $*" >&2; exit 2; }

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
DEAR_PY="${DEAR_PY:-$HERE/dear.py}"
ROOT="${DATA:-data}"
OUT="runs"
SEEDS="${SEEDS:-1 2 3}"
BACKBONE="ViT-B/16"
ALL_STAGES="roles,b2n,xd,fewshot,ablations,tables"
STAGES="$ALL_STAGES"
SKIP=""
MODE="run"        # run | list | check
CHECK=1
SMOKE=0
TOY=0
SEEDS_SET=0
ROOT_SET=0
EXTRA=()          # flags after "--", passed to every dear.py call

while [[ $# -gt 0 ]]; do
    case "$1" in
        --root) ROOT="${2:?--root needs a folder}"; ROOT_SET=1; shift 2 ;;
        --out) OUT="${2:?--out needs a folder}"; shift 2 ;;
        --stages) STAGES="${2:?--stages needs a list}"; shift 2 ;;
        --skip) SKIP="${2:?--skip needs a list}"; shift 2 ;;
        --seeds) SEEDS="${2:?--seeds needs a list}"; SEEDS_SET=1; shift 2 ;;
        --backbone) BACKBONE="${2:?--backbone needs a name}"; shift 2 ;;
        --list) MODE="list"; shift ;;
        --check) MODE="check"; shift ;;
        --no-check) CHECK=0; shift ;;
        --smoke) SMOKE=1; shift ;;
        --toy) TOY=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) die "unknown option '$1' (see bash run_all.sh --help)" ;;
    esac
done

for s in ${STAGES//,/ } ${SKIP//,/ }; do
    [[ ",$ALL_STAGES," == *",$s,"* ]] || die "unknown stage '$s'; stages are $ALL_STAGES"
done
want() { [[ ",$STAGES," == *",$1,"* && ",$SKIP," != *",$1,"* ]]; }

# ------------------------------------------------------------------------------------------------
# What to run. The full reproduction, or (--smoke) the same stages on the toy world.

B2N_DATASETS=(imagenet caltech101 oxford_pets stanford_cars oxford_flowers food101 fgvc_aircraft sun397 dtd eurosat ucf101)
DG_TARGETS=(imagenetv2 imagenet_sketch imagenet_a imagenet_r)
XD_SOURCE=imagenet
SHOTS_LIST=(1 2 4 8 16)
ABLATION_DATASETS=(dtd eurosat oxford_flowers)   # small and quick, and they span textures, satellite, fine-grained
# Each ablation is one set of dear.py flags. J = 9 is the full model's default (its row is the b2n run);
# a flag that dear.py resolves to the default run's folder (DTD's beta is 0.9) is run only once.
ABLATIONS=("--mask generalization-only" "--mask none" "--no-attr-tokens" "--lambda-fusion 0"
           "--J 7" "--J 11" "--beta 0.5" "--beta 0.7" "--beta 0.9" "--novel-logits cls" "--roles-control random")
COMMON=()          # flags for every dear.py call
XD_TARGETS=""      # xd targets ("": dear.py's default, the 4 variants and the other datasets)
TOY_SCHEDULE=()    # --toy: extra flags of the b2n and ablation runs (below)
[[ $SMOKE == 0 || $TOY == 0 ]] || die "choose one of --smoke and --toy"

if [[ $SMOKE == 1 ]]; then
    # Toy world: 24 classes of 32x32 images and a 4-block CLIP pretrained on them (cached after the first
    # time); dear.py's default J is then 3 of 4. One epoch per run; on the CPU unless GPUS is set.
    BACKBONE="toy"
    [[ $ROOT_SET == 1 ]] || ROOT="$OUT/data"
    SEEDS="1"
    B2N_DATASETS=(toyworld)
    XD_SOURCE=toyworld
    DG_TARGETS=()
    SHOTS_LIST=(1 2)
    ABLATION_DATASETS=(toyworld)
    ABLATIONS=("--mask none" "--no-attr-tokens")
    COMMON=(--epochs 1 --workers 0)
    [[ -n "${GPUS:-}" ]] || COMMON+=(--device cpu)
    XD_TARGETS="folder:$ROOT/toyworld/images"   # a second view of the toy images
fi
if [[ $TOY == 1 ]]; then
    # Every table in miniature: the toy world (24 classes, 4-block CLIP, J = 3 of 4), 5 seeds. Transfer: the
    # ImageNet-style source model trained on all 24 toy classes, tested on toyworld.py's transfer sets (noisy,
    # small objects: domain shifts; textures: 18 new colour + texture classes). J ablation: 2 and 4 of 4 blocks
    # (the paper's 7 and 11 of 12). Plus the controls for Concept Entropy: random and oracle roles.
    BACKBONE="toy"
    [[ $ROOT_SET == 1 ]] || ROOT="$OUT/data"
    [[ $SEEDS_SET == 1 ]] || SEEDS="1 2 3 4 5"
    B2N_DATASETS=(toyworld)
    XD_SOURCE=toyworld
    DG_TARGETS=()
    ABLATION_DATASETS=(toyworld)
    ABLATIONS=("--mask generalization-only" "--mask none" "--no-attr-tokens" "--lambda-fusion 0"
               "--J 2" "--J 4" "--beta 0.5" "--beta 0.7" "--beta 0.9" "--novel-logits cls"
               "--roles-control random" "--roles-control oracle")
    COMMON=(--workers 0)
    [[ -n "${GPUS:-}" ]] || COMMON+=(--device cpu)
    XD_TARGETS="folder:$ROOT/toyworld-transfer/noisy,folder:$ROOT/toyworld-transfer/small,folder:$ROOT/toyworld-transfer/textures"
    TOY_SCHEDULE=(--epochs 10)        # of dear.py's 20 toy b2n epochs, so that the 5-seed tables fit in 30 minutes
fi
read -r -a SEED_LIST <<< "$SEEDS"
[[ ${#SEED_LIST[@]} -gt 0 ]] || die "--seeds is empty"

# ------------------------------------------------------------------------------------------------
# The job list: JOB_STAGE[i], JOB_CMD[i] (one shell-quoted command line), JOB_ARGS[i] (its dear.py flags).

JOB_STAGE=(); JOB_CMD=(); JOB_ARGS=()

# quote ARGS...: one shell command line; plain words stay as they are, the rest is quoted.
quote() {
    local out="" a q="'"
    for a in "$@"; do
        if [[ "$a" =~ ^[A-Za-z0-9_./:=,@+%-]+$ ]]; then out+="$a "
        elif [[ "$a" == *$'\n'* ]]; then out+="$(printf '%q' "$a") "        # multi-line: $'...\n...'
        else out+="$q${a//$q/$q\\$q$q}$q "; fi                          # 'it'\''s'
    done
    printf '%s' "${out% }"
}

dear_job() {   # dear_job STAGE dear.py-flags...
    local args=("$@"); args=("${args[@]:1}")
    # COMMON first, so a job's own flags win (argparse keeps the last value); the user's EXTRA flags win over all
    local full=(--root "$ROOT" --out "$OUT" --backbone "$BACKBONE" "${COMMON[@]}" "${args[@]}" "${EXTRA[@]}" --resume)
    JOB_STAGE+=("$1")
    JOB_ARGS+=("$(quote "${full[@]}")")
    JOB_CMD+=("$(quote "$PYTHON" "$DEAR_PY" "${full[@]}")")
}

want_dear=0
for s in b2n xd fewshot ablations; do want "$s" && want_dear=1; done

if want b2n; then
    for ds in "${B2N_DATASETS[@]}"; do
        dear_job b2n --dataset "$ds" --protocol b2n --method zeroshot
        for seed in "${SEED_LIST[@]}"; do dear_job b2n --dataset "$ds" --protocol b2n --seed "$seed" "${TOY_SCHEDULE[@]}"; done
    done
fi
if want xd; then
    # the 4 ImageNet variants (domain generalisation) and the other 10 datasets (cross-dataset)
    targets=("${DG_TARGETS[@]}")
    for ds in "${B2N_DATASETS[@]}"; do [[ $ds == "$XD_SOURCE" ]] || targets+=("$ds"); done
    tlist="$(IFS=,; echo "${targets[*]}")"
    [[ -z "$XD_TARGETS" ]] || tlist="$XD_TARGETS"
    dear_job xd --dataset "$XD_SOURCE" --protocol xd --targets "$tlist" --method zeroshot
    for seed in "${SEED_LIST[@]}"; do dear_job xd --dataset "$XD_SOURCE" --protocol xd --targets "$tlist" --seed "$seed"; done
fi
if want fewshot; then
    for ds in "${B2N_DATASETS[@]}"; do
        dear_job fewshot --dataset "$ds" --protocol fewshot --method zeroshot   # shots do not matter: one run
        for k in "${SHOTS_LIST[@]}"; do
            for seed in "${SEED_LIST[@]}"; do dear_job fewshot --dataset "$ds" --protocol fewshot --shots "$k" --seed "$seed"; done
        done
    done
fi
if want ablations; then
    for ds in "${ABLATION_DATASETS[@]}"; do
        for flags in "${ABLATIONS[@]}"; do
            read -r -a f <<< "$flags"
            for seed in "${SEED_LIST[@]}"; do dear_job ablations --dataset "$ds" --protocol b2n --seed "$seed" "${TOY_SCHEDULE[@]}" "${f[@]}"; done
        done
    done
fi

# ------------------------------------------------------------------------------------------------
# Ask dear.py where each run writes (its own run_dir()), so the skip check and the duplicate check use
# exactly its folder names, and which insertion layer J each run needs head roles for. One python
# process for the whole list. Output per job: "J<TAB>needs_roles (0/1)<TAB>run_dir" (J "-": the default;
# run_dir "": unknown). Fields never empty before the last one: read with IFS=tab would merge them.
NAME_PY='
import importlib.util, os, shlex, sys
path = os.path.abspath(sys.argv[1])
sys.path.insert(0, os.path.dirname(path))
spec = importlib.util.spec_from_file_location("dear", path)
dear = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dear)
for line in sys.stdin.read().splitlines():
    try:
        c = dear.resolve(dear.parse_args(shlex.split(line)))
        roles = c.method == "dear" and c.attr_tokens and c.mask != "none"
        J = "-" if c.J is None else c.J   # None: the default of the backbone
        print(f"{J}\t{int(roles)}\t{dear.run_dir(c)}")
    except BaseException:   # a bad job line: dear.py itself says what is wrong when the job runs
        print("-\t0\t")
'
N=${#JOB_ARGS[@]}
JOB_DIR=(); JOB_J=(); JOB_ROLES=()
if [[ $N -gt 0 ]]; then
    mapfile -t info < <(printf '%s\n' "${JOB_ARGS[@]}" | "$PYTHON" -c "$NAME_PY" "$DEAR_PY" || true)
    [[ ${#info[@]} -eq $N ]] || die "could not ask $DEAR_PY for its run folders (see the error above)"
    for line in "${info[@]}"; do
        IFS=$'\t' read -r j r d <<< "$line"
        JOB_DIR+=("$d"); JOB_J+=("$j"); JOB_ROLES+=("$r")
    done
fi

# Drop jobs that write the same run folder as an earlier one (e.g. "--J 9" is the default run).
declare -A SEEN=()
ORDER=()
for ((i = 0; i < N; i++)); do
    d="${JOB_DIR[i]}"
    if [[ -n "$d" && -n "${SEEN[$d]:-}" ]]; then continue; fi
    [[ -z "$d" ]] || SEEN[$d]=1
    ORDER+=("$i")
done

# Roles jobs first: one per insertion layer J that some run needs (and only for the roles stage).
ROLE_CMDS=(); ROLE_OUT=()
if want roles && [[ $want_dear == 1 || ${#ORDER[@]} -eq 0 ]]; then
    declare -A JS=()
    for i in "${ORDER[@]}"; do [[ "${JOB_ROLES[i]}" != 1 ]] || JS[${JOB_J[i]}]=1; done   # "-": default J
    [[ ${#ORDER[@]} -gt 0 ]] || JS[-]=1                                                  # --stages roles alone
    for j in $(printf '%s\n' "${!JS[@]}" | sort -n); do
        [[ $j != - ]] || j=""
        name="J${j:-default}"
        ROLE_OUT+=("$OUT/roles/$name")
        # dear.py --roles-only: the roles dear.py itself would compute on first use (same probe set, same cache),
        # copied to OUT/roles/J<J>/ for Table 6
        ROLE_CMDS+=("$(quote "$PYTHON" "$DEAR_PY" --roles-only --dataset "${B2N_DATASETS[0]}" \
            --root "$ROOT" --out "$OUT" --backbone "$BACKBONE" "${COMMON[@]}" ${j:+--J "$j"} "${EXTRA[@]}")")
    done
fi

# ------------------------------------------------------------------------------------------------
# --list: the job list, roles jobs first (they must finish before the others start).

if [[ $MODE == list ]]; then
    for c in "${ROLE_CMDS[@]}"; do echo "$c"; done
    for i in "${ORDER[@]}"; do echo "${JOB_CMD[i]}"; done
    [[ ${#ROLE_CMDS[@]} -eq 0 ]] || echo "# the first ${#ROLE_CMDS[@]} line(s) compute head roles: run them before the others" >&2
    exit 0
fi

# ------------------------------------------------------------------------------------------------
# The toy world is generated, not downloaded: make it (once) before the check looks for it.
if [[ $SMOKE == 1 && $MODE != list ]]; then
    "$PYTHON" "$HERE/toyworld.py" dataset --root "$ROOT" >/dev/null || exit 2
fi
if [[ $TOY == 1 && $MODE != list ]]; then
    "$PYTHON" "$HERE/toyworld.py" dataset --root "$ROOT" --transfer >/dev/null || exit 2
    [[ $MODE == check ]] || "$PYTHON" "$HERE/toyworld.py" pretrain || exit 2   # once, before parallel jobs need it
fi
# Datasets: check every dataset the selected stages need, and report all missing ones at once,
# before any GPU time is spent.

CHECK_PY='
import os, sys
full, root, names = sys.argv[2] == "full", sys.argv[3], sys.argv[4:]
where = os.path.abspath(os.path.expanduser(root))
count = lambda n: f"{n} dataset" + "s" * (n != 1)
if not os.path.isdir(where) and not any(n == "toyworld" or n.startswith("folder:") for n in names):
    # no root at all: say so once, not once per dataset (and before the slow import of data.py)
    print(f"data root not found: {where}, so the {count(len(names))} the stages need are all missing", file=sys.stderr)
    if full:
        sys.path.insert(0, sys.argv[1])
        import data
        print("where each one goes under --root DATA:", file=sys.stderr)
        for n in names:
            print(f"  {n:<16} DATA/{data.DATASETS[n].layout()}", file=sys.stderr)
    print("Pass --root DATA, the folder that holds the datasets in the layout of CoOp\x27s DATASETS.md.", file=sys.stderr)
    sys.exit(3)
sys.path.insert(0, sys.argv[1])
import data
missing = []
for name in names:
    try:
        data.build_dataset(name, root)
        if full:
            print(f"  ok       {name}", flush=True)
    except data.DataError as e:
        if full:
            print(f"  MISSING  {name}", flush=True)
        missing.append((name, "    " + str(e).replace("\n", "\n    ")))
if not missing:
    sys.exit(0)
summary = f"{len(missing)} of {count(len(names))} missing under --root {root}"
if full:   # every missing dataset with its fix
    print(f"\n{summary}:\n\n"
          + "\n\n".join(f"{n}:\n{fix}" for n, fix in missing), file=sys.stderr)
else:      # a summary: which ones, and the fix of the first
    listed = ", ".join(n for n, _ in missing)
    print(f"{summary}: {listed}\n"
          f"The first, {missing[0][0]}:\n" + missing[0][1], file=sys.stderr)
sys.exit(3)   # 3: datasets missing (any other failure is the check itself)
'
needed_datasets() {
    local names=()
    if want b2n || want fewshot; then names+=("${B2N_DATASETS[@]}"); fi
    if want xd; then names+=("$XD_SOURCE" "${DG_TARGETS[@]}" "${B2N_DATASETS[@]}"); fi
    if want ablations; then names+=("${ABLATION_DATASETS[@]}"); fi
    if want roles; then names+=("${B2N_DATASETS[0]}"); fi
    [[ ${#names[@]} -eq 0 ]] || printf '%s\n' "${names[@]}" | awk '!seen[$0]++'
}
# check_data full|brief: "full" (--check) lists every dataset and every fix; "brief" (before a run) one summary.
# Either way it ends with where to go next: the full list, the download command, the offline demo.
check_data() {
    local names me here rc=0
    mapfile -t names < <(needed_datasets)
    [[ ${#names[@]} -gt 0 ]] || return 0
    echo "checking ${#names[@]} dataset(s) under $ROOT"
    "$PYTHON" -c "$CHECK_PY" "$HERE" "$1" "$ROOT" "${names[@]}" || rc=$?
    [[ $rc != 0 ]] || return 0
    [[ $rc == 3 ]] || { echo "run_all.sh: the dataset check itself failed (see above); --no-check skips it" >&2; return 1; }
    me="$(dirname "$0")"; here="${me%/}/"; [[ $me != . ]] || here=""   # the commands as the user would type them
    {
        echo
        [[ $1 == full ]] || echo "  every dataset with its fix:  bash ${here}run_all.sh --check $(quote --root "$ROOT")"
        echo "  get a dataset:               $(quote "$PYTHON" "${here}data.py" download) NAME $(quote --root "$ROOT")   ($(quote "$PYTHON" "${here}data.py") --help lists the names)"
        echo "  try it offline first:        bash ${here}run_all.sh --smoke --out smoke   (the toy world on the CPU, no download)"
        echo "  or leave stages out with --skip (e.g. --skip xd,fewshot)"
    } >&2
    return 1
}

if [[ $MODE == check ]]; then
    check_data full && exit 0 || exit 2
fi
if [[ $CHECK == 1 ]]; then check_data brief || exit 2; fi

# ------------------------------------------------------------------------------------------------
# Running: one job per GPU slot (GPUS="0 1 ..."), or one after another (GPUS unset).

mkdir -p "$OUT/logs"
read -r -a SLOTS <<< "${GPUS:-}"
PARALLEL=1
if [[ ${#SLOTS[@]} -eq 0 ]]; then SLOTS=(""); PARALLEL=0; fi
START=$(date +%s)
n_done=0; n_skip=0; n_failed=0; n_left=0; n_running=0
FAILED=()

fmt_s() { local s=$1; printf '%dh%02dm%02ds' $((s / 3600)) $((s % 3600 / 60)) $((s % 60)); }
summary() {
    echo "[$(date +%H:%M:%S)] done $n_done (skipped $n_skip) | running $n_running | failed $n_failed | left $n_left | elapsed $(fmt_s $(( $(date +%s) - START )))"
}
log_name() { local s="${1#"$OUT"/}"; echo "$OUT/logs/${s//\//__}.log"; }

# run_jobs NAME... : runs the commands in CMDS[] with logs LOGS[] and done-markers DONE[] (a path that
# exists once the job has finished; empty: always run). Returns 1 if any job failed.
run_jobs() {
    local total=${#CMDS[@]} next=0 failed=0 k slot i
    local -a pid=() job=()
    n_left=$total
    for ((k = 0; k < ${#SLOTS[@]}; k++)); do pid[k]=""; done
    while [[ $next -lt $total || $n_running -gt 0 ]]; do
        for ((k = 0; k < ${#SLOTS[@]}; k++)); do
            # a finished job frees its slot
            if [[ -n "${pid[k]}" ]] && ! kill -0 "${pid[k]}" 2>/dev/null; then
                i=${job[k]}
                if wait "${pid[k]}"; then n_done=$((n_done + 1)); echo "ok      ${NAMES[i]}"
                else
                    n_failed=$((n_failed + 1)); failed=1; FAILED+=("${NAMES[i]}  (log: ${LOGS[i]})")
                    echo "FAILED  ${NAMES[i]} (log: ${LOGS[i]}); last lines:"; tail -n 5 "${LOGS[i]}" | sed 's/^/    /'
                fi
                pid[k]=""; n_running=$((n_running - 1)); summary
            fi
            # start the next job in a free slot (skipping finished runs)
            while [[ -z "${pid[k]}" && $next -lt $total ]]; do
                i=$next; next=$((next + 1)); n_left=$((n_left - 1))
                if [[ -n "${DONE[i]}" && -e "${DONE[i]}" ]]; then
                    n_done=$((n_done + 1)); n_skip=$((n_skip + 1)); echo "skip (done) ${NAMES[i]}"; continue
                fi
                slot="${SLOTS[k]}"
                echo "start   ${NAMES[i]}${slot:+ on GPU $slot}  (log: ${LOGS[i]})"
                mkdir -p "$(dirname "${LOGS[i]}")"
                if [[ $PARALLEL == 1 ]]; then
                    CUDA_VISIBLE_DEVICES="$slot" bash -c "${CMDS[i]}" > "${LOGS[i]}" 2>&1 &
                    pid[k]=$!; job[k]=$i; n_running=$((n_running + 1))
                else   # sequential: in the foreground, so Ctrl-C reaches dear.py, which keeps its checkpoint
                    n_running=1; summary
                    if bash -c "${CMDS[i]}" > "${LOGS[i]}" 2>&1; then n_done=$((n_done + 1)); echo "ok      ${NAMES[i]}"
                    else
                        n_failed=$((n_failed + 1)); failed=1; FAILED+=("${NAMES[i]}  (log: ${LOGS[i]})")
                        echo "FAILED  ${NAMES[i]} (log: ${LOGS[i]}); last lines:"; tail -n 5 "${LOGS[i]}" | sed 's/^/    /'
                    fi
                    n_running=0; summary
                fi
            done
        done
        [[ $n_running -eq 0 ]] || sleep 0.5   # poll: portable to every bash 4
    done
    return $failed
}
trap 'echo; echo "interrupted: rerun the same command; finished runs are skipped, interrupted ones resume" >&2; exit 130' INT TERM

echo "run_all.sh: ${#ROLE_CMDS[@]} roles job(s), ${#ORDER[@]} run(s) -> $OUT (GPUs: ${GPUS:-none, sequential})"
if [[ ${#ROLE_CMDS[@]} -gt 0 ]]; then
    echo "== roles"
    CMDS=("${ROLE_CMDS[@]}"); NAMES=(); LOGS=(); DONE=()
    for d in "${ROLE_OUT[@]}"; do NAMES+=("roles/${d##*/}"); LOGS+=("$(log_name "$d")"); DONE+=("$d/roles.json"); done
    run_jobs || { echo "the roles stage failed: every run needs the head roles; see the log above" >&2; exit 1; }
fi
if [[ ${#ORDER[@]} -gt 0 ]]; then
    echo "== runs"
    CMDS=(); NAMES=(); LOGS=(); DONE=()
    for i in "${ORDER[@]}"; do
        d="${JOB_DIR[i]}"
        CMDS+=("${JOB_CMD[i]}")
        NAMES+=("${JOB_STAGE[i]}: ${d#"$OUT"/}")
        LOGS+=("$(log_name "${d:-$OUT/unnamed-$i}")")
        DONE+=("${d:+$d/results.json}")
    done
    run_jobs || true
fi
if want tables; then
    echo "== tables"
    "$PYTHON" "$HERE/tables.py" --out "$OUT"
fi
summary
if [[ ${#FAILED[@]} -gt 0 ]]; then
    printf 'failed runs (rerun the same command to retry them):\n'; printf '  %s\n' "${FAILED[@]}"
    exit 1
fi
echo "all done; tables: $OUT/tables/tables.md"
