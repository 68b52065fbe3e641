"""Experiment drivers, kept apart from the runtime: ``bench`` (``ddtree bench``), ``sweep``
(``ddtree sweep``), device-op ``profiling``, acceptance ``stats`` over prompts and the stdlib
``corpus`` the embedded pair is trained and evaluated on.

Nothing in the runtime (``ddtree_jax`` outside this package) imports from here.
"""
