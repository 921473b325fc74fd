#!/usr/bin/env bash
# Every table of the DeAR paper: one `python dear.py ...` job per run, stage after stage, then tables.py.
#
#   bash run_all.sh --root DATA                  every stage, seeds 1-3, one job after another
#   GPUS="0 1 2 3" bash run_all.sh --root DATA   one queue of jobs per GPU, all at once (logs: OUT/gpu<g>.log)
#   bash run_all.sh --check --root DATA          only check the datasets the stages need
#   bash run_all.sh --smoke                      the whole pipeline on the toy world, CPU, into runs-smoke/
#   bash run_all.sh --toy                        every table in miniature, 5 seeds, CPU, into runs-toy/
#   bash run_all.sh --list --root DATA > jobs.txt   the jobs, one command a line (roles jobs first)
#
# Options: --root DIR (default: data; the toy world: OUT/data), --out DIR (default: runs), --seeds "1 2 3",
# --stages LIST and --skip LIST (of roles,b2n,xd,fewshot,ablations,tables). PYTHON: the interpreter.
# Every job runs with --resume: dear.py skips a finished run and resumes an interrupted one, so rerunning
# is safe. A failed job prints "FAILED <command>", the others go on, and the exit status is 1.
set -uo pipefail # not -e: one failed job must not stop the others
die() { echo "run_all.sh: $*" >&2 && exit 2; }
PY=${PYTHON:-python}
here=$(dirname "$0")/ && here=${here#./} # the jobs name dear.py as the user named this script
MODE=run PRESET="" ROOT="" OUT="" SEEDS="" SKIP="" STAGES=roles,b2n,xd,fewshot,ablations,tables
need() { [[ -n ${2:-} && ${2:-} != --* ]] || die "$1 needs a value (bash run_all.sh --help)"; }
while (($#)); do
    case $1 in
        --root) need "$@" && ROOT=$2 && shift ;;
        --out) need "$@" && OUT=$2 && shift ;;
        --seeds) need "$@" && SEEDS=$2 && shift ;;
        --stages) need "$@" && STAGES=$2 && shift ;;
        --skip) need "$@" && SKIP=$2 && shift ;;
        --list | --check) [[ $MODE == run || $MODE == "${1#--}" ]] || die "--list and --check: choose one"
            MODE=${1#--} ;;
        --smoke | --toy) [[ -z $PRESET || $PRESET == "${1#--}" ]] || die "--smoke and --toy are two presets: choose one"
            PRESET=${1#--} ;;
        -h | --help) sed -n '2,/^set /{/^set /d; s/^# \{0,1\}//; p}' "$0" && exit 0 ;;
        *) die "unknown option $1 (bash run_all.sh --help)" ;;
    esac
    shift
done
for s in ${STAGES//,/ } ${SKIP//,/ }; do [[ ,roles,b2n,xd,fewshot,ablations,tables, == *,$s,* ]] || die "unknown stage $s"; done
want() { [[ ,$STAGES, == *,$1,* && ,$SKIP, != *,$1,* ]]; }
left=0 && for s in roles b2n xd fewshot ablations tables; do ! want $s || left=1; done
((left)) || die "--stages '$STAGES' --skip '$SKIP' leave no stage to run"
# a preset sets these itself: refused, never overridden
[[ $PRESET != smoke || -z $SEEDS ]] || die "--smoke runs seed 1 only: drop --seeds, or use --toy"
[[ -z $SEEDS || $SEEDS =~ ^[0-9]+( [0-9]+)*$ ]] || die "--seeds '$SEEDS': whole numbers, separated by spaces"

# The paper: 11 base-to-novel datasets (ImageNet first: the xd source and the roles probe), ImageNet's 4
# variants, the ablations on three small datasets. J = 9 is the full model; the J ablation needs roles at 7, 11.
B2N=(imagenet caltech101 oxford_pets stanford_cars oxford_flowers food101 fgvc_aircraft sun397 dtd eurosat ucf101)
DG=(imagenetv2 imagenet_sketch imagenet_a imagenet_r)
SHOTS=(1 2 4 8 16) ABL_DATA=(dtd eurosat oxford_flowers) J=9 ABL_J=(7 11) TRAIN=()
OUT=${OUT:-runs${PRESET:+-$PRESET}}
BACKBONE=(--backbone ViT-B/16)
if [[ -n $PRESET ]]; then # the toy world: 24 classes, a 4-block CLIP pretrained on them (J = 3 of 4), CPU
    ROOT=${ROOT:-$OUT/data} B2N=(toyworld) DG=() ABL_DATA=(toyworld) J=3 ABL_J=(2 4)
    BACKBONE=(--backbone toy --workers 0 --device cpu)
fi
if [[ $PRESET == smoke ]]; then # one seed, the warm-up and one epoch, the fewest jobs that fill every table
    SEEDS=1 SHOTS=(1) ABL_J=() TRAIN=(--epochs 2)
elif [[ $PRESET == toy ]]; then # the quick start's recipe, 5 seeds (the README's toy table)
    SEEDS=${SEEDS:-1 2 3 4 5}
fi
ROOT=${ROOT:-data} && COMMON=(--root "$ROOT" --out "$OUT" "${BACKBONE[@]}")
read -ra SEED <<< "${SEEDS:-1 2 3}"
ABLATIONS=("--mask generalization-only" "--mask none" "--no-attr-tokens" "--lambda-fusion 0" "--beta 0.5"
    "--beta 0.7" "--beta 0.9" "--novel-logits cls" "--roles-control random" "--tokens mmrl")
for j in "${ABL_J[@]}"; do ABLATIONS+=("--J $j"); done
[[ $PRESET != smoke ]] || ABLATIONS=("--mask none")
if [[ $PRESET == toy ]]; then # the claim without the regularisers' brakes (README): each mask again
    for f in "" "--mask none" "--mask generalization-only" "--roles-control random"; do
        ABLATIONS+=("--lambda-reg 0 --lambda-fusion 0 --lr 1e-2 $f")
    done
fi
ROLES_J=("$J") && want ablations && ROLES_J+=("${ABL_J[@]}")

if [[ $MODE == run ]]; then
    if [[ -n ${GPUS:-} && $("$PY" -c 'import torch; print(torch.cuda.is_available())') != True ]]; then
        die "GPUS is set, but torch finds no CUDA device here (unset GPUS to run on the CPU)"
    fi
    # One run_all.sh per OUT: flock on OUT/.lock, held until this script and its jobs end. A symlink there
    # is refused, never followed: opening it would create or lock whatever file it points to.
    mkdir -p "$OUT" || exit 2
    [[ ! -L $OUT/.lock ]] || die "$OUT/.lock is a symbolic link; remove it"
    [[ ! -e $OUT/.lock || -f $OUT/.lock ]] || die "$OUT/.lock is not a regular file; remove it"
    exec 9>> "$OUT/.lock" || exit 2
    flock -n 9 || die "$OUT is in use by another run_all.sh; wait for it, or choose another --out"
fi
TARGETS=() # xd: the 4 ImageNet variants and the other 10 datasets; the toy world: its transfer sets
for t in "${DG[@]}" "${B2N[@]:1}"; do TARGETS+=(--targets "$t"); done
if [[ -n $PRESET ]]; then # the toy world is generated, not downloaded: write it (once) before anything reads it
    sets=$(PYTHONPATH="${here:-.}${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c 'import sys, data, toyworld
write = lambda root: toyworld.ensure_dataset(root) and toyworld.ensure_transfer(root)
print(*data.guarded(write, sys.argv[1]), sep="\n")' "$ROOT") || exit 2
    while IFS= read -r t; do TARGETS+=(--targets "$t"); done <<< "$sets" # folder:PATH, each taken whole
fi

# Each job names only flags its call reads (dear.py refuses the others): --resume for runs (a finished one is
# reused, an interrupted one resumed), the training schedule for DeAR runs only.
job() { local q && printf -v q '%q ' "$PY" "${here}dear.py" "$@" "${COMMON[@]}" && echo "${q% }"; }
zeroshot() { job "$@" --method zeroshot --resume; }
dear() { job "$@" "${TRAIN[@]}" --resume; }
XD=(--dataset "${B2N[0]}" --protocol xd) # the xd source; its targets: TARGETS
jobs_of() { # jobs_of STAGE: its dear.py command lines, shell-quoted
    local ds f fl k s
    case $1 in
        roles) for j in "${ROLES_J[@]}"; do job --roles-only --J "$j" --dataset "${B2N[0]}"; done ;;
        b2n) for ds in "${B2N[@]}"; do zeroshot --dataset "$ds" --protocol b2n
            for s in "${SEED[@]}"; do dear --dataset "$ds" --protocol b2n --seed "$s"; done; done ;;
        xd) zeroshot "${XD[@]}" "${TARGETS[@]}"
            for s in "${SEED[@]}"; do dear "${XD[@]}" "${TARGETS[@]}" --seed "$s"; done ;;
        fewshot) for ds in "${B2N[@]}"; do zeroshot --dataset "$ds" --protocol fewshot
            for k in "${SHOTS[@]}"; do for s in "${SEED[@]}"; do
                dear --dataset "$ds" --protocol fewshot --shots "$k" --seed "$s"; done; done; done ;;
        ablations) for ds in "${ABL_DATA[@]}"; do for f in "${ABLATIONS[@]}"; do read -ra fl <<< "$f"
            for s in "${SEED[@]}"; do dear --dataset "$ds" --protocol b2n --seed "$s" "${fl[@]}"; done
        done; done # and MMRL's class-only logits on the xd targets, where fused vs class differs from MMRL most
            [[ $PRESET == smoke ]] || for s in "${SEED[@]}"; do dear "${XD[@]}" "${TARGETS[@]}" --seed "$s" --novel-logits cls; done ;;
    esac
}
STAGE_LIST=() && for s in roles b2n xd fewshot ablations; do want $s && STAGE_LIST+=("$s"); done
if [[ $MODE == list ]]; then
    for s in "${STAGE_LIST[@]}"; do jobs_of "$s"; done
    ! want roles || echo "# the first ${#ROLES_J[@]} line(s) compute head roles: run them before the others" >&2
    exit 0
fi
# the datasets the jobs name, each once; data.py lists all missing ones at once, before any training
mapfile -t need < <(for s in "${STAGE_LIST[@]}"; do jobs_of "$s"; done |
    grep -oE -- '--(dataset|targets) [a-z0-9_]+( |$)' | awk '!seen[$2]++ { print $2 }')
((${#need[@]} == 0)) || "$PY" "${here}data.py" check "${need[@]}" --root "$ROOT" || exit 2
[[ $MODE == run ]] || exit 0

queue() { # run the command lines on stdin one after another; status 1 if any failed
    local cmd rc=0
    while IFS= read -r cmd; do
        echo "== $cmd"
        eval "$cmd" < /dev/null 2>&1 || { echo "FAILED $cmd" >&2 && rc=1; }
    done
    return $rc
}
stage() { # stage NAME: its jobs in one queue, or one queue per GPU (round-robin); the next stage waits
    local lines i k p rc=0 pids=() gpu=("")
    mapfile -t lines < <(jobs_of "$1")
    [[ -z ${GPUS:-} ]] || read -ra gpu <<< "$GPUS"
    set -m # each queue in a process group of its own, so that the trap below stops it and its dear.py
    for i in "${!gpu[@]}"; do
        for ((k = i; k < ${#lines[@]}; k += ${#gpu[@]})); do echo "${lines[k]}"; done |
            if [[ -z ${gpu[i]} ]]; then queue; else CUDA_VISIBLE_DEVICES=${gpu[i]} queue >> "$OUT/gpu${gpu[i]}.log"; fi &
        pids+=($!)
    done
    set +m
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    return $rc
}
trap 'kill -- $(jobs -p | sed "s/^/-/") 2> /dev/null; exit 130' INT TERM
failed=0
for s in "${STAGE_LIST[@]}"; do stage "$s" || failed=1; done
! want tables || "$PY" "${here}tables.py" --out "$OUT" || failed=1
exit $failed
