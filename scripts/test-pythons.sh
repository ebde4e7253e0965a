#!/usr/bin/env bash
# Run the tests on the other Python versions aiodist supports, each that this machine has
# (scripts/test.sh runs them on python3, 3.11 here, which is not run again):
#
#   bash scripts/test-pythons.sh                  # the fast subset below, on 3.12 and 3.13
#   bash scripts/test-pythons.sh tests            # the whole suite on each (slow tests too)
#   bash scripts/test-pythons.sh 3.13 tests/test_sync_api.py -x
#
# A version's interpreter is python3.X on PATH, else pyenv's newest 3.X; a version the
# machine lacks is skipped with a line that says so. Each gets its own virtualenv (.venv312,
# .venv313) with aiodist and its test and documentation tools, installed again only when
# the interpreter or pyproject.toml changed. Torch's wheel is for Python 3.11 only, so the
# torch interoperability tests skip there. Pytest runs in a private network namespace with
# only loopback where the machine allows it, as in scripts/test.sh. The exit status is
# non-zero if any run failed.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSIONS=(3.12 3.13)

# The fast subset: every module of aiodist (the CUDA backend's only as far as it runs without a
# GPU), each transport (tcp, shm, local, and the two-level routing over tcp and shm), both
# event loops (the tests marked both_loops run on uvloop and on the standard loop, and the
# blocking facade's loop thread runs on each) and both APIs (async, and aiodist.sync), with
# the launcher, the stores, serving and the Ray and Dask integrations. It takes seconds where
# the whole suite takes minutes; each entry is a cheap test of the part named before it.
FAST=(
  # transports; a close in the turn the peer's messages arrive
  tests/test_transport_conformance.py tests/test_transport_local.py
  tests/test_transport_tcp.py::test_exchange_both_directions
  tests/test_transport_tcp.py::test_closing_as_soon_as_the_exchange_ends
  tests/test_transport_shm.py::test_send_before_and_after_the_receive_is_posted
  tests/test_transport_shm.py::test_closing_in_order_versus_aborting
  tests/test_transport_shm.py::test_one_mailbox_shared_with_a_tcp_transport_routes_per_peer
  tests/test_two_level.py::test_all_gather tests/test_two_level.py::test_plan_hosts_over_the_store
  # the async API: collectives over tcp and shm, point-to-point, objects, groups, work handles
  tests/test_api_collectives.py::test_all_reduce
  tests/test_api_collectives.py::test_broadcast_src_and_group_src
  tests/test_api_collectives.py::test_reduce
  tests/test_api_collectives.py::test_all_to_all_single_even_and_uneven
  tests/test_api_collectives.py::test_barrier_and_monitored_barrier
  tests/test_api_collectives.py::test_local_transport_runs_the_same_api
  tests/test_api_p2p.py tests/test_api_objects.py tests/test_api_groups.py
  tests/test_api_shared_arrays.py tests/test_api_parity.py
  --deselect tests/test_api_parity.py::test_blocking_parity_in_processes
  tests/test_api_work.py::test_await_twice_state_and_repr
  tests/test_api_errors.py::test_mismatch_between_ranks_is_an_error_everywhere
  tests/test_api_errors.py::test_destroy_with_operation_in_flight
  tests/test_ops_arrays.py tests/test_ops_layer.py tests/test_operations.py tests/test_mismatch.py
  tests/test_collectives_shm.py::test_all_to_all_blocks_of_any_size
  tests/test_collectives_shm.py::test_calls_issued_at_once_run_in_call_order
  # the blocking API (aiodist.sync) and its loop thread, standard and uvloop
  tests/test_sync_api.py::test_init_rules_single_rank
  tests/test_sync_api.py::test_blocking_calls_from_several_threads
  tests/test_sync_api.py::test_destroy_leaves_no_thread_or_socket
  tests/test_sync_store.py::test_torch_style_tcp_store_usage
  tests/test_sync_store.py::test_fork_child_gets_its_own_loop_thread
  tests/test_sync_store.py::test_one_loop_thread_that_callers_may_stand_in_for_and_no_policy_change
  tests/test_sync_store.py::test_loop_kind_from_the_environment
  tests/test_sync_wait.py tests/test_asyncio_internals.py
  tests/test_eager.py::test_an_operation_that_can_end_at_once_is_born_done_and_the_loop_still_runs
  tests/test_eager.py::test_a_blocking_call_stands_in_for_an_idle_loop_thread_and_hands_over_to_a_busy_one
  # stores and rendezvous
  tests/test_hash_store_smoke.py
  tests/test_file_prefix_store.py::test_prefix_store_nesting_and_listing
  tests/test_file_prefix_store.py::test_file_store_reads_only_the_new_tail
  'tests/test_store_conformance.py::test_store_conformance[uvloop-tcp]'
  tests/test_store_tcp.py::test_values_counters_and_compare_set
  tests/test_store_tcp.py::test_get_waits_for_another_client
  tests/test_store_tcp.py::test_auth_refuses_torch_clients_unless_allowed
  tests/test_store_tcp_faults.py::test_torch_requests_split_byte_by_byte_are_parsed
  tests/test_rendezvous.py::test_tcp_rendezvous_of_four_ranks
  tests/test_rendezvous.py::test_env_rendezvous_of_four_ranks
  tests/test_cluster_env.py::test_slurm_task_derives_the_master_from_the_node_list_and_the_job_id
  tests/test_environment_table.py tests/test_security.py::test_ranks_with_the_same_token_talk
  # the launcher, spawn, ranks that end or fail, membership, health, debugging, status
  tests/test_launcher.py::test_bad_flags_are_named
  tests/test_launcher.py::test_failure_names_first_failing_rank_and_stops_the_others
  tests/test_launcher_preload.py::test_a_preloaded_worker_runs_its_script_as_python_would
  tests/test_exits.py::test_spawn_raises_the_first_failure_with_its_traceback
  tests/test_exits.py::test_a_store_wait_timeout_is_a_store_error_as_in_torch
  tests/test_faults.py::test_store_killed
  tests/test_membership.py::test_a_rank_leaves_by_choice_and_the_others_go_on_renumbered
  tests/test_health.py::test_abort_reaches_every_rank_and_wait_aborted_returns_the_cause
  tests/test_debug.py::test_recorder_holds_the_ops_in_order
  tests/test_debug.py::test_cli_reports_mismatched_ops
  tests/test_status.py::test_the_view_says_when_the_store_has_no_world
  tests/test_status.py::test_an_endpoint_on_every_interface_is_recorded_under_the_host_name
  tests/test_metrics.py
  # serving, the integrations, the testing helpers, the CUDA backend's CPU-side parts
  tests/test_serving.py::test_a_tensor_parallel_call_equals_numpy
  tests/test_serving_http.py::test_an_application_takes_one_controller
  tests/test_serving_http.py::test_fastapi_setup_keeps_the_applications_own_lifespan
  tests/test_ray.py::test_create_group_checks_its_arguments
  tests/test_dask.py::test_a_sync_function_runs_collectives_on_every_worker
  tests/test_testing_world.py::test_run_world_names_the_rank_that_failed_first
  tests/test_pytest_plugin.py::test_without_pytest_asyncio
  tests/test_cuda_tables.py tests/test_cuda_backend.py
  tests/test_cuda_progress.py::test_bad_naps_and_the_shared_thread
  tests/test_cuda_staged.py::test_send_recv
)

# The interpreter for version $1, or nothing.
find_python() {
  local latest
  if command -v "python$1" >/dev/null && "python$1" -c '' 2>/dev/null; then
    command -v "python$1"
  elif command -v pyenv >/dev/null && latest=$(pyenv latest "$1" 2>/dev/null) &&
    [ -x "$(pyenv root)/versions/$latest/bin/python$1" ]; then
    echo "$(pyenv root)/versions/$latest/bin/python$1"
  fi
}

# Pytest with arguments $2... in version $1's virtualenv, set up first if needed.
run_tests() {
  local version=$1 python venv
  shift
  python=$(find_python "$version")
  if [ -z "$python" ]; then
    echo "Python $version: not on this machine (neither python$version nor pyenv has it); skipped"
    return 0
  fi
  venv=".venv${version/./}"
  # Set up again when the interpreter or pyproject.toml changed. (Called where a failure
  # does not stop the script: each step says whether it failed. --no-compile: imports
  # compile what they use; compiling everything was a third of the set-up's time.)
  local stamp="$venv/aiodist-setup"
  if ! cmp -s "$stamp" <(echo "$python" && cat pyproject.toml); then
    "$python" -m venv "$venv" &&
      "$venv/bin/python" -m pip install -q --no-compile -e '.[test,docs]' &&
      { echo "$python" && cat pyproject.toml; } >"$stamp" || return 1
  fi
  echo "== Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())')"
  # The outer limit turns a hang that no per-test timeout could interrupt into a failure.
  local limit=(timeout --kill-after=30 3000)
  if unshare -n true 2>/dev/null; then
    "${limit[@]}" unshare -n bash -c 'ip link set lo up && exec "$0"/bin/pytest "$@"' "$venv" "$@"
  else
    "${limit[@]}" "$venv/bin/pytest" "$@"
  fi
}

versions=()
if [[ ${1:-} =~ ^3\.[0-9]+$ ]]; then
  versions=("$1")
  shift
else
  # Not python3's own version: scripts/test.sh runs the whole suite on it.
  default=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  for version in "${VERSIONS[@]}"; do
    [ "$version" = "$default" ] || versions+=("$version")
  done
fi
[ $# -gt 0 ] || set -- "${FAST[@]}"
# The tests marked slow too (the test command leaves them out on python3 and .ci/run runs
# them there after it): the subset names some, and the whole suite means all but torch's
# job, whose torch wheel is for 3.11 only.
[[ " $* " == *" -m "* ]] || set -- -m "slow or not torch_suite" "$@"
failed=()
for version in "${versions[@]}"; do
  run_tests "$version" "$@" || failed+=("$version")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "tests failed on Python ${failed[*]}" >&2
  exit 1
fi
