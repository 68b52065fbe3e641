"""Test-session hooks."""

import os

import jax
import pytest

_started = {}  # module name -> (module, what its start_background() returned)


def _in_xdist_worker() -> bool:
    return os.environ.get("PYTEST_XDIST_WORKER") is not None


def _has_background(item) -> bool:
    return "background" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(session, config, items):
    """Under pytest-xdist, the modules with background work go first (whole modules go to one worker,
    ``--dist loadfile``), so that their subprocesses start at once and overlap everything else."""
    if _in_xdist_worker():
        items.sort(key=lambda item: not _has_background(item))  # stable: the order within each group stays


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
