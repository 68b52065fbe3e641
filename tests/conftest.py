"""Test-session hooks."""

import jax
import pytest


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
