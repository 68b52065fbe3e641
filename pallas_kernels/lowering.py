"""Lower a function's Pallas kernels to Triton IR without a GPU, and verify the IR.

The Triton module a kernel lowers to is checked by the MLIR verifier only when the GPU
runtime parses it; verifying it here finds invalid IR (for instance loop bounds of mixed
integer types) on any machine. Relies on JAX internals (the Triton lowering entry point),
so it is a development and test aid, not part of the kernels' API.
"""

from __future__ import annotations

from unittest import mock

import jax
from jax._src.pallas.triton import lowering as triton_lowering


def verified_triton_modules(fn, *args) -> list[str]:
    """Lower ``jax.jit(fn)(*args)`` for CUDA and return the text of each verified Triton module.

    ``args`` may be arrays or ``jax.ShapeDtypeStruct``s. Raises ``ValueError`` naming the
    kernel when the MLIR verifier rejects a module.
    """
    modules = []
    lower = triton_lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*a, **kw):
        result = lower(*a, **kw)
        module = result.module
        with module.context:
            try:
                module.operation.verify()
            except Exception as err:  # noqa: BLE001 (the MLIR error type is not public)
                raise ValueError(f"invalid Triton IR: {err}") from None
            modules.append(str(module))
        return result

    with mock.patch.object(triton_lowering, "lower_jaxpr_to_triton_module", lower_and_verify):
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return modules
