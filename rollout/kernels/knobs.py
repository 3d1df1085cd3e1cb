"""Where a decode knob lives: the module constants ``scripts/bench.py --decode-knobs`` and
``bench/kernels_bench.py`` set for an A/B (read at each call, so engines built later use them)."""

from __future__ import annotations

from types import ModuleType


def knob_module(name: str) -> ModuleType:
    """paged_decode's constants, the stream split's own (STREAM_WAVES, STREAM_SEGS) where paged_decode has none
    of that name, or programmatic dependent launch's (PDL). The projections' GEMM knobs are per layer
    (``rollout.layers.gemm_tune.route_rows``), not module constants."""
    import rollout.kernels.paged_decode as pd
    import rollout.kernels.paged_decode_stream as ps
    import rollout.kernels.pdl as pdl

    mods = (pd, ps, pdl)
    for mod in mods:
        if hasattr(mod, name) and name.isupper():
            return mod
    raise ValueError(f"no decode knob named {name!r} in {', '.join(m.__name__ for m in mods)}")
