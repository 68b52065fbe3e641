"""Test-session hooks."""

import os
import shutil
import tempfile

import jax
import pytest

_CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"

_FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                       "--xla_cpu_use_fusion_emitters=false")

_started = {}  # module name -> (module, what its start_background() returned)


def _in_xdist_worker() -> bool:
    return os.environ.get("PYTEST_XDIST_WORKER") is not None


def _has_background(item) -> bool:
    return "background" in getattr(item, "fixturenames", ())


def pytest_configure(config):
    """One persistent compilation cache for the whole session: its xdist workers and the subprocesses of
    its tests (they inherit the environment) load a program another module already compiled instead of
    compiling it again. Compilation is most of the suite's time on a CPU, and many modules compile the
    same tiny-model rounds. The directory is fresh for each session (removed at its end) unless the
    caller names one in ``JAX_COMPILATION_CACHE_DIR``."""
    if _CACHE_DIR not in os.environ:  # the controller, or a session without workers
        os.environ[_CACHE_DIR] = tempfile.mkdtemp(prefix="ddtree-jax-tests-")
        config.stash[_owned_cache] = os.environ[_CACHE_DIR]
    # Every program is written. Writing only those that took a second or more to compile makes one
    # process faster (two modules alone: 74 -> 65-69 s) but the suite no faster (963 -> 961 s on a clean
    # clone): the small programs other workers load make up for it.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    # The tests' programs are small and most run a few times: XLA's CPU backend spends longer
    # generating their machine code than running it. The lowest optimization level (two modules:
    # 292 s -> 208 s) and the older loop emitters for fusions instead of the MLIR ones (two more
    # modules: 164 -> 115 s of CPU time, compiling a tiny DDTree generate 9.0 -> 4.6 s) change how the
    # programs are compiled, not what they compute (float sums may round differently). Set before the
    # backend starts, in the environment that the tests' subprocesses inherit.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_FAST_COMPILE_FLAGS}".strip()
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_DIR])
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


_owned_cache = pytest.StashKey[str]()


def pytest_unconfigure(config):
    owned = config.stash.get(_owned_cache, None)
    if owned is not None:
        shutil.rmtree(owned, ignore_errors=True)
        del os.environ[_CACHE_DIR]


# The modules that take longest, longest first: their CPU seconds in a run of the suite on two cores
# (2026-12-03). The workers take whole modules in collection order (``--no-loadscope-reorder``), so the
# long ones start early and the short ones fill the end: both workers finish at about the same time.
# xdist's own order (most tests first) left the long modules with few tests for last.
_LONGEST_FIRST = ("test_pallas_tree_sampling", "test_engine", "test_engine_budget", "test_budget_cli", "test_bench",
                  "test_pallas_tree_attention", "test_pallas_qk_norm_rope", "test_training", "test_tree",
                  "test_bench_tp", "test_cli", "test_qwen3", "test_verify", "test_selection", "test_pallas_matmul",
                  "test_sweep", "test_tree_encodings")


def _schedule_key(item) -> tuple[bool, int]:
    name = item.module.__name__.rpartition(".")[2]
    rank = _LONGEST_FIRST.index(name) if name in _LONGEST_FIRST else len(_LONGEST_FIRST)
    return not _has_background(item), rank


def pytest_collection_modifyitems(session, config, items):
    """Under pytest-xdist, the modules with background work go first, so that their subprocesses start at
    once and overlap everything else; then the longest modules (`_LONGEST_FIRST`), then the rest."""
    if _in_xdist_worker():
        items.sort(key=_schedule_key)  # stable: the order within each module stays


def pytest_collection_finish(session):
    """Start the background work of every collected module whose selected tests use ``background``.

    Not in a pytest-xdist worker: every worker collects every test, so each module's fixture starts its
    own when its worker gets to it (first, see `pytest_collection_modifyitems`)."""
    if session.config.option.collectonly or _in_xdist_worker():
        return
    for item in session.items:
        module = getattr(item, "module", None)
        if _has_background(item) and module.__name__ not in _started:
            _started[module.__name__] = module, module.start_background()


@pytest.fixture(scope="module")
def background(request):
    """What the module's ``start_background()`` returned: subprocesses started when the session's tests
    were collected, so that they run beside the modules before this one (the module's own fixtures wait
    for their results); ``stop_background(started)`` ends and cleans them up after the module."""
    module = request.module
    started = _started.pop(module.__name__, (module, None))[1] or module.start_background()
    yield started
    module.stop_background(started)


def pytest_sessionfinish(session):
    """Stop the background work of modules that did not get to run (an interrupted session)."""
    while _started:
        module, started = _started.popitem()[1]
        module.stop_background(started)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
    """Drop JAX's compiled executables after each test module.

    Every CPU executable keeps a few memory mappings alive. The suite compiles thousands of programs
    (hypothesis draws many shapes): three modules alone leave about 23,000 mappings, and the whole
    suite would pass the kernel's per-process limit (``vm.max_map_count``, usually 65,530), after
    which XLA's compiler crashes the process.
    """
    yield
    jax.clear_caches()
