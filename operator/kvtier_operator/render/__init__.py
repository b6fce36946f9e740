"""Renderers: a validated policy (plus facts about the target container) in, engine configuration out.

Pure functions: no I/O, no cluster access. The operator applies what they return; ``kvtier render`` prints it.
Only enabled tiers are rendered, so the SLO guard disables a tier by changing the set passed in; where the engine
can bypass a tier live (vLLM with backend kvtier), a tier the guard disabled stays rendered and is listed in the
control file instead, so the decision needs no restart.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from ..api import v1alpha1 as api
from ..api.validation import PolicyInvalid, parse_policy
from .model import CONFIG_DIR, CONFIG_FILE, CONTROL_FILE, RenderedConfig, RenderError, TargetFacts, remote_scope
from .trtllm import render_trtllm
from .vllm import render_vllm

__all__ = ["CONFIG_DIR", "CONFIG_FILE", "CONTROL_FILE", "RenderedConfig", "RenderError", "TargetFacts", "detect_engine",
           "effective_tiers", "render"]


def detect_engine(facts: TargetFacts) -> str:
    """``vllm`` or ``trtllm`` from the container's image, command and args."""
    words = " ".join([facts.image or "", *facts.command, *facts.args]).lower()
    if "trtllm" in words or "tensorrt" in words:
        return "trtllm"
    if "vllm" in words:
        return "vllm"
    raise RenderError(
        f"spec.engine: cannot detect the engine of container {facts.container_name!r} "
        f"(image {facts.image!r}); set spec.engine to vllm or trtllm")


def effective_tiers(spec: api.KVCachePolicySpec, enabled: Optional[Iterable[str]] = None) -> list[api.TierSpec]:
    """Tiers to render: declared enabled, and (when given) in the enabled set. Which tiers are on is decided by
    ``tiers.derive`` (the operator passes its Enabled ones); this only maps names to their specs.

    A filesystem tier is reachable only through the cpu tier (every offloaded block passes through host memory),
    so with the cpu tier off nothing below it is rendered either.
    """
    allowed = None if enabled is None else set(enabled)
    tiers = [t for t in spec.tiers if t.enabled and (allowed is None or t.name in allowed)]
    if tiers and tiers[0].medium != "cpu":
        return []
    return tiers


def render(policy: api.KVCachePolicy, facts: Optional[TargetFacts] = None, *,
           engine: Optional[str] = None, enabled_tiers: Optional[Iterable[str]] = None,
           bypassed_tiers: Iterable[str] = (), config_map_name: Optional[str] = None) -> RenderedConfig:
    """Engine configuration for ``policy``.

    ``engine`` overrides ``spec.engine``; when both are unset it is detected from ``facts``. A detected engine is
    validated like a declared one, so engine-specific rules give the same messages either way.
    ``bypassed_tiers``: tiers the SLO guard disabled. An engine that reads the control file keeps them rendered and
    bypasses them live (``RenderedConfig.bypassed``); any other engine does not render them (a restart).
    """
    spec = policy.spec
    chosen = engine or spec.engine or (detect_engine(facts) if facts else None)
    if chosen is None:
        raise RenderError("spec.engine: unset and there is no container to detect it from; set spec.engine "
                          "or pass --engine")
    if chosen not in ("vllm", "trtllm"):
        raise RenderError(f"engine: {chosen!r} is not one of vllm, trtllm")
    if spec.engine != chosen:
        data = policy.model_dump(by_alias=True, exclude_none=True, mode="json")
        data["spec"]["engine"] = chosen
        try:
            policy = parse_policy(data)
        except PolicyInvalid as err:
            raise RenderError("; ".join(str(p) for p in err.problems)) from None
        spec = policy.spec
    live = chosen == "vllm" and spec.backend == "kvtier"
    bypass = set(bypassed_tiers) if live else set()
    tiers = effective_tiers(spec, None if enabled_tiers is None else [*enabled_tiers, *bypass])
    name = config_map_name or f"kvtier-{policy.metadata.get('name', 'policy')}"
    if chosen == "vllm":
        rendered = render_vllm(spec, tiers, name, scope=remote_scope(policy.metadata))
        rendered.bypassed = [t for t in rendered.tiers if t in bypass]
        return rendered
    return render_trtllm(spec, tiers, name)

