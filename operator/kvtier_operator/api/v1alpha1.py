"""The ``kvtier.io/v1alpha1`` ``KVCachePolicy`` API.

These models are the single source of truth: the CRD in ``crds/`` is generated from them (``kvtier crd``), and
``kvtier validate`` checks a policy with them plus the very CEL rules the API server runs (see ``crd.py``).
Cross-field rules are written once, as CEL, on the model they constrain.
"""
from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, Literal, Optional

from kvtier_runtime.config import (
    ADMISSION_POLICIES,
    CODECS,
    DEFAULT_ADMISSION_THRESHOLD,
    DEFAULT_EVICTION_POLICY,
    DEFAULT_TRACE_FILES,
    DEFAULT_TRACE_MAX_BYTES,
    EVICTION_POLICIES,
    MAX_REMOTE_URL_CHARS,
    MAX_TRACE_BYTES,
    MAX_TRACE_FILES,
    MIN_TRACE_FILE_BYTES,
    REMOTE_CA_TLS_RULE,
    REMOTE_KEY_RULE,
    REMOTE_URL_CREDENTIALS_RULE,
    REMOTE_URL_HOST_PORT_RULE,
    REMOTE_URL_QUERY_RULE,
    REMOTE_URL_REGEX,
    ConfigError,
    check_remote_url,
    default_eviction_policy,
)
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from .. import selectors
from . import paths
from .guard_state import SLOGuardState
from .units import DURATION_PATTERN, POSITIVE_QUANTITY_PATTERN, parse_duration, parse_quantity

GROUP = "kvtier.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "KVCachePolicy"
PLURAL = "kvcachepolicies"
SINGULAR = "kvcachepolicy"
SHORT_NAMES = ["kvp"]

MAX_TIERS = 4
# status.slo.history keeps the newest entries up to this many (the guard trims to it).
HISTORY_LIMIT = 50
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
ABS_PATH_PATTERN = r"^/[^\x00]*$"
# `[.]` rather than `\.`: the pattern is embedded in a CEL string literal, where `\.` is not a valid escape.
TRTLLM_DISK_CACHE_VERSION = r"^(1[.]([3-9]|[1-9][0-9])|[2-9]|[1-9][0-9]+)([.][0-9A-Za-z.+-]*)?$"
# The name becomes the value of the kvtier.io/policy label on workloads, and label values hold 63 characters.
MAX_POLICY_NAME = 63
# Sizes are rendered as byte counts (int64 in the engines and in Kubernetes quantities); 1Pi is far above any
# real host-memory or disk tier and far below int64, so sums of sizes cannot overflow either.
MAX_QUANTITY = "1Pi"
# Longest wait for one Prometheus query: an evaluation runs three, and it must finish well within an interval.
MAX_PROMETHEUS_TIMEOUT = "60s"
# Longest spec.slo.idleWindow: a rate over a day of a few counters is cheap, and longer outlives most retention.
MAX_IDLE_WINDOW = "24h"
# Path rules live in api.paths (the one normaliser); the CEL texts below are built from them.
SYSTEM_PATH_RULE = paths.SYSTEM_PATH_RULE
NOT_NORMAL_RULE = paths.NOT_NORMAL_RULE
DOT_SEGMENT_RULE = paths.DOT_SEGMENT_RULE
# Class C (catch-all selectors in disguise): the Python side is selectors.has_positive_term/requirement_problem.
SELECTOR_POSITIVE_RULE = ("(has(self.matchLabels) && self.matchLabels.size() > 0) || (has(self.matchExpressions) && "
                          "self.matchExpressions.exists(e, e.operator == 'In' || e.operator == 'Exists'))")
SELECTOR_VALUES_RULE = ("(self.operator == 'In' || self.operator == 'NotIn') ? "
                        "(has(self.values) && self.values.size() > 0) : (!has(self.values) || self.values.size() == 0)")
CEL_DURATION_PATTERN = r"^([0-9]+([.][0-9]+)?(ms|s|m|h))+$"


def _rule(rule: str, message: str | None = None, *, message_expression: str | None = None,
          field_path: str | None = None, reason: str | None = None) -> dict[str, str]:
    out = {"rule": rule}
    if message:
        out["message"] = message
    if message_expression:
        out["messageExpression"] = message_expression
    if field_path:
        out["fieldPath"] = field_path
    if reason:
        out["reason"] = reason
    return out


# Rule texts that depend on spec.engine, by engine. The operator detects an unset engine from the container and
# re-checks exactly these (the API server saw no engine); declared here, next to each rule, not guessed from its text.
ENGINE_RULES: dict[str, set[str]] = {}


def _engine_rule(engine: str, rule: str, *args: Any, **kwargs: Any) -> dict[str, str]:
    ENGINE_RULES.setdefault(engine, set()).add(rule)
    return _rule(rule, *args, **kwargs)


def _cel(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


# Kubernetes quantities may be written as integers (bytes) or suffixed strings; both are kept as written.
Quantity = Annotated[str, BeforeValidator(lambda v: str(v) if isinstance(v, int) and not isinstance(v, bool) else v)]


def _checked(check: Any) -> Any:
    def run(value: str) -> str:
        problem = check(value)
        if problem:
            raise paths.PathError(problem)
        return value
    return AfterValidator(run)


# Paths judged by api.paths on their normal form (the operator re-checks stored objects with these, so a policy
# stored before a CEL rule existed is refused with a message, never rendered or retried forever).
MountPath = Annotated[str, Field(pattern=ABS_PATH_PATTERN, max_length=4096), _checked(paths.mount_path_problem)]
HostPath = Annotated[str, Field(pattern=ABS_PATH_PATTERN, max_length=4096), _checked(paths.form_problem)]


def _quantity(description: str, **kwargs: Any) -> Any:
    # Kubernetes' CEL quantity library: the same upper bound for the integer and the string form.
    bound = _rule(f"!isQuantity(string(self)) || !quantity(string(self)).isGreaterThan(quantity('{MAX_QUANTITY}'))",
                  f"must be at most {MAX_QUANTITY}")
    return Field(description=description, pattern=POSITIVE_QUANTITY_PATTERN, max_length=64,
                 json_schema_extra={"x-kubernetes-int-or-string": True, **_cel(bound)}, **kwargs)


def _object_default(model: type[BaseModel]) -> dict[str, Any]:
    # The whole default object, not `{}`: the API server does not default fields inside a defaulted object,
    # and CEL rules must see the same fields `kvtier validate` sees.
    return {"default": model().model_dump(by_alias=True, exclude_none=True, mode="json")}


def _duration(description: str, default: str | None = None, *, positive: bool = False,
              maximum: str | None = None) -> Any:
    rules = []
    # Guarded by the pattern so that a malformed value gets the pattern's message, not a CEL evaluation error.
    if positive:
        rules.append(_rule(f"!self.matches('{CEL_DURATION_PATTERN}') || duration(self) > duration('0s')",
                           "must be greater than zero"))
    if maximum:
        rules.append(_rule(f"!self.matches('{CEL_DURATION_PATTERN}') || duration(self) <= duration('{maximum}')",
                           f"must be at most {maximum}"))
    extra = _cel(*rules) if rules else None
    return Field(default, description=description, pattern=DURATION_PATTERN, max_length=32,
                 json_schema_extra=extra)


class _Model(BaseModel):
    # strict: "16", "false" or "0.9" are strings, not numbers or booleans, as for the API server.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", strict=True)


# ---------------------------------------------------------------------------------------------- selection


class LabelSelectorRequirement(_Model):
    """One label requirement, as in a Kubernetes LabelSelector."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            _rule(SELECTOR_VALUES_RULE, selectors.VALUES_MESSAGE),
        )
    )
    key: str = Field(description="The label key the requirement applies to.", max_length=317)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(description="How key and values relate.")
    values: Optional[list[str]] = Field(
        None, description="Values for In and NotIn (at least one); must be empty for Exists and DoesNotExist.",
        max_length=64
    )

    @model_validator(mode="after")
    def _values(self) -> LabelSelectorRequirement:
        problem = selectors.requirement_problem(self.operator, self.values)
        if problem:
            raise paths.RuleError(problem)
        return self


class LabelSelector(_Model):
    """Selects Deployments and StatefulSets in the policy's namespace by their labels. It must name at least one
    label a workload carries (a matchLabels entry, or an In or Exists term): NotIn and DoesNotExist alone match
    every workload, and a catch-all selector would conflict with every policy of the namespace."""

    model_config = ConfigDict(
        json_schema_extra=_cel(_rule(SELECTOR_POSITIVE_RULE, selectors.CATCH_ALL_MESSAGE))
    )
    match_labels: Optional[dict[str, str]] = Field(None, description="Labels a workload must carry, all of them.")
    match_expressions: Optional[list[LabelSelectorRequirement]] = Field(
        None, description="Label requirements a workload must meet, all of them.", max_length=16
    )

    @model_validator(mode="after")
    def _not_catch_all(self) -> LabelSelector:
        if not selectors.has_positive_term(self.model_dump(by_alias=True, exclude_none=True)):
            raise paths.RuleError(selectors.CATCH_ALL_MESSAGE)
        return self


# ---------------------------------------------------------------------------------------------- GPU


class GPUSpec(_Model):
    """The GPU tier: the engine's own KV cache in GPU memory."""

    memory_utilization: Optional[float] = Field(
        None, gt=0, le=1,
        description="Fraction of GPU memory the engine may use (vLLM --gpu-memory-utilization, TensorRT-LLM "
                    "free_gpu_memory_fraction). Unset: the engine's default.",
    )
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto", description="KV cache data type in GPU memory (vLLM --kv-cache-dtype, TensorRT-LLM dtype).",
    )


# ---------------------------------------------------------------------------------------------- tiers


class EmptyDirSource(_Model):
    """An emptyDir volume."""

    medium: Optional[Literal["", "Memory"]] = Field(None, description="Storage medium; empty means node disk.")
    size_limit: Optional[Quantity] = _quantity("Size limit of the emptyDir.", default=None)


class HostPathSource(_Model):
    """A hostPath volume, e.g. a node-local NVMe mount."""

    path: HostPath = Field(description="Path on the node, in normal form; it must lie under a prefix the "
                                       "operator's admin allows (operator setting hostPathPrefixes).",
                           json_schema_extra=_cel(
                               _rule(f"!self.matches('{DOT_SEGMENT_RULE}')", paths.DOT_SEGMENT_MESSAGE),
                               _rule(f"!self.matches('{NOT_NORMAL_RULE}')", paths.NOT_NORMAL_MESSAGE)))
    type: Optional[Literal["", "Directory", "DirectoryOrCreate"]] = Field(None, description="hostPath type.")


class PersistentVolumeClaimSource(_Model):
    """An existing PersistentVolumeClaim."""

    claim_name: str = Field(description="Name of the claim in the policy's namespace.", pattern=NAME_PATTERN,
                            max_length=253)
    read_only: bool = Field(False, description="Mount read-only (a read-only tier serves hits but stores nothing).")


class VolumeSource(_Model):
    """Where a filesystem tier's bytes live: exactly one of emptyDir, hostPath, persistentVolumeClaim."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            _rule("[has(self.emptyDir), has(self.hostPath), has(self.persistentVolumeClaim)]"
                  ".filter(x, x).size() == 1",
                  "exactly one of emptyDir, hostPath or persistentVolumeClaim must be set")
        )
    )
    empty_dir: Optional[EmptyDirSource] = Field(None, description="A pod-lifetime emptyDir.")
    host_path: Optional[HostPathSource] = Field(None, description="A node-local path (survives pod restarts).")
    persistent_volume_claim: Optional[PersistentVolumeClaimSource] = Field(None, description="An existing claim.")


SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"


class SecretKeyRef(_Model):
    """A key in a Secret in the policy's namespace."""

    name: str = Field(description="Secret name.", pattern=NAME_PATTERN, max_length=253)
    # A Secret's data keys as Kubernetes allows them (ASCII letters, digits, '-', '_', '.'), never empty: the
    # schema's pattern, so the API server, `kvtier validate` and the operator refuse the same keys.
    key: str = Field(description="Key in the Secret.", pattern=SECRET_KEY_PATTERN, min_length=1, max_length=253)


# The Secret key of the previous tenant key when previousKey is unset: the current key's name plus this.
PREVIOUS_KEY_SUFFIX = ".previous"


PREVIOUS_KEY_RULE = "must differ from key: the previous tenant key is kept beside the current one"


class TenantKeyRef(_Model):
    """The tenant key's Secret key, and the key that held the previous tenant key while one is rotated."""

    model_config = ConfigDict(json_schema_extra=_cel(
        _rule("!has(self.previousKey) || self.previousKey != self.key", PREVIOUS_KEY_RULE,
              field_path=".previousKey")))

    name: str = Field(description="Secret name.", pattern=NAME_PATTERN, max_length=253)
    key: str = Field(description="Key in the Secret holding the current tenant key.", pattern=SECRET_KEY_PATTERN,
                     min_length=1, max_length=253 - len(PREVIOUS_KEY_SUFFIX))
    previous_key: Optional[str] = Field(
        None, description="Key in the same Secret holding the previous tenant key during a rotation (default: the "
                          "key's name plus .previous). Projected only while present: values written under it are "
                          "still read, new ones are written under the current key (docs/security.md, \"Rotating "
                          "the tenant key\").",
        pattern=SECRET_KEY_PATTERN, min_length=1, max_length=253)

    @property
    def previous(self) -> str:
        """The Secret key that holds the previous tenant key during a rotation."""
        return self.previous_key or f"{self.key}{PREVIOUS_KEY_SUFFIX}"

    @field_validator("previous_key")
    @classmethod
    def _previous_differs(cls, value: Optional[str], info: ValidationInfo) -> Optional[str]:
        # The CEL rule above, for `kvtier validate` and the operator's own parse (same message, same field).
        if value is not None and value == info.data.get("key"):
            raise paths.RuleError(PREVIOUS_KEY_RULE)
        return value


# The CEL side of kvtier_runtime.config.check_remote_url (the runtime re-checks with that function; the operator's
# validation runs it too, so `kvtier validate` and the API server agree on every rule below).
# Printable ASCII without spaces: the same set in RE2, Rust and Python (a `\s` class is Unicode-aware in some).
REMOTE_URL_PATTERN = r"^rediss?://[!-~]+$"
# A host (a name or an address, IPv6 in brackets) and a port, then at most a database number: the runtime's
# grammar itself, its backslashes doubled for the CEL string literal.
REMOTE_HOST_PORT_RULE = REMOTE_URL_REGEX.replace("\\", "\\\\")


def _remote_url(value: str) -> str:
    try:
        check_remote_url("url", value)
    except ConfigError as err:
        raise paths.RuleError(str(err).removeprefix("url: ")) from None
    return value


class RemoteStoreSpec(_Model):
    """A Valkey/Redis store (standalone or cluster mode) that every replica of the model shares."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            _rule("!has(self.caSecret) || self.url.startsWith('rediss://')", REMOTE_CA_TLS_RULE,
                  field_path=".caSecret"),
            _rule("has(self.macKeySecret)", REMOTE_KEY_RULE, field_path=".macKeySecret")))

    url: Annotated[str, AfterValidator(_remote_url)] = Field(
        description="Address of the store: redis://HOST:PORT[/DB] or rediss://HOST:PORT[/DB] (TLS). It must be "
                    "allowed by the operator's admin (operator setting remoteStoresAllowed); no credentials, query "
                    "or fragment.",
        pattern=REMOTE_URL_PATTERN, max_length=MAX_REMOTE_URL_CHARS,
        json_schema_extra=_cel(
            _rule("!self.matches('^rediss?://[^/?#]*@')", REMOTE_URL_CREDENTIALS_RULE),
            _rule("!self.contains('?') && !self.contains('#')", REMOTE_URL_QUERY_RULE),
            _rule(f"self.matches('^rediss?://[^/?#]*@') || self.contains('?') || self.contains('#') || "
                  f"self.matches('{REMOTE_HOST_PORT_RULE}')", REMOTE_URL_HOST_PORT_RULE)))
    password_secret: Optional[SecretKeyRef] = Field(
        None, description="Secret key holding the store's password (AUTH). It is mounted read-only into the serving "
                          "pods and sent only to an allowed store. The Secret must be annotated "
                          "kvtier.io/remote-stores with the store's host:port by someone who may edit Secrets.")
    mac_key_secret: Optional[TenantKeyRef] = Field(
        None,
        description="Required. Secret key holding the tenant's key (at least 32 bytes, e.g. `openssl rand 32`): "
                    "every block in the shared store is encrypted and authenticated (AES-256-GCM) under a key "
                    "derived from it, the policy's namespace and the model, so a client of the store without it "
                    "can neither read nor forge a block. Replicas that should share blocks need the same key and "
                    "namespace. The store password is never this key. Mounted read-only into the serving pods; the "
                    "Secret must be annotated kvtier.io/remote-stores like the password's.")
    username: Optional[str] = Field(
        None, description="The store's ACL user the password belongs to (Redis/Valkey 6+ ACLs: one user per "
                          "tenant, confined to the keys kvtier:<namespace>:*, docs/remote.md). Unset: the store's "
                          "default user.",
        pattern=r"^[A-Za-z0-9._-]+$", max_length=128)
    ca_secret: Optional[SecretKeyRef] = Field(
        None, description="Secret key holding the PEM CA bundle that signed the store's certificate (a private CA, "
                          "e.g. the ca.crt of a cert-manager certificate); the store is then verified against it "
                          "and the image's system CA bundle, host name included. Unset: the system CA bundle. rediss:// only. Mounted "
                          "read-only into the serving pods; the Secret must be annotated kvtier.io/remote-stores "
                          "like the password's, and a TLS Secret's private key (*.key) is refused.")

    @model_validator(mode="before")
    @classmethod
    def _key_given(cls, data: Any) -> Any:
        # An absent macKeySecret is validated as an explicit null under its own name, so the refusal below names
        # spec.tiers[i].remote.macKeySecret (a default is validated under the Python name).
        if isinstance(data, dict) and data.get("macKeySecret") is None and data.get("mac_key_secret") is None:
            data = {**data, "macKeySecret": None}
        return data

    @field_validator("mac_key_secret")
    @classmethod
    def _key_required(cls, value: Optional[TenantKeyRef]) -> Optional[TenantKeyRef]:
        # The CEL rule above, for `kvtier validate` and the operator's own parse (same message, same field).
        if value is None:
            raise paths.RuleError(REMOTE_KEY_RULE)
        return value

    @field_validator("ca_secret")
    @classmethod
    def _ca_needs_tls(cls, value: Optional[SecretKeyRef], info: ValidationInfo) -> Optional[SecretKeyRef]:
        # The CEL rule above, for `kvtier validate` and the operator's own parse (same message, same field).
        url = info.data.get("url")
        if value is not None and isinstance(url, str) and not url.startswith("rediss://"):
            raise paths.RuleError(REMOTE_CA_TLS_RULE)
        return value


class TierSpec(_Model):
    """One offload tier below the GPU."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            _rule("self.medium != 'filesystem' || (has(self.path) && has(self.volume))",
                  "a filesystem tier needs path and volume", field_path=".path"),
            _rule("self.medium != 'cpu' || (!has(self.path) && !has(self.volume))",
                  "a cpu tier takes no path or volume (it lives in /dev/shm)", field_path=".medium"),
            _rule("self.compression == 'none' || self.medium != 'cpu'",
                  "compression applies to filesystem and remote tiers only", field_path=".compression"),
            _rule("(self.medium == 'remote') == has(self.remote)",
                  "a remote tier needs remote (url), and only a remote tier takes it", field_path=".remote"),
            _rule("self.medium != 'remote' || (!has(self.path) && !has(self.volume))",
                  "a remote tier takes no path or volume (its bytes live in the store)", field_path=".medium"),
        )
    )
    name: str = Field(description="Tier name, unique in the policy; used in status, events and metrics.",
                      pattern=NAME_PATTERN, max_length=63)
    medium: Literal["cpu", "filesystem", "remote"] = Field(
        description="cpu: host RAM (at most one, and first); filesystem: a local disk such as NVMe; remote: a "
                    "Valkey/Redis store shared by every replica (backend kvtier; at most one, after the filesystem "
                    "tiers).")
    size: Quantity = _quantity("Capacity of the tier as a Kubernetes quantity, total across tensor-parallel ranks. "
                               "For a remote tier: kvtier's budget in the store for one model in this namespace, "
                               "shared by all its replicas there (the fleet-wide bound is the store's own "
                               "maxmemory).")
    enabled: bool = Field(True, description="Set false to declare a tier without using it. The SLO guard "
                                            "disables tiers in status, never here.")
    eviction_policy: Optional[Literal[EVICTION_POLICIES]] = Field(  # type: ignore[valid-type]
        None, description="Eviction policy. Unset: adaptive with backend kvtier (it hedges its learned ordering "
                          "against plain recency and stays within 0.005 of LRU, see docs/replay.md), lru otherwise. "
                          "Backend native runs lru and arc itself and any other policy of the cpu tier through "
                          "kvtier's CachePolicy plug-in (the serving image needs kvtier's runtime); lmcache and "
                          "trtllm run lru only.")
    _default_eviction: str = PrivateAttr(DEFAULT_EVICTION_POLICY)

    @property
    def eviction(self) -> str:
        """The tier's eviction policy: the one named, else the backend's default (set by KVCachePolicySpec)."""
        return self.eviction_policy or self._default_eviction

    admission: Literal[ADMISSION_POLICIES] = Field(  # type: ignore[valid-type]
        "none", description="Admission filter in front of eviction (backend kvtier only): none; doorkeeper "
                            "(store a block only once it is seen again, TinyLFU style); threshold (store after "
                            "spec.offload.storeThreshold offers).")
    path: Optional[MountPath] = Field(
        None, description="Mount path of a filesystem tier in the serving container, in normal form (no '//', "
                          "'.' or '..' segments, no trailing '/'); not a system path (/, /etc, /dev, /proc, /usr, "
                          "/var/run, ...) nor the operator's own /etc/kvtier and /dev/shm.",
        json_schema_extra=_cel(
            _rule(f"!self.matches('{DOT_SEGMENT_RULE}')", paths.DOT_SEGMENT_MESSAGE),
            _rule(f"!self.matches('{NOT_NORMAL_RULE}')", paths.NOT_NORMAL_MESSAGE),
            # Guarded so a non-normal path gets the rules above only: on normal paths it is paths.is_system_path.
            _rule(f"self.matches('{DOT_SEGMENT_RULE}') || self.matches('{NOT_NORMAL_RULE}') || "
                  f"!self.matches('{SYSTEM_PATH_RULE}')", paths.SYSTEM_PATH_MESSAGE)))
    volume: Optional[VolumeSource] = Field(None, description="Volume that backs a filesystem tier.")
    read_threads: int = Field(16, ge=1, le=256, description="I/O threads reading from a filesystem tier.")
    write_threads: int = Field(16, ge=1, le=256, description="I/O threads writing to a filesystem tier.")
    compression: Literal[CODECS] = Field(  # type: ignore[valid-type]
        "none", description="Codec for blocks stored in a filesystem or remote tier (backend kvtier only).")
    remote: Optional[RemoteStoreSpec] = Field(None, description="The store of a remote tier.")

    # Typed views (units parsed once, here; renderers read these, never the strings).
    @cached_property
    def size_bytes(self) -> int:
        return parse_quantity(self.size)


# ---------------------------------------------------------------------------------------------- offload


class OffloadSpec(_Model):
    """What is offloaded, and in what units."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            _rule("self.storeThreshold == 0 || self.storeThreshold >= 2",
                  "storeThreshold must be 0 (store every offer) or at least 2", field_path=".storeThreshold"),
        )
    )
    chunk_tokens: Optional[int] = Field(
        None, ge=1, le=1_048_576,
        description="Tokens per offloaded chunk (vLLM block_size); a multiple of spec.blockSize. "
                    "Unset: one GPU block per chunk.")
    prompt_only: bool = Field(
        False, description="Offload only prompt tokens (vLLM offload_prompt_only). False keeps generated tokens "
                           "too, which multi-turn conversations reuse.")
    store_threshold: int = Field(0, ge=0, le=1000, description="Store a chunk only after it was offered this "
                                                               "many times (vLLM store_threshold); 0 stores all.")
    min_priority: int = Field(35, ge=0, le=100, description="TensorRT-LLM secondary_offload_min_priority: "
                                                            "blocks with this retention priority or more are "
                                                            "offloaded.")
    recompute_tokens_per_second: Optional[int] = Field(
        None, ge=1, le=1_000_000_000,
        description="Tokens per second this engine prefills (recomputes) at, measured on its hardware. With it, "
                    "kvtier's runtime bypasses a tier whose loads cost more than recomputing the same tokens (a "
                    "breaker per tier, no restart) and probes it back; unset, tiers are bypassed only when the SLO "
                    "guard disables them. Needs backend kvtier.")

    # Typed views.
    @property
    def admission_threshold(self) -> int:
        """The offer on which ``admission: threshold`` stores a block: storeThreshold when set, else the
        runtime's default (storeThreshold 0 means "every offer" to vLLM, not "threshold 0")."""
        return self.store_threshold if self.store_threshold >= 2 else DEFAULT_ADMISSION_THRESHOLD


# ---------------------------------------------------------------------------------------------- trace

# Where the engine container records (an emptyDir the operator mounts; `kubectl cp` copies it out).
TRACE_DIR = "/var/lib/kvtier/trace"
TRACE_MAX_SIZE_RULE = f"must be at most {MAX_TRACE_BYTES // 2**30}Gi (the runtime's bound on a recording)"
TRACE_PER_FILE_RULE = (f"must hold at least {MIN_TRACE_FILE_BYTES // 1024}Ki per trace file (maxSize >= files x "
                       f"{MIN_TRACE_FILE_BYTES // 1024}Ki): a smaller file would rotate every few requests")
RECOMPUTE_BACKEND_RULE = ("offload.recomputeTokensPerSecond needs backend kvtier: the breaker that uses it is part "
                          "of kvtier's offloading spec")
TRACE_BACKEND_RULE = ("trace.enabled needs backend kvtier: the recorder is part of kvtier's offloading spec "
                      "(backends native and lmcache cannot record)")


# spec.events (docs/routing.md): vLLM's ZMQ publisher of KV cache events, for prefix-aware routers.
DEFAULT_EVENTS_ENDPOINT = "tcp://*:5557"
# tcp://*:PORT (bound in the pod) or tcp://HOST:PORT (the pod connects to an indexer that binds); PORT 1-65534 (a
# bound publisher's replay socket takes PORT+1).
EVENTS_ENDPOINT_PATTERN = (r"^tcp://(\*|[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\]):"
                           r"([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|6553[0-4])$")
EVENTS_MODEL_RULE = ("events.model must be set when events are enabled: the model name a router scores requests for "
                     "(what clients send, vLLM's --served-model-name) enters the topic kv@<pod IP>@<model>")
EVENTS_CHUNK_RULE = ("events.enabled needs one GPU block per offloaded chunk (spec.offload.chunkTokens unset or equal "
                     "to spec.blockSize): vLLM's KV events name an offloaded chunk by its last block only, and a "
                     "router's index scores a prefix block by block")
EVENTS_BACKEND_RULE = ("events.enabled needs backend kvtier or native: with backend lmcache the offloaded tiers are "
                       "LMCache's and announce nothing")


class EventsSpec(_Model):
    """KV cache events for prefix-aware routers (llm-d's KV-cache indexer, docs/routing.md): vLLM's ZMQ publisher
    announces the GPU prefix cache and every tier kvtier holds, each pod under topic ``kv@<pod IP>@<model>``."""

    model_config = ConfigDict(
        json_schema_extra=_cel(_rule("!self.enabled || has(self.model)", EVENTS_MODEL_RULE, field_path=".model")))
    enabled: bool = Field(False, description="Publish KV cache events (vLLM --kv-events-config) for every tier.")
    endpoint: str = Field(
        DEFAULT_EVENTS_ENDPOINT, max_length=300, pattern=EVENTS_ENDPOINT_PATTERN,
        description="Where vLLM's ZMQ publisher goes. tcp://*:PORT binds it in the pod (a router's indexer dials "
                    "each pod, as llm-d's pod discovery does), with the replay socket at PORT+1; tcp://HOST:PORT "
                    "connects it to an indexer that binds.")
    model: Optional[str] = Field(
        None, min_length=1, max_length=253, pattern=r"^[^@\s]+$",
        description="The model name a router scores requests for (what clients send: vLLM's --served-model-name); "
                    "the last part of the topic kv@<pod IP>@<model>. Required when enabled.")

    @property
    def binds(self) -> bool:
        """The publisher binds in the pod (an indexer dials it)."""
        return self.endpoint.startswith("tcp://*:")

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])


class TraceSpec(_Model):
    """Recording of the engine's own traffic for `kvtier replay` (docs/replay.md, "Record your own traffic")."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            # Integers, not a formatted quantity: the API server prices a string built from an int as unbounded.
            # Above 16Gi the other rule speaks (and asInteger cannot overflow on what reaches it).
            _rule(f"!isQuantity(string(self.maxSize)) || quantity(string(self.maxSize)).isGreaterThan("
                  f"quantity('{MAX_TRACE_BYTES // 2**30}Gi')) || "
                  f"quantity(string(self.maxSize)).asInteger() >= {MIN_TRACE_FILE_BYTES} * self.files",
                  TRACE_PER_FILE_RULE, field_path=".maxSize"),
        )
    )
    enabled: bool = Field(False, description=f"Record the requests kvtier's offloading spec sees, as a "
                                             f"Mooncake-format trace with a trace-meta.json sidecar, into an "
                                             f"emptyDir at {TRACE_DIR} in the serving container (backend kvtier). "
                                             f"An engine restart starts a new recording.")
    max_size: Quantity = Field(
        f"{DEFAULT_TRACE_MAX_BYTES // 2**20}Mi",
        description=f"What the trace files may hold in all; the oldest file is deleted first. At most "
                    f"{MAX_TRACE_BYTES // 2**30}Gi; the emptyDir is this plus 1Mi for the sidecar.",
        pattern=POSITIVE_QUANTITY_PATTERN, max_length=64,
        json_schema_extra={"x-kubernetes-int-or-string": True, **_cel(
            _rule(f"!isQuantity(string(self)) || !quantity(string(self)).isGreaterThan("
                  f"quantity('{MAX_TRACE_BYTES // 2**30}Gi'))", TRACE_MAX_SIZE_RULE))})
    files: int = Field(DEFAULT_TRACE_FILES, ge=1, le=MAX_TRACE_FILES,
                       description="How many files the trace rotates over (trace-000.jsonl, ...).")

    @field_validator("max_size")
    @classmethod
    def _at_most(cls, value: str) -> str:
        # The CEL rules here and above, for `kvtier validate` and the operator's own parse (same messages).
        if parse_quantity(value) > MAX_TRACE_BYTES:
            raise paths.RuleError(TRACE_MAX_SIZE_RULE)
        return value

    @model_validator(mode="after")
    def _per_file(self) -> TraceSpec:
        if self.max_size_bytes < MIN_TRACE_FILE_BYTES * self.files:
            raise paths.RuleError(f"maxSize: {TRACE_PER_FILE_RULE}")
        return self

    # Typed views.
    @cached_property
    def max_size_bytes(self) -> int:
        return parse_quantity(self.max_size)


# ---------------------------------------------------------------------------------------------- SLO


class PrometheusAuth(_Model):
    """Credentials for Prometheus: a bearer token, or basic auth."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            _rule("has(self.bearerToken) != (has(self.username) || has(self.password))",
                  "set bearerToken, or username and password, not both"),
            _rule("has(self.username) == has(self.password)", "username and password go together"),
        )
    )
    bearer_token: Optional[SecretKeyRef] = Field(None, description="Secret key holding a bearer token.")
    username: Optional[SecretKeyRef] = Field(None, description="Secret key holding the basic-auth user.")
    password: Optional[SecretKeyRef] = Field(None, description="Secret key holding the basic-auth password.")


class PrometheusSpec(_Model):
    """Where the SLO guard reads latency from."""

    url: str = Field(
        description="Base URL of the Prometheus HTTP API; it must be allowed by the operator's admin (operator "
                    "setting prometheusAllowed), and https unless the admin allows http.",
        pattern=r"^https?://[^\s]+$", max_length=2048,
        json_schema_extra=_cel(
            _rule("self.matches('^https?://[^/?#@:]')", "needs a host (https://host[:port][/path])"),
            _rule("!self.matches('^https?://[^/?#]*@')", "must not contain credentials (user:password@); use "
                                                         "spec.slo.prometheus.auth"),
            _rule("!self.contains('?') && !self.contains('#')",
                  "must not contain '?' or '#': give the base URL of the Prometheus API")))
    auth: Optional[PrometheusAuth] = Field(None, description="Credentials, read from Secrets.")
    ca_bundle: Optional[SecretKeyRef] = Field(None, description="Secret key holding a PEM CA bundle for TLS.")
    timeout: str = _duration("Total time one query may take (connect, wait and read).", "10s", positive=True,
                             maximum=MAX_PROMETHEUS_TIMEOUT)

    # Typed views.
    @cached_property
    def timeout_s(self) -> float:
        return parse_duration(self.timeout)


class QueryOverrides(_Model):
    """PromQL that replaces the built-in queries; each must return one scalar-like sample."""

    ttft_p99: Optional[str] = Field(None, description="Query for p99 time to first token, in seconds.",
                                    max_length=4096)
    itl_p99: Optional[str] = Field(None, description="Query for p99 inter-token latency, in seconds.",
                                   max_length=4096)
    request_rate: Optional[str] = Field(None, description="Query for requests per second.", max_length=4096)


class ReenableSpec(_Model):
    """How a tier the guard disabled comes back."""

    mode: Literal["manual", "auto"] = Field(
        "manual", description="manual: annotate kvtier.io/reenable=<tier> (or change the spec); auto: after "
                              "'after', on probation.")
    after: str = _duration("With mode auto: time after the rollback before the tier is tried again.", "1h")
    probation: str = _duration("With mode auto: a breach within this time after re-enabling disables the tier "
                               "again and stops automatic re-enabling until a person acts.", "30m")

    # Typed views.
    @cached_property
    def after_s(self) -> float:
        return parse_duration(self.after)

    @cached_property
    def probation_s(self) -> float:
        return parse_duration(self.probation)


class SLOSpec(_Model):
    """Latency objectives the SLO guard protects by disabling the newest tier on a sustained breach."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            _rule("has(self.ttftP99) || has(self.itlP99) || has(self.ttftP99MaxRatio) || has(self.itlP99MaxRatio)",
                  "an SLO needs at least one of ttftP99, itlP99, ttftP99MaxRatio, itlP99MaxRatio"),
        )
    )
    prometheus: PrometheusSpec = Field(description="Prometheus to query.")
    ttft_p99: Optional[str] = _duration("Threshold for p99 time to first token, e.g. 2s.", positive=True)
    itl_p99: Optional[str] = _duration("Threshold for p99 inter-token latency, e.g. 150ms.", positive=True)
    ttft_p99_max_ratio: Optional[float] = Field(
        None, gt=1, le=100, description="Threshold relative to the GPU-only baseline p99 TTFT (staged rollout).")
    itl_p99_max_ratio: Optional[float] = Field(
        None, gt=1, le=100, description="Threshold relative to the GPU-only baseline p99 ITL (staged rollout).")
    window: str = _duration("Window of each p99 (PromQL range).", "5m", positive=True)
    interval: str = _duration("Time between evaluations.", "30s", positive=True)
    consecutive_breaches: int = Field(3, ge=1, le=100, description="Breaches in a row that disable the newest "
                                                                   "enabled tier.")
    on_no_data: Literal["hold", "breach"] = Field(
        "hold", description="No data or too little traffic: hold (no verdict) or count as a breach.")
    min_request_rate: float = Field(0.2, ge=0, le=1_000_000, allow_inf_nan=False,
                                    description="Requests per second under which no verdict is taken.")
    cooldown: str = _duration("After a rollback, time before another tier may be disabled.", "15m")
    reenable: ReenableSpec = Field(default_factory=ReenableSpec, json_schema_extra=_object_default(ReenableSpec),
                                   description="How disabled tiers come back.")
    dry_run: bool = Field(False, description="Record what the guard would do, and do nothing.")
    model_name: Optional[str] = Field(None, description="Also match the engine's model_name label: narrows the "
                                                        "queries within the policy's own pods, never replaces them.",
                                      max_length=253)
    queries: Optional[QueryOverrides] = Field(None, description="Replace the built-in PromQL.")
    idle_window: str = _duration("Window of the idle check: an enabled tier whose hit ratio over it stays under 1% "
                                 "is reported by the TierIdle condition (informational; PromQL range).", "1h",
                                 positive=True, maximum=MAX_IDLE_WINDOW)

    # Typed views.
    @cached_property
    def ttft_p99_s(self) -> Optional[float]:
        return None if self.ttft_p99 is None else parse_duration(self.ttft_p99)

    @cached_property
    def itl_p99_s(self) -> Optional[float]:
        return None if self.itl_p99 is None else parse_duration(self.itl_p99)

    @cached_property
    def window_s(self) -> float:
        return parse_duration(self.window)

    @cached_property
    def interval_s(self) -> float:
        return parse_duration(self.interval)

    @cached_property
    def cooldown_s(self) -> float:
        return parse_duration(self.cooldown)

    @cached_property
    def idle_window_s(self) -> float:
        return parse_duration(self.idle_window)


class RolloutSpec(_Model):
    """How tiers are switched on."""

    strategy: Literal["immediate", "staged"] = Field(
        "immediate", description="immediate: all enabled tiers at once; staged: GPU-only first, then one tier "
                                 "per observation period while the SLO holds (needs spec.slo).")
    stage_observation: str = _duration("How long each stage must hold the SLO before the next.", "30m")

    # Typed views.
    @cached_property
    def stage_observation_s(self) -> float:
        return parse_duration(self.stage_observation)


class InjectionSpec(_Model):
    """How the operator touches the workload."""

    args: Literal["reference", "managed"] = Field(
        "reference", description="reference: your manifest passes the config file argument itself (GitOps-safe); "
                                 "managed: the operator owns the container args (no GitOps).")


# ---------------------------------------------------------------------------------------------- spec


class KVCachePolicySpec(_Model):
    """Desired KV-cache tiering for the selected serving workloads."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            _rule("self.tiers.all(t, self.tiers.filter(u, u.name == t.name).size() == 1)",
                  "tier names must be unique", field_path=".tiers"),
            _rule("self.tiers.size() == 0 || self.tiers[0].medium == 'cpu'",
                  "the first tier must be the cpu tier: every offloaded block passes through host memory",
                  field_path=".tiers"),
            _rule("self.tiers.filter(t, t.medium == 'cpu').size() <= 1", "at most one cpu tier",
                  field_path=".tiers"),
            # Paths are in normal form (the rule on each path), so two paths name one directory only when equal.
            # Pairwise with all(), not filter().size(): the API server's cost estimate refuses the latter here.
            _rule("self.tiers.all(t, self.tiers.all(u, t == u || !has(t.path) || !has(u.path) || "
                  "u.path != t.path))",
                  "filesystem tiers need distinct paths", field_path=".tiers"),
            _rule("!has(self.offload.chunkTokens) || self.offload.chunkTokens % self.blockSize == 0",
                  # format(), not string() + concatenation: the API server prices string(int) as unbounded.
                  message_expression="'%d is not a multiple of spec.blockSize (%d)'"
                                     ".format([self.offload.chunkTokens, self.blockSize])",
                  field_path=".offload.chunkTokens"),
            _rule("self.backend == 'kvtier' || self.tiers.all(t, t.medium != 'remote')",
                  "a remote tier needs backend kvtier", field_path=".backend"),
            _rule("self.tiers.filter(t, t.medium == 'remote').size() <= 1", "at most one remote tier",
                  field_path=".tiers"),
            _rule("self.backend == 'kvtier' || self.tiers.all(t, t.compression == 'none')",
                  "compression needs backend kvtier", field_path=".backend"),
            _rule("self.backend == 'kvtier' || self.tiers.all(t, t.admission == 'none')",
                  "admission filters need backend kvtier", field_path=".backend"),
            _rule("self.backend != 'native' || self.tiers.all(t, t.medium == 'cpu' || !has(t.evictionPolicy) || "
                  "t.evictionPolicy in ['lru', 'arc'])",
                  "backend native runs vLLM's own filesystem tier, which evicts nothing: set evictionPolicy lru "
                  "or arc on filesystem tiers, or use backend kvtier", field_path=".backend"),
            _rule("self.backend != 'lmcache' || self.tiers.all(t, !has(t.evictionPolicy) || t.evictionPolicy == 'lru')",
                  "backend lmcache supports evictionPolicy lru only", field_path=".backend"),
            _rule("self.backend != 'lmcache' || self.tiers.filter(t, t.medium == 'filesystem').size() <= 1",
                  "backend lmcache supports one filesystem tier (local_disk)", field_path=".tiers"),
            _engine_rule("trtllm", "!(has(self.engine) && self.engine == 'trtllm' && self.backend == 'lmcache')",
                  "engine trtllm does not support backend lmcache (LMCache integrates with vLLM)",
                  field_path=".backend"),
            _engine_rule("trtllm", "!(has(self.engine) && self.engine == 'trtllm' && self.backend == 'kvtier')",
                  "engine trtllm does not support backend kvtier (its plug-ins load into vLLM)",
                  field_path=".backend"),
            _engine_rule("trtllm", "!(has(self.engine) && self.engine == 'trtllm') || self.tiers.all(t, !has(t.evictionPolicy) || t.evictionPolicy == 'lru')",
                  "engine trtllm has one eviction policy for offloaded blocks: set evictionPolicy lru",
                  field_path=".tiers"),
            _engine_rule("trtllm", "!(has(self.engine) && self.engine == 'trtllm') || self.gpu.kvCacheDtype in ['auto', 'fp8']",
                  "engine trtllm supports gpu.kvCacheDtype auto or fp8", field_path=".gpu.kvCacheDtype"),
            _engine_rule("trtllm", "!(has(self.engine) && self.engine == 'trtllm') || "
                  "self.tiers.filter(t, t.medium == 'filesystem').size() <= 1",
                  "engine trtllm supports one filesystem tier (disk_cache_path)", field_path=".tiers"),
            _engine_rule("trtllm", "!(has(self.engine) && self.engine == 'trtllm') || "
                  "self.blockSize in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]",
                  message_expression="'TensorRT-LLM tokens_per_block must be a power of 2, not %d'"
                                     ".format([self.blockSize])",
                  field_path=".blockSize"),
            _engine_rule("trtllm", "!(has(self.engine) && self.engine == 'trtllm' && "
                  "self.tiers.exists(t, t.medium == 'filesystem')) || "
                  f"(has(self.engineVersion) && self.engineVersion.matches('{TRTLLM_DISK_CACHE_VERSION}'))",
                  "a filesystem tier with engine trtllm needs spec.engineVersion 1.3 or later (disk_cache_*)",
                  field_path=".engineVersion"),
            _rule("!(self.backend == 'native' && self.offload.storeThreshold >= 2 && "
                  "self.tiers.exists(t, t.medium == 'filesystem'))",
                  "vLLM rejects storeThreshold with a filesystem tier (TieringOffloadingSpec)",
                  field_path=".offload.storeThreshold"),
            _rule("!has(self.trace) || !self.trace.enabled || self.backend == 'kvtier'", TRACE_BACKEND_RULE,
                  field_path=".trace.enabled"),
            _rule("!has(self.events) || !self.events.enabled || !has(self.offload.chunkTokens) || "
                  "self.offload.chunkTokens == self.blockSize", EVENTS_CHUNK_RULE, field_path=".events.enabled"),
            _rule("!has(self.events) || !self.events.enabled || self.backend != 'lmcache'", EVENTS_BACKEND_RULE,
                  field_path=".events.enabled"),
            _engine_rule("trtllm", "!(has(self.engine) && self.engine == 'trtllm') || !has(self.events) || "
                  "!self.events.enabled",
                  "engine trtllm: spec.events is for vLLM's KV event publisher", field_path=".events.enabled"),
            _rule("!has(self.offload.recomputeTokensPerSecond) || self.backend == 'kvtier'", RECOMPUTE_BACKEND_RULE,
                  field_path=".offload.recomputeTokensPerSecond"),
            _rule("self.rollout.strategy != 'staged' || has(self.slo)",
                  "rollout.strategy staged needs spec.slo to observe each stage", field_path=".rollout.strategy"),
            _rule("!has(self.slo) || (!has(self.slo.ttftP99MaxRatio) && !has(self.slo.itlP99MaxRatio)) || "
                  "self.rollout.strategy == 'staged'",
                  "relative thresholds (ttftP99MaxRatio, itlP99MaxRatio) need rollout.strategy staged, which "
                  "records the baseline", field_path=".slo"),
        )
    )

    selector: LabelSelector = Field(description="Deployments and StatefulSets in this namespace to configure.")
    engine: Optional[Literal["vllm", "trtllm"]] = Field(
        None, description="Serving engine; detected from the container's image and command when unset.")
    engine_version: Optional[str] = Field(
        None, description="Engine version, where features depend on it (TensorRT-LLM disk cache needs 1.3+).",
        max_length=64, pattern=r"^[0-9]+(\.[0-9A-Za-z.+-]*)?$")
    container: Optional[str] = Field(None, description="Serving container name; default the first container.",
                                     max_length=63)
    block_size: int = Field(16, ge=1, le=1024, description="GPU KV block size in tokens (vLLM --block-size, "
                                                           "TensorRT-LLM tokens_per_block).")
    gpu: GPUSpec = Field(default_factory=GPUSpec, json_schema_extra=_object_default(GPUSpec),
                         description="GPU tier settings.")
    backend: Literal["native", "lmcache", "kvtier"] = Field(
        "native", description="native: the engine's own offloading; lmcache: LMCache (vLLM only); kvtier: "
                              "kvtier's runtime plug-ins inside vLLM (more policies, compression, a bounded "
                              "durable disk tier).")
    tiers: list[TierSpec] = Field(default_factory=list, max_length=MAX_TIERS, json_schema_extra={"default": []},
                                  description="Tiers below the GPU, hottest first. The last enabled tier is the "
                                              "newest: the SLO guard disables it first.")
    offload: OffloadSpec = Field(default_factory=OffloadSpec, json_schema_extra=_object_default(OffloadSpec),
                                 description="What is offloaded, and in what units.")
    host_memory_headroom: Quantity = _quantity("Memory added to /dev/shm and to the container's limit on top of "
                                          "the cpu tier, for the engine's own shared memory.", default="1Gi")
    slo: Optional[SLOSpec] = Field(None, description="Latency objectives guarded by automatic tier rollback.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, json_schema_extra=_object_default(RolloutSpec),
                                 description="How tiers are switched on.")
    injection: InjectionSpec = Field(default_factory=InjectionSpec, json_schema_extra=_object_default(InjectionSpec),
                                     description="How the operator touches the workload.")
    trace: Optional[TraceSpec] = Field(None, description="Record the engine's own traffic for kvtier replay "
                                                         "(backend kvtier).")
    events: Optional[EventsSpec] = Field(None, description="KV cache events for prefix-aware routers: every tier "
                                                           "announced (vLLM; docs/routing.md).")

    # Typed views.
    @cached_property
    def host_memory_headroom_bytes(self) -> int:
        return parse_quantity(self.host_memory_headroom)

    @model_validator(mode="after")
    def _resolve_eviction_policies(self) -> KVCachePolicySpec:
        # The default depends on the backend, which OpenAPI defaults cannot express: resolved once here, read as
        # TierSpec.eviction. The field itself stays unset, so a dump equals what the API server stores.
        for tier in self.tiers:
            tier._default_eviction = default_eviction_policy(self.backend)
        return self


# ---------------------------------------------------------------------------------------------- status


class Condition(_Model):
    """A Kubernetes-style condition."""

    type: str = Field(description="Condition type (Ready, Progressing, Degraded, Conflict, SLOUnknown, ...).",
                      max_length=316)
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason for the last transition.", max_length=1024)
    message: str = Field("", description="Human-readable details.", max_length=32768)
    last_transition_time: str = Field(description="When the status last flipped (RFC 3339).")
    observed_generation: Optional[int] = Field(None, ge=0, description="Policy generation this condition is for.")


class TierStatus(_Model):
    """Observed state of one tier."""

    name: str = Field(description="Tier name.")
    state: Literal["Enabled", "Disabled", "Pending"] = Field(
        description="Enabled: rendered; Disabled: removed (by the SLO guard or the spec); Pending: waiting for "
                    "its stage.")
    reason: str = Field("", description="Why the tier is in this state.")
    since: Optional[str] = Field(None, description="When it entered this state (RFC 3339).")
    hit_ratio: Optional[float] = Field(
        None, ge=0, le=1, allow_inf_nan=False,
        description="Share of the prompt tokens looked up in kvtier that this tier served over spec.slo.window "
                    "(vllm:kv_offload_kvtier_hit_tokens_total{tier} / lookup_tokens_total, the policy's pods), "
                    "rounded to 3 decimals; measured by the SLO guard, informational. Absent: no lookups in the "
                    "window, or the tier is not enabled.")


class TargetStatus(_Model):
    """Observed state of one target workload."""

    kind: Literal["Deployment", "StatefulSet"] = Field(description="Workload kind.")
    name: str = Field(description="Workload name.")
    state: str = Field(description="Applied, Conflict, Refused, Error, ...")
    config_hash: Optional[str] = Field(None, description="Hash of the configuration applied to it.")
    message: str = Field("", description="Details, e.g. which argument to add.")


# Typed in Python (api.guard_state), schemaless in the CRD: the API server keeps what a newer guard writes.
GuardStateField = Annotated[SLOGuardState, WithJsonSchema({"additionalProperties": True, "type": "object"})]


class KVCachePolicyStatus(_Model):
    """Observed state, written by the operator."""

    # The operator owns status; fields written by newer versions are ignored, not errors.
    model_config = ConfigDict(extra="ignore")
    observed_generation: Optional[int] = Field(None, description="Last policy generation reconciled.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Ready, Progressing, Degraded, Conflict, SLOUnknown ...",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    engine: Optional[str] = Field(None, description="Engine in use (declared or detected).")
    active_tiers: Optional[str] = Field(None, description="Enabled tiers, comma separated (printer column).")
    slo_state: Optional[str] = Field(None, description="OK, Breaching, Unknown, NoData or Off (printer column).")
    hit_ratios: Optional[str] = Field(
        None, max_length=512, description="Measured hit ratios over spec.slo.window, e.g. 'gpu=0.62 cpu=0.412 "
                                          "nvme=0.005' (gpu: vLLM's own prefix cache; printer column).")
    device_hit_ratio: Optional[float] = Field(
        None, ge=0, le=1, allow_inf_nan=False,
        description="vLLM's GPU prefix cache hit ratio over spec.slo.window (vllm:prefix_cache_hits_total / "
                    "prefix_cache_queries_total, the policy's pods), rounded to 3 decimals.")
    tiers: list[TierStatus] = Field(default_factory=list, description="Per-tier state.")
    targets: list[TargetStatus] = Field(default_factory=list, description="Per-workload state.")
    remote_store_budget_bytes: Optional[int] = Field(
        None, ge=0, description="With an enabled remote tier: the most this policy's serving pods may hold in the "
                                "shared store: the tier's size once per workload it configures (the replicas of one "
                                "model share one budget). What they hold now is the engines' "
                                "vllm:kv_offload_kvtier_remote_used_bytes; the store's maxmemory bounds the fleet.")
    slo: Optional[GuardStateField] = Field(
        None, description="SLO guard state: last values, counters, baseline, stage (kept here so restarts lose "
                          "nothing), and slo.history: recent tier changes, newest last (HistoryEntry, bounded).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})
    kopf: Optional[dict[str, Any]] = Field(
        None, description="The operator framework's handler progress, kept in status (which policy authors cannot "
                          "write) rather than in annotations (which they can).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})


class KVCachePolicy(_Model):
    """KV-cache tiering policy for serving workloads."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra=_cel(
            # The API server checks the name is a DNS-1123 subdomain (253); it is also a label value (63).
            _rule(f"!has(self.metadata.name) || self.metadata.name.size() <= {MAX_POLICY_NAME}",
                  f"metadata.name must be at most {MAX_POLICY_NAME} characters: the name is the value of the "
                  "kvtier.io/policy label on the workloads it configures"),
        ))
    api_version: Literal["kvtier.io/v1alpha1"] = Field(alias="apiVersion", description="kvtier.io/v1alpha1")
    kind: Literal["KVCachePolicy"] = Field(description="KVCachePolicy")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Standard object metadata.")
    spec: KVCachePolicySpec = Field(description="Desired tiering.")
    status: Optional[KVCachePolicyStatus] = Field(None, description="Observed state.")
