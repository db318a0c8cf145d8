"""Test-session defaults: offline, the real data mirror, a fresh store per test, one Prefect server per worker."""

from __future__ import annotations

import contextlib
import inspect
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Never touch the network from tests: the hub fails at once instead of retrying for a minute.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `-n 2` (pyproject): one torch thread per worker and per process a test starts; two workers with two
    # OpenMP threads each would oversubscribe 2 cores, and spinning threads wait on each other
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"

# The CPU's bf16 units as none, so `train.mixed_precision: auto` trains in fp32 whatever CPU runs the suite (its
# tolerances are fp32's); tests of the detection inject capabilities (tests/stages/test_train.py).
os.environ.setdefault("FINETUNE_CPU_BF16_UNITS", "")

from cluster import PREFECT_DB  # noqa: E402
from crashsafe_scheduling import pytest_xdist_make_scheduler  # noqa: E402, F401  (a dead worker never hangs the run)
from helpers import SHARED_DATA, SHARED_FILES  # noqa: E402  (after the offline settings: helpers imports the stages)

os.environ.setdefault("FINETUNE_DATA_MIRROR", str(SHARED_DATA))


_SESSION_CACHE = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """Under CI (CI=true, what .ci/run is given) a missing ../shared/data fails the run at once, in one line,
    instead of skipping the ~90 tests that need it; a local checkout without it still skips them.

    One FINETUNE_CACHE for the session (made here, in the process that starts the xdist workers, which inherit
    it): SmolLM2's GGUF is converted once for all tests (stages/models/gguf.py), never read from the user's
    ~/.cache; a test about that cache sets its own. The Prefect servers tests/cluster.py starts (the worker's
    below, the bench's) copy one migrated database from there; a test about a fresh home starts its own."""
    missing = [f for f in SHARED_FILES if not (SHARED_DATA / f).exists()]
    if os.environ.get("CI", "").lower() in ("true", "1") and missing:
        raise pytest.UsageError(f"CI=true and the real data mirror lacks {SHARED_DATA}/{missing[0]}: put ../shared "
                                "beside the checkout (the tests that read it would otherwise be skipped)")
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        config.stash[_SESSION_CACHE] = os.environ["FINETUNE_CACHE"] = tempfile.mkdtemp(prefix="finetune-tests-cache-")
        # the migrated Prefect database the servers of tests/cluster.py copy (made by the first that asks)
        os.environ[PREFECT_DB] = os.path.join(os.environ["FINETUNE_CACHE"], "prefect-template", "prefect.db")


def pytest_unconfigure(config: pytest.Config) -> None:
    if (cache := config.stash.get(_SESSION_CACHE, None)) is not None:
        shutil.rmtree(cache, ignore_errors=True)


# The `slow` tests (`make test-fast` = pytest -m "not slow and not cluster" leaves them out): each took >= 10 s
# in the --durations profile of issue 27 (two busy cores), by file; every test that uses the worker's Prefect
# server (below) is slow too. A name here that no longer matches a test is an error, so the list stays true.
SLOW = {
    "tests/stages/test_chat_eval.py": ("test_the_baseline_is_the_untuned_model_on_the_same_rows",),
    "tests/common/test_gguf.py": ("test_the_converted_folders_load_what_transformers_gives_from_the_file",),
    "tests/common/test_quiet.py": (
        "test_a_pipeline_without_quantization_or_8bit_optimizers_never_imports_bitsandbytes",
    ),
    "tests/engine/test_code_fingerprint.py": (
        "test_editing_anything_a_stage_ran_changes_that_stages_key",
        "test_editing_code_no_stage_reaches_changes_no_key",
        "test_every_function_and_value_a_stage_runs_is_in_its_key",
    ),
    "tests/docs/test_doc_blocks.py": ("test_the_shell_blocks_run_as_the_doc_says",),  # README's: 50 s
    "tests/engine/test_retrain_digest.py": (  # two processes per model kind
        "test_a_forced_retrain_in_another_process_and_store_folder_leaves_evaluate_and_export_cached",
    ),
    "tests/engine/test_gc_live.py": ("test_gc_in_a_loop_beside_a_running_variant_takes_nothing_it_reads_or_commits",),
    "tests/engine/test_store_robustness.py": (
        "test_editing_a_helper_reruns_the_stage_that_calls_it",
        "test_kill_9_at_random_points_never_leaves_a_cached_partial",
        "test_two_concurrent_runs_compute_each_stage_once",
    ),
    "tests/engine/test_tracking.py": (
        "test_a_tracked_run_holds_its_config_history_metrics_and_keys_and_a_cached_rerun_the_same",
        "test_a_server_killed_mid_run_costs_one_warning_and_the_run_finishes",
    ),
    "tests/engine/test_store_readonly.py": (
        "test_a_read_only_store_serves_a_fully_cached_run_and_refuses_one_that_computes_before_prefect_starts",
    ),
    "tests/engine/test_store_s3.py": (
        "test_dead_holders_lease_expires_a_live_holders_never",
        "test_an_s3_endpoint_that_does_not_answer_is_one_line_before_prefect_starts",
        "test_an_s3_server_that_dies_mid_run_is_one_line",
        "test_two_machines_racing_for_one_key_exactly_one_wins",
    ),
    "tests/flows/test_demo.py": (
        "test_demo_tiny_slice_end_to_end_then_cached_without_prefect",
    ),
    "tests/flows/test_first_start.py": (
        "test_runs_started_at_once_on_a_fresh_prefect_home_migrate_once_and_print_no_traceback",
    ),
    "tests/flows/test_flow.py": (
        "test_a_stopped_run_crashes_and_stops_its_temporary_server",
        "test_kill_9_leaves_no_server_and_the_next_run_marks_it_crashed",
        "test_a_prefect_server_killed_mid_run_ends_the_run_with_one_line",
        "test_a_prefect_api_url_server_killed_mid_run_ends_the_run_with_one_line",
    ),
    "tests/flows/test_gc_results.py": (
        "test_gc_force_keeps_every_child_of_a_sweep_and_a_set_variant",
    ),
    "tests/flows/test_server_home.py": (
        "test_a_command_line_run_appears_in_the_server_the_readme_starts",
    ),
    "tests/flows/test_sweep.py": (
        "test_compare_lists_runs_not_yet_run_and_stale_results",
        "test_sigterm_ends_the_parallel_children_and_the_temporary_server",
    ),
    "tests/flows/test_two_machines.py": (
        "test_a_run_killed_with_its_machine_resumes_on_the_other_from_the_shared_checkpoint",
        "test_a_sweep_on_a_work_pool_spreads_over_two_workers_sharing_one_s3_store",
    ),
    "tests/stages/test_export_gguf.py": (
        "test_the_gguf_files_are_checked_in_llama_cpp_and_predict_as_torch",
        "test_a_tampered_gguf_file_fails_its_check_and_nothing_is_committed",
    ),
    "tests/stages/test_chat_export.py": (
        "test_a_chat_export_carries_its_template_left_padding_and_the_end_of_turn_stop",
        "test_a_prompt_completion_export_generates_the_evaluated_texts_from_a_left_padded_batch",
        "test_apply_chat_template_and_generate_on_a_batch_reproduce_the_evaluated_answers",
        "test_chat_on_an_export_without_a_chat_template_is_one_line_exit_2",
        "test_predict_chat_gives_the_evaluated_answers_batched_or_one_at_a_time",
        "test_predict_on_an_export_folder_imports_no_prefect_or_store",
        "test_the_cards_snippet_answers_a_batch_of_conversations",
    ),
    "tests/flows/test_serve_model.py": (  # the exports and the server are the first test's setup
        "test_chat_through_the_openai_client_equals_predict_chat_streamed_or_not_and_batched",
        "test_the_api_key_a_full_queue_503_and_sigterm_finishing_the_request_in_flight",
    ),
    "tests/stages/test_data.py": (
        "test_imdb_split_reproduces_the_article",
    ),
    "tests/stages/test_distributed.py": (
        "test_a_config_error_in_a_launched_process_is_the_stage_error_of_its_class",
        "test_a_crashed_process_is_a_clear_stage_error_and_the_rerun_resumes",
        "test_a_two_process_run_killed_mid_train_resumes_on_another_machine_from_the_s3_store",
        "test_the_stage_on_two_machines_each_with_its_own_store",
        "test_the_stage_with_two_processes_through_the_store",
        "test_two_machines_by_1x2_match_one_process_by_1x4_across_a_crash",
    ),
    "tests/stages/test_evaluate.py": (
        "test_rouge_equals_an_independent_rouge_score_computation_on_100_real_bills",
    ),
    "tests/stages/test_export_onnx.py": (  # one export with onnx (~20 s), shared by these
        "test_the_onnx_files_are_checked_in_onnxruntime_and_predict_as_torch",
        "test_a_tampered_onnx_file_fails_its_check_and_nothing_is_committed",
        "test_onnx_for_a_generating_task_and_runtime_onnx_without_the_file_are_one_line",
    ),
    "tests/stages/test_export_standalone.py": (
        "test_a_hub_base_exports_the_adapter_with_its_id_and_pinned_commit",
        "test_export_loads_alone_and_reproduces_the_evaluated_predictions",
        "test_the_cards_usage_snippet_runs_as_written",
    ),
    "tests/stages/test_model.py": (
        "test_smollm2_gguf_causal_lm",
        "test_smollm2_gguf_classifier_then_from_store",
    ),
    "tests/stages/test_rerun_evaluate.py": (
        "test_only_evaluate_from_the_command_line_runs_one_stage",
    ),
    "tests/stages/test_resume.py": (
        "test_kill_9_at_a_random_step_then_rerun_resumes_and_matches",
    ),
    "tests/stages/test_train_health.py": (
        "test_kill_9_after_the_best_step_then_rerun_keeps_the_same_best_and_stops_at_the_same_step",
        "test_two_processes_stop_early_together_with_the_same_best",
    ),
    "tests/test_suite_faults.py": ("test_a_worker_that_dies_fails_its_test_and_the_run_ends",),
    "tests/test_types.py": (
        "test_stages_and_flows_are_type_clean",
    ),
    "tests/test_wheel.py": (
        "test_installed_wheel_runs_tiny_imdb_outside_the_repo",
    ),
}


# The files that take longest (sum of their tests' --durations on two busy cores, issue 27), longest first, are
# collected first: `-n 2 --dist loadfile --no-loadscope-reorder` hands files to the workers in collection order,
# and a 90-s file handed out last ran alone on one core while the other was idle. Only the order changes; a file
# not named keeps its place.
LONGEST_FIRST = ("tests/bench/test_bench_heavy.py", "tests/bench/test_benches.py", "tests/flows/test_flow.py",
                 "tests/stages/test_chat_export.py", "tests/stages/test_distributed.py",
                 "tests/flows/test_two_machines.py", "tests/stages/test_export_standalone.py",
                 "tests/flows/test_user_session.py", "tests/flows/test_sweep.py", "tests/flows/test_serve.py",
                 "tests/flows/test_serve_model.py", "tests/docs/test_doc_blocks.py",
                 "tests/engine/test_store_robustness.py", "tests/test_wheel.py")


@pytest.hookimpl(tryfirst=True)  # before --deselect / --lf drop items
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {f: i for i, f in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))  # stable: the rest in place
    seen = set()
    for item in items:
        file, _, name = item.nodeid.partition("::")
        name = name.split("[")[0]
        if name in SLOW.get(file, ()) or "prefect_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
            seen.add((file, name))
    collected = {item.nodeid.partition("::")[0] for item in items}
    stale = [f"{f}::{n}" for f, names in SLOW.items() if f in collected for n in names if (f, n) not in seen]
    whole_files = not any("::" in a for a in config.args)
    if stale and whole_files and not config.getoption("keyword") and not config.getoption("markexpr"):
        raise pytest.UsageError(f"tests/conftest.py SLOW names tests that do not exist: {', '.join(stale)}")


@pytest.fixture
def store_dir(tmp_path, monkeypatch) -> Path:
    """A fresh artifact store for this test (FINETUNE_STORE points at it)."""
    root = tmp_path / "store"
    monkeypatch.setenv("FINETUNE_STORE", str(root))
    return root


@pytest.fixture(scope="session")
def mlflow_url(tmp_path_factory) -> Iterator[str]:
    """A real MLflow tracking server (sqlite, 127.0.0.1) for this test process, started by the first test that
    asks (about 9 s). Tests that share it each log to an experiment of their own."""
    from mlflowserver import mlflow_server

    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as (url, _):
        yield url


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """An S3 API on 127.0.0.1 (moto's server) for this test session, with bucket `finetune-test`; boto's
    standard settings (AWS_ENDPOINT_URL, dummy keys) point this process and its children at it."""
    from s3server import moto_server, s3_env

    with moto_server() as endpoint:
        saved = {k: os.environ.get(k) for k in s3_env(endpoint)}
        os.environ.update(s3_env(endpoint))
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir("finetune-test")
        try:
            yield endpoint
        finally:
            s3fs.S3FileSystem.clear_instance_cache()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> Iterator[str]:
    """One real `prefect server start` per test process (xdist worker), started by the first test that asks
    and shared by all the others (in-process flows, served deployments, command lines given its URL): each
    server start costs 12-30 s on two busy cores. Yields the API URL; this process's Prefect settings point
    at it from then on (what prefect_test_harness does, for the session). Tests that share it read back only
    their own flow runs (by id) or their own store; a test about the temporary server, or about a server's
    own home, starts its own."""
    from cluster import server
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    tmp = tmp_path_factory.mktemp("prefect-server")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp / "home"), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
               PREFECT_UI_ENABLED="false", PREFECT_SERVER_UI_ENABLED="false", PREFECT_SERVER_LOGGING_LEVEL="WARNING")
    with server(env, tmp) as api, temporary_settings({PREFECT_API_URL: api}), \
            _temporary_global_settings_context(get_settings_context()):
        yield api
        _drain_prefect_workers()  # this process's queued logs and events reach the server before it stops


def _drain_prefect_workers() -> None:
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain() -> None:
        with contextlib.suppress(RuntimeError):  # never started
            if inspect.isawaitable(result := APILogWorker.instance().drain()):
                await result
        if inspect.isawaitable(result := EventsWorker.drain_all()):
            await result

    run_coro_as_sync(drain())
