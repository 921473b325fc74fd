#!/usr/bin/env bash
# Mutation testing of the functions that carry the method and its bookkeeping, one module at a time.
#
#   pip install -r requirements-dev.txt                       # mutmut, a development dependency only
#   OMP_NUM_THREADS=1 ./mutate.sh entropy.py                  # the scope listed below for entropy.py
#   OMP_NUM_THREADS=1 ./mutate.sh entropy.py textspan_from_statistics 'GramStatistics.*'   # some functions
#
# The repository's files are copied to a scratch folder (MUTATE_DIR, default a new temporary folder), so runs
# on different modules never share mutmut's `mutants/` folder. mutmut first runs the module's tests once to
# record which test calls which function, then runs on each mutant only the tests that call its function.
# Every mutant of the scope is reported: killed, survived (a test to write, or an equivalent mutant, listed
# in the module's test file), timeout, no tests. JOBS parallel workers (default 2). mutmut skips
# decorated functions: the project writes `with torch.no_grad():` in a body, not the decorator.
#
# To scope another module: add a line to SCOPES: the module, its test files, its functions (FUNCTION or
# Class.method; a trailing * is a glob).
set -euo pipefail
declare -A TESTS FUNCTIONS
TESTS[entropy.py]="tests/test_entropy.py"
FUNCTIONS[entropy.py]="encode_texts label_by_centroid decompose head_contributions sum_parts
  check_textspan advice GramStatistics.* textspan textspan_from_statistics concept_distribution
  concept_entropy default_thresholds assign_role control_roles collect_statistics compute_roles"
TESTS[train.py]="tests/test_train.py tests/test_precision.py"
FUNCTIONS[train.py]="lr_at resolve_precision autocast_dtype eval_precision matmul_weights
  frozen_weights epoch_batches train_step make_scaler scale_of resume train evaluate"
TESTS[data.py]="tests/test_data.py"
FUNCTIONS[data.py]="fewshot_sample fewshot_split subsample_classes read_folder to_rgb random_crop_box
  TrainTransform.* EvalTransform.*"
TESTS[dear.py]="tests/test_dear.py tests/test_pruning.py"
FUNCTIONS[dear.py]="role_mask block_masks insert mix AttributeTokens.* DeAR.forward DeAR.frozen_prefix
  DeAR.frozen_feature DeAR.token_blocks DeAR.image_features DeAR.encode_classes DeAR.set_classes
  DeAR.alpha cosine_logits fuse reference_forward reference_images reference_classes dear_loss make_loss"
TESTS[config.py]="tests/test_dear.py tests/test_runs.py tests/test_run_reliability.py"
FUNCTIONS[config.py]="resolve check_numbers eval_beta default_J"
TESTS[runs.py]="tests/test_runs.py tests/test_run_reliability.py"
FUNCTIONS[runs.py]="file_sha256 backbone_sha256 roles_sha256 variant_name run_dir dataset_tag inputs
  comparable differences check_same check_flags check_backbone retire finished take_folder
  eval_only_config"
# toyworld.py: without the tests that need the default toy CLIP (a pretraining per mutant) and the
# knob bookkeeping's (render_knobs reads the drawing functions' code, which mutmut rewrites)
TESTS[toyworld.py]="tests/test_toyworld.py --deselect
  tests/test_toyworld.py::test_default_pretraining_beats_chance_zero_shot --deselect
  tests/test_toyworld.py::test_checkpoint_loads_strictly_and_is_reused --deselect
  tests/test_toyworld.py::test_dear_on_toyworld_beats_zero_shot_on_base_classes --deselect
  tests/test_toyworld.py::test_attribute_heads_decode_their_attribute_best --deselect
  tests/test_toyworld.py::test_heads_specialise_and_generalization_heads_favour_no_factor --deselect
  tests/test_toyworld.py::test_a_dataset_drawn_with_other_knobs_stops_the_run --deselect
  tests/test_toyworld.py::test_every_knob_the_drawing_reads_is_recorded_and_compared --deselect
  tests/test_toyworld.py::test_a_render_file_of_the_first_v2_datasets_is_still_read"
FUNCTIONS[toyworld.py]="shape_mask texture_dark render_array caption class_list dataset_items
  factor_labels to_tensor sample_batch contrastive_loss warmup_cosine pretraining_batch tower_step"

module=${1:?usage: ./mutate.sh MODULE.py [FUNCTION ...]}
shift
[[ -n ${TESTS[$module]:-} ]] || { echo "mutate.sh: no scope for $module; add it to SCOPES in mutate.sh" >&2; exit 2; }
command -v mutmut >/dev/null || { echo "mutate.sh: mutmut is missing; pip install -r requirements-dev.txt" >&2; exit 2; }
functions=("$@")
[[ ${#functions[@]} -gt 0 ]] || read -r -a functions <<< "$(echo ${FUNCTIONS[$module]})"

here=$(cd "$(dirname "$0")" && pwd)
work=${MUTATE_DIR:-$(mktemp -d)}
mkdir -p "$work"
(cd "$here" && git ls-files --cached --others --exclude-standard -z | xargs -0 cp --parents -t "$work")
name=${module%.py}
# mutmut reads a list option one item a line
cat > "$work/setup.cfg" <<CFG
[mutmut]
source_paths = .
only_mutate = $module
pytest_add_cli_args_test_selection =
$(printf '    %s\n' ${TESTS[$module]})
pytest_add_cli_args =
    -p
    no:cacheprovider
    -q
CFG
globs=()
for f in "${functions[@]}"; do  # mutmut's names: module.x_function__mutmut_N, module.xǁClassǁmethod__mutmut_N
  if [[ $f == *.* ]]; then globs+=("$name.xǁ${f%%.*}ǁ${f#*.}__mutmut_*"); else globs+=("$name.x_${f}__mutmut_*"); fi
done
cd "$work"
echo "mutate.sh: $module, ${#functions[@]} functions, tests ${TESTS[$module]}, in $work" >&2
start=$(date +%s)
mutmut run --max-children "${JOBS:-2}" "${globs[@]}" | tail -n +1
end=$(date +%s)  # (a $(( $(...) )) here was read as a command substitution)
echo "mutate.sh: $((end - start)) s; survivors: cd $work && mutmut results; mutmut show NAME" >&2
