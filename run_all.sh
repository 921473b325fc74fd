#!/usr/bin/env bash
# run_all.sh: reproduce every table of the DeAR paper with this code (bash run_all.sh --help).
#
#   bash run_all.sh --root DATA                 # everything, seeds 1-3, one job after another
#   GPUS="0 1 2 3" bash run_all.sh --root DATA  # four jobs at a time, one per GPU
#   bash run_all.sh --smoke                     # the whole pipeline on the toy world, CPU
#
# This file says which tables there are and which dear.py jobs fill them (one run folder each under
# --out); jobs.py names, checks and runs them, skipping finished runs and resuming interrupted ones.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: bash run_all.sh [options] [-- extra dear.py flags]

Runs dear.py for every cell of the paper's tables, then tables.py. Stages, in order:
  roles      head roles (Concept Entropy, entropy.py), once per insertion layer J
  b2n        base-to-novel, 11 datasets x seeds, and zero-shot CLIP per dataset
  xd         the ImageNet source model on the 4 ImageNet variants and the other 10 datasets
             (domain generalisation, cross-dataset), and zero-shot CLIP
  fewshot    1/2/4/8/16 shots, 11 datasets x seeds, and zero-shot CLIP per dataset
  ablations  b2n on dtd, eurosat, oxford_flowers: --mask generalization-only|none,
             --no-attr-tokens, --lambda-fusion 0, --J 7|11, --beta 0.5|0.7|0.9,
             --novel-logits cls, --roles-control random
  tables     python tables.py --out OUT -> OUT/tables/tables.md and CSV files

Options:
  --root DIR       datasets in CoOp's layout (default: $DATA or ./data)
  --out DIR        one folder per run, logs in OUT/logs (default: runs; runs-smoke with
                   --smoke, runs-toy with --toy)
  --stages LIST    comma-separated stages to run (default: all); --skip LIST: leave these out
  --seeds "1 2 3"  seeds (default: $SEEDS or "1 2 3");  --backbone NAME (default: ViT-B/16)
  --list           print the job list, one command line per line (SLURM arrays, GNU parallel)
  --check          only check the datasets the stages need, with the fix for each missing one
                   (a run checks first too); --no-check: do not check before starting
  --smoke          the same stages on the toy world (backbone "toy", 1 seed, 1 epoch, CPU)
  --toy            every table in miniature on the toy world: seeds 1-5, 1/2/4/8/16 shots,
                   the toy's transfer sets, every ablation plus random and oracle roles (CPU)
  -h, --help       this help

Environment: GPUS="0 1 2 3" runs one job per listed GPU at a time (CUDA_VISIBLE_DEVICES per
job; unset: one job after another, dear.py picks the device); SEEDS, DATA: defaults of --seeds
and --root; PYTHON (default: python); DEAR_PY (default: the dear.py next to this script).

Finished runs are skipped ("skip (done)"), interrupted ones resume (--resume is always passed),
failed ones are listed at the end with their logs (exit 1). Rerunning a command is always safe.
EOF
}

die() { echo "run_all.sh: $*" >&2; exit 2; }

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
DEAR_PY="${DEAR_PY:-$HERE/dear.py}"
ROOT="${DATA:-data}"
OUT=""           # default below: runs, runs-smoke or runs-toy
SEEDS="${SEEDS:-1 2 3}"
BACKBONE="ViT-B/16"
ALL_STAGES="roles,b2n,xd,fewshot,ablations,tables"
STAGES="$ALL_STAGES"
SKIP=""
MODE="run"        # run | list | check
CHECK=1; SMOKE=0; TOY=0; SEEDS_SET=0; ROOT_SET=0
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
# the toy schedules never share a folder with the quick start (python dear.py --dataset toyworld -> runs/):
# a table cell compares runs of one schedule
if [[ -z "$OUT" ]]; then OUT=runs; [[ $SMOKE == 0 ]] || OUT=runs-smoke; [[ $TOY == 0 ]] || OUT=runs-toy; fi

if [[ $SMOKE == 1 ]]; then
    # Toy world: 24 classes of 32x32 images and a 4-block CLIP pretrained on them (cached after the first
    # time); dear.py's default J is then 3 of 4. One epoch per run; on the CPU unless GPUS is set.
    BACKBONE="toy"
    [[ $ROOT_SET == 1 ]] || ROOT="$OUT/data"
    SEEDS="1"
    B2N_DATASETS=(toyworld); XD_SOURCE=toyworld; DG_TARGETS=(); ABLATION_DATASETS=(toyworld)
    SHOTS_LIST=(1 2)
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
    B2N_DATASETS=(toyworld); XD_SOURCE=toyworld; DG_TARGETS=(); ABLATION_DATASETS=(toyworld)
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
# The job list: JOB_STAGE[i] and JOB_ARGS[i] (its dear.py flags, one shell-quoted line).

JOB_STAGE=(); JOB_ARGS=()

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
}

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
# The rest is jobs.py's: it asks dear.py where each run writes (so skipping and de-duplicating use its
# folder names) and which J needs head roles, adds one roles job per J, prints --list, makes the toy world,
# checks the datasets, holds OUT for this run, runs the jobs (GPU slots or one after another), the tables.

NEED=()   # the datasets the stages read, for the check (jobs.py drops repeats)
if want b2n || want fewshot; then NEED+=("${B2N_DATASETS[@]}"); fi
if want xd; then NEED+=("$XD_SOURCE" "${DG_TARGETS[@]}" "${B2N_DATASETS[@]}"); fi
if want ablations; then NEED+=("${ABLATION_DATASETS[@]}"); fi
if want roles; then NEED+=("${B2N_DATASETS[0]}"); fi
me="$(dirname "$0")"; here="${me%/}/"; [[ $me != . ]] || here=""   # commands in messages, as the user types them
ARGS=("$MODE" "--out=$OUT" "--root=$ROOT" "--python=$PYTHON" "--dear=$DEAR_PY" "--here=$here"
      "--launcher=$(quote "$PYTHON" "$DEAR_PY")")
for ((i = 0; i < ${#JOB_ARGS[@]}; i++)); do ARGS+=("--job=${JOB_STAGE[i]}"$'\t'"${JOB_ARGS[i]}"); done
if want roles; then
    # dear.py --roles-only: the roles dear.py itself would compute on first use (same probe set, same cache),
    # copied to OUT/roles/J<J>/ for Table 6; jobs.py puts "--J <J>" between the two parts
    ARGS+=("--roles-before=$(quote "$PYTHON" "$DEAR_PY" --roles-only --dataset "${B2N_DATASETS[0]}" \
        --root "$ROOT" --out "$OUT" --backbone "$BACKBONE" "${COMMON[@]}")" "--roles-after=$(quote "${EXTRA[@]}")")
fi
for name in "${NEED[@]}"; do ARGS+=("--dataset=$name"); done
[[ $SMOKE == 0 ]] || ARGS+=(--toyworld=smoke)
[[ $TOY == 0 ]] || ARGS+=(--toyworld=toy)
[[ $CHECK == 1 ]] || ARGS+=(--no-check)
! want tables || ARGS+=(--tables)
exec "$PYTHON" "$HERE/jobs.py" "${ARGS[@]}"
