"""Test-session hooks."""

import jax
import pytest

_started = {}  # module name -> (module, what its start_background() returned)


def pytest_collection_finish(session):
    """Start the background work of every collected module whose selected tests use ``background``."""
    if session.config.option.collectonly:
        return
    for item in session.items:
        module = getattr(item, "module", None)
        if "background" in getattr(item, "fixturenames", ()) and module.__name__ not in _started:
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
