#!/usr/bin/env bash
# Mutation testing of the correctness core with cargo-mutants (https://mutants.rs):
# each mutant (a function body replaced, an operator flipped, …) is built and the tests
# that cover its file are run; a mutant that no test fails on is "missed" and means a
# gap in the tests. Kept out of scripts/test.sh: every mutant is an incremental build
# plus multi-process tests, so a file takes tens of minutes to hours on 2 cores.
#
#   scripts/mutants.sh                 every file below
#   scripts/mutants.sh ddp optim       some of them (by the names below; optim is its
#                                      five files' entries, shard its eight, rendezvous
#                                      the store's, job token's, network's and join's)
#   scripts/mutants.sh --list [NAMES]  list the mutants only (no builds)
#   scripts/mutants.sh NAMES -- ARGS   ARGS go to cargo-mutants (e.g. --shard 1/4)
#
# cargo-mutants (pinned) is installed into .tools/ on first use. It mutates, in place,
# a copy of the working tree in target/mutants/tree (kept, so later runs build
# incrementally), where the workspace's binaries (tchrun, the workers) are built first.
# Results go to target/mutants/NAME/mutants.out (caught.txt, missed.txt, timeout.txt,
# unviable.txt); the script ends with a table of the counts per file.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
export OMP_NUM_THREADS=1
MUTANTS_VERSION=27.0.0
MUTANTS="$ROOT/.tools/bin/cargo-mutants"
if [ "$("$MUTANTS" mutants --version 2>/dev/null)" != "cargo-mutants $MUTANTS_VERSION" ]; then
  echo "mutants: installing cargo-mutants $MUTANTS_VERSION into $ROOT/.tools (first run only)" >&2
  cargo install cargo-mutants --version "$MUTANTS_VERSION" --locked --root "$ROOT/.tools"
fi

# NAME -> the file it mutates and the test targets (of the workspace) that cover
# it. tchrun, which those tests start, is built once unmutated: it only launches.
declare -A FILE TESTS PACKAGE  # PACKAGE: the file's crate, if not tch-distributed
FILE[ddp]=sdk/src/ddp.rs;                  TESTS[ddp]="ddp accumulation parity adapting error_hints stalled_ranks entry_errors outside_optimizer"
# The optimizer, file by file (`optim` names all four): its step and accumulation
# (mod.rs) under every test that trains through it; its kernels under the tests that
# compare updates with torch.optim, tch and closed forms; its state under the
# checkpoint tests; ZeRO under the ZeRO tests.
FILE[optim_mod]=sdk/src/optim/mod.rs;          TESTS[optim_mod]="ddp parity accumulation amp adapting optimizer_settings optimizer_parity optimizer_state zero sharding grad_scaler loader_epochs error_hints outside_optimizer"
FILE[optim_kernels]=sdk/src/optim/kernels.rs;  TESTS[optim_kernels]="optimizer_parity optimizer_settings optimizer_state parity grad_scaler"
FILE[optim_state]=sdk/src/optim/state.rs;      TESTS[optim_state]="optimizer_state optimizer_parity zero sharding"
FILE[optim_zero]=sdk/src/optim/zero.rs;        TESTS[optim_zero]="zero parity"
FILE[optim_scaler]=sdk/src/optim/scaler.rs;    TESTS[optim_scaler]="grad_scaler amp accumulation"
# The run's settings: the table's parsers, precedence, the file, the ranks' variables,
# the attribute's overrides, and the settings' effect on a run.
FILE[settings]=settings/src/lib.rs;        TESTS[settings]="run_config settings tracker shakespeare error_hints"; PACKAGE[settings]=tch-distributed-settings
# Replacing a file whole (checkpoints, the run configuration, the tracker's config).
FILE[files]=sdk/src/files.rs;              TESTS[files]="checkpoint run_config tracker"
# Autocast and the loss scaler; the main job's LSTM under fp16 and bf16 (shakespeare)
# is what fails where oneDNN's lower precision is not turned off on a CPU that lacks it.
FILE[amp]=sdk/src/amp.rs;                  TESTS[amp]="amp accumulation grad_scaler shakespeare ui"
# When CPU autocast turns oneDNN off (fp16 always, bf16 without AVX-512), and the
# banner's reason: the main job's LSTM under fp16 fails where oneDNN stays on.
FILE[precision]=sdk/src/precision.rs;      TESTS[precision]="amp shakespeare"
FILE[sampler]=sdk/src/data/sampler.rs;     TESTS[sampler]="sampler data_loading shuffles"
FILE[loader]=sdk/src/data/loader.rs;       TESTS[loader]="data_loading accumulation checkpoint loader_epochs progress"
FILE[state]=sdk/src/checkpoint/state.rs;   TESTS[state]="checkpoint grad_scaler preemption zero shakespeare loader_epochs"
# The sharded loops: their shards, their ends, their positions that restarts resume.
FILE[data]=sdk/src/data/mod.rs;            TESTS[data]="data_loading adapting shuffles shakespeare different_paths"
# Not in ALL (not the correctness core, and the multi-host tests need root): which
# address Gloo binds across hosts, and how a failed connection is named.
FILE[network]=sdk/src/rendezvous/network.rs;   TESTS[network]="multi_node error_hints launch"
# The job token: its prefix, check value and the sealing of the store's values.
FILE[job_token]=sdk/src/rendezvous/job_token.rs; TESTS[job_token]="security multi_node"
# The store's views (prefix, sealed, clone) and key listing; the errors' messages.
FILE[store]=sdk/src/rendezvous/store.rs;   TESTS[store]="security multi_node launch"
# The count at rendezvous: who joined, who is missing, sizes that differ.
FILE[join]=sdk/src/rendezvous/join.rs;     TESTS[join]="rendezvous_counts"
# What ranks that take different paths agree on: a sharded loop's exits and its end
# behind a filter, checked against one process.
FILE[agreement]=sdk/src/runtime/agreement.rs; TESTS[agreement]="different_paths adapting"
# The collectives' records: a timeout's diagnosis and the deadlock check.
FILE[collective_record]=sdk/src/process_group/collective_record.rs; TESTS[collective_record]="different_paths stalled_ranks"
# ZeRO stages 2 and 3, file by file (`shard` names all seven): the engine (the units of
# an optimizer, when a bucket is complete, the steps), the collectives (the buckets'
# reduce-scatters and the agreement on which members had a gradient), a unit's
# parameters (their shard, gathers, reshards, reads and loads by rows), one parameter
# (its rows cut, copied out of a gather, freed), the units
# around their passes (and sharded as built), the shim's hooks; and the dim-0 layout,
# which ZeRO-1 cuts its shards by too. The model's file, written a variable at a time
# and read by rows.
FILE[shard_engine]=sdk/src/shard/engine.rs; TESTS[shard_engine]="sharding frozen activation"
FILE[shard_params]=sdk/src/shard/param_group.rs; TESTS[shard_params]="sharding frozen activation"
FILE[shard_param]=sdk/src/shard/param.rs;   TESTS[shard_param]="sharding frozen"
# The learning-rate schedules, against LambdaLR with the reference formulas, and the
# DeepSpeed file's scheduler block read into one; the file's optimizer block over the
# program's optimizer; the other tools' files read into the settings.
FILE[schedule]=sdk/src/schedule.rs;           TESTS[schedule]="schedules guide_configs"
FILE[optim_deepspeed]=sdk/src/optim/deepspeed.rs; TESTS[optim_deepspeed]="guide_configs"
FILE[foreign]=settings/src/foreign.rs;        TESTS[foreign]="guide_configs"; PACKAGE[foreign]=tch-distributed-settings
# The readers of DeepSpeed's and Accelerate's files, under the settings crate's own unit
# tests only (no TESTS): each mutant rebuilds that crate alone (~3 s, not a rebuild of
# the SDK and its workers), and those tests read every key (all mutants caught).
FILE[ds_config]=settings/src/deepspeed.rs;    TESTS[ds_config]=""; PACKAGE[ds_config]=tch-distributed-settings
FILE[accelerate]=settings/src/accelerate.rs;  TESTS[accelerate]=""; PACKAGE[accelerate]=tch-distributed-settings
# Hybrid sharding's groups (shard_group): one host's 2 × 2 and two hosts'.
FILE[mesh]=sdk/src/mesh.rs;                  TESTS[mesh]="sharding multi_node"
FILE[shard_offload]=sdk/src/shard/offload.rs; TESTS[shard_offload]="sharding"
FILE[shard_unit]=sdk/src/shard/unit.rs;     TESTS[shard_unit]="sharding frozen activation"
FILE[model_file]=sdk/src/checkpoint/model_file.rs; TESTS[model_file]="sharding frozen checkpoint"
FILE[shard_collectives]=sdk/src/shard/collectives.rs; TESTS[shard_collectives]="sharding frozen"
FILE[shard_hooks]=sdk/src/shard/hooks.rs;   TESTS[shard_hooks]="sharding activation"
FILE[shard_layout]=sdk/src/shard/layout.rs; TESTS[shard_layout]="sharding zero"
# The generators the ranks agree on (`AgreedSeed`): the same numbers inside the guard on
# every rank, each rank's own after it.
FILE[rng]=sdk/src/rng.rs;                  TESTS[rng]="shuffles"
# Activation checkpointing: the block's recompute through the shim's node, against the
# plain model under DDP, accumulation, autocast and ZeRO-3 units.
FILE[activation]=sdk/src/recompute.rs; TESTS[activation]="activation"
# Distributed inference: the contiguous split, its padding, and the gather's order.
FILE[split]=sdk/src/data/split.rs;          TESTS[split]="inference"
# Retrying with half the batch on out of memory, every rank together.
FILE[batch_retry]=sdk/src/data/executable_batch_size.rs; TESTS[batch_retry]="executable_batch_size"
# debug = "detail": c10d's wrapper's mismatch, in the SDK's words.
FILE[mismatch]=sdk/src/process_group/mismatch.rs; TESTS[mismatch]="collective_checks"
FILE[error]=sdk/src/error.rs;              TESTS[error]="error_hints"
# What the attribute's rewritten calls run: the optimizer `.build` makes, the steps of
# optimizers the function did not build and the DDP averaging them, save/load.
FILE[rewrites]=sdk/src/runtime/rewrites.rs; TESTS[rewrites]="outside_optimizer adapting accumulation amp error_hints settings"
# The attribute's reading of the function: which calls it finds (a forward pass for
# autocast, inside closures too; the optimizers `.build` makes), under the ui cases.
FILE[macro_analysis]=sdk-macros/src/analysis.rs; TESTS[macro_analysis]="ui"; PACKAGE[macro_analysis]=tch-distributed-macros
ALL=(ddp rewrites optim_mod optim_kernels optim_state optim_zero optim_scaler amp precision settings files sampler loader data state agreement collective_record shard_engine shard_collectives shard_params shard_param shard_unit shard_hooks shard_layout shard_offload mesh model_file schedule optim_deepspeed foreign ds_config accelerate rng activation split batch_retry macro_analysis)
# A NAME that stands for several.
declare -A GROUP
GROUP[optim]="optim_mod optim_kernels optim_state optim_zero optim_scaler"
GROUP[rendezvous]="store job_token network join"
GROUP[shard]="shard_engine shard_collectives shard_params shard_param shard_unit shard_hooks shard_layout shard_offload"
# NAME -> tests of those targets to skip for it (they exercise none of its paths and
# take long): the preemption-signal runs, which only deliver signals and check a
# checkpoint that the other checkpoint tests check too.
declare -A SKIP
SKIP[loader]="ctrl_c_in_a_terminal a_signal_to_every_process_of_the_job"
# NAME -> the only tests of those targets to run for it (a libtest name filter): those
# that exercise its paths, where the rest of a target takes long and never reaches
# them (offload runs only when the setting asks for it).
declare -A ONLY
ONLY[shard_offload]="offloaded_shards"
ONLY[mesh]="hybrid_sharding"
ONLY[shard_param]="stages_2_and_3_train_as_ddp a_frozen_base_with_adapters variables_read_between buckets_of_the_cap"

list=""
if [ "${1:-}" = --list ]; then
  list=--list
  shift
fi
names=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do
  if [ -n "${GROUP[$1]:-}" ]; then
    names+=(${GROUP[$1]})
  else
    names+=("$1")
  fi
  shift
done
[ "${1:-}" != -- ] || shift
extra=("$@")
[ ${#names[@]} -gt 0 ] || names=("${ALL[@]}")

TREE="$ROOT/target/mutants/tree"
if [ -z "$list" ]; then
  sync_tree "$TREE"
  (cd "$TREE" && cargo build --workspace --bins)
else
  TREE="$ROOT"  # listing reads the sources only
fi

summary=""
for name in "${names[@]}"; do
  file="${FILE[$name]:?unknown name $name: use one of ${ALL[*]}}"
  # Builds and tests the SDK's own unit tests (--lib) and, of the tests package, the
  # covering test targets (and the workers they start), not its other targets, the
  # examples, the book's listings or the benchmarks: --cargo-arg reaches the build
  # (`cargo test --no-run`) as well as the test run, so each mutant's build links only
  # those.
  args=(--dir "$TREE" --file "$file" --package "${PACKAGE[$name]:-tch-distributed}")
  if [ -n "${TESTS[$name]}" ]; then
    args+=(--test-package tch-distributed --test-package tch-distributed-tests
      --test-package tch-distributed-settings --cargo-arg=--lib)
  else
    # No TESTS: the mutated crate's own tests.
    args+=(--test-package "${PACKAGE[$name]:-tch-distributed}")
  fi
  for t in ${TESTS[$name]}; do
    args+=("--cargo-arg=--test=$t")
  done
  # After cargo-mutants' own `--`, its arguments go to `cargo test` as they are: the
  # second `--` sends the skips on to the test binaries.
  harness=(${ONLY[$name]:-})
  for t in ${SKIP[$name]:-}; do
    harness+=(--skip "$t")
  done
  if [ -n "$list" ]; then
    "$MUTANTS" mutants --list "${args[@]}" "${extra[@]}"
    continue
  fi
  out="$ROOT/target/mutants/$name"
  mkdir -p "$out"
  echo "mutants: $file, tests: ${TESTS[$name]}" >&2
  # Exit codes 2 (mutants missed) and 3 (timeouts) are results, reported below; others
  # (1: usage, 4: the tests fail without any mutant) stop the script.
  # --baseline=skip: cargo-mutants runs its unmutated baseline on the mutated package's
  # own tests only (not --test-package's), where these --test targets do not exist.
  # The tree is the working tree, which scripts/test.sh checks; the timeout is fixed.
  "$MUTANTS" mutants "${args[@]}" --in-place --output "$out" --baseline=skip --timeout 600 \
    --build-timeout 900 "${extra[@]}" ${harness[@]+-- -- "${harness[@]}"} \
    || { rc=$?; [ $rc -eq 2 ] || [ $rc -eq 3 ] || exit $rc; }
  count() {
    local n=0
    [ ! -f "$out/mutants.out/$1.txt" ] || n=$(grep -c . "$out/mutants.out/$1.txt" || true)
    echo "$n"
  }
  summary+="$(printf '%-28s caught %4s  missed %4s  timeout %4s  unviable %4s' \
    "$file" "$(count caught)" "$(count missed)" "$(count timeout)" "$(count unviable)")"$'\n'
done
[ -n "$list" ] || printf '\nmutants per file:\n%s' "$summary"
