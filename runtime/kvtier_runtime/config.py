"""The one contract shared by the operator and the runtime (torch-free, kopf-free).

The operator renders engine configuration that names the runtime's plug-ins; the runtime parses the keyword
arguments the engine passes back. Both sides import the names and the parser from here, so a renamed class or
key breaks a test instead of a deployment.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Self, Union

# Names of the runtime's policies and codecs as a KVCachePolicy spells them.
EVICTION_POLICIES: tuple[str, ...] = ("lru", "arc", "s3fifo", "prefix2q", "adaptive")
ADMISSION_POLICIES: tuple[str, ...] = ("none", "doorkeeper", "threshold")
CODECS: tuple[str, ...] = ("none", "fp8", "fp8_e5m2", "int8", "int4")
# The eviction policy of kvtier's own tiers when none is named, and what the replay tools try first: adaptive
# hedges its learned ordering against plain recency, so it stays within 0.005 of LRU's prefix hit ratio (usually
# well above it) on every trace shape measured, a held-out real conversation trace included (docs/performance.md).
RECOMMENDED_EVICTION_POLICY = "adaptive"
# vLLM's own default and the only policy every backend supports (lmcache and TensorRT-LLM run LRU only).
DEFAULT_EVICTION_POLICY = "lru"
# The policies vLLM's CPU manager has built in; any other name with backend native loads kvtier's CachePolicy
# plug-in, so the serving image needs kvtier's runtime package.
VLLM_BUILTIN_EVICTION_POLICIES: tuple[str, ...] = ("lru", "arc")


def default_eviction_policy(backend: str) -> str:
    """A tier's eviction policy when the KVCachePolicy names none: kvtier's recommendation where kvtier's code
    runs the tier (backend kvtier), the engine's own LRU elsewhere (native needs no kvtier code in the pod)."""
    return RECOMMENDED_EVICTION_POLICY if backend == "kvtier" else DEFAULT_EVICTION_POLICY


# With admission "threshold": a block is stored on its Nth offer unless spec.offload.storeThreshold says otherwise.
DEFAULT_ADMISSION_THRESHOLD = 2

# vLLM loads out-of-tree pieces by class name + module path (CachePolicyFactory, SecondaryTierFactory).
# All vLLM imports live in this one adapter module.
VLLM_ADAPTER_MODULE = "kvtier_runtime.engines.vllm_adapter"
VLLM_SECONDARY_TIER_CLASS = "KvtierFilesystemTier"


_STEMS = {"lru": "LRU", "arc": "ARC", "s3fifo": "S3FIFO", "prefix2q": "Prefix2Q", "adaptive": "Adaptive"}
_STEM_NAMES = "|".join(sorted(_STEMS.values(), key=len, reverse=True))
_ADMISSION_NAMES = "|".join(a.capitalize() for a in ADMISSION_POLICIES if a != "none")
_CACHE_POLICY_CLASS = re.compile(
    rf"^Kvtier(?P<stem>{_STEM_NAMES})(?P<admission>{_ADMISSION_NAMES})?(?P<threshold>[1-9][0-9]{{0,5}})?CachePolicy$")


@dataclass(frozen=True)
class CachePolicyChoice:
    """What a vLLM ``CachePolicy`` class name carries: eviction, admission and the admission threshold.

    vLLM builds the CPU tier's policy as ``cls(cache_capacity)``: the class name is the only channel from the
    rendered config to the policy object, so a threshold other than the default is part of the name
    (``KvtierLRUThreshold5CachePolicy``); the default keeps the short name (``KvtierLRUThresholdCachePolicy``).
    """

    eviction: str = DEFAULT_EVICTION_POLICY
    admission: str = "none"
    admission_threshold: int = DEFAULT_ADMISSION_THRESHOLD

    def __post_init__(self) -> None:
        _one_of("evictionPolicy", self.eviction, EVICTION_POLICIES)
        _one_of("admission", self.admission, ADMISSION_POLICIES)
        _positive_int("admission_threshold", self.admission_threshold)

    @property
    def class_name(self) -> str:
        suffix = "" if self.admission == "none" else self.admission.capitalize()
        if self.admission == "threshold" and self.admission_threshold != DEFAULT_ADMISSION_THRESHOLD:
            suffix += str(self.admission_threshold)
        return f"Kvtier{_STEMS[self.eviction]}{suffix}CachePolicy"

    @classmethod
    def from_class_name(cls, name: str) -> CachePolicyChoice:
        match = _CACHE_POLICY_CLASS.match(name)
        if not match:
            raise ConfigError(f"eviction_policy: {name!r} is not a kvtier CachePolicy class "
                              "(Kvtier<Eviction>[<Admission>[<threshold>]]CachePolicy)")
        eviction = next(k for k, v in _STEMS.items() if v == match["stem"])
        admission = (match["admission"] or "none").lower()
        if match["threshold"] and admission != "threshold":
            raise ConfigError(f"eviction_policy: {name!r}: only threshold admission takes a number")
        threshold = int(match["threshold"]) if match["threshold"] else DEFAULT_ADMISSION_THRESHOLD
        return cls(eviction, admission, threshold)


def vllm_cache_policy_class(eviction: str, admission: str = "none",
                            admission_threshold: int = DEFAULT_ADMISSION_THRESHOLD) -> str:
    """Class name of the vLLM ``CachePolicy`` for an eviction/admission pair, e.g. ``KvtierS3FIFOCachePolicy``."""
    return CachePolicyChoice(eviction, admission, admission_threshold).class_name


MAX_IO_TIMEOUT_S = 3600.0


class ConfigError(ValueError):
    """A runtime configuration value broke a rule; the message names the key and the rule."""


class _TierKwargs:
    """A tier's keyword arguments as a frozen dataclass: parsed from the rendered tier dict (keys this version does
    not know are kept in ``extra``, not lost) and written back (keys added later only when set, so configs rendered
    before stay byte-identical)."""

    REQUIRED: tuple[str, ...] = ()
    OMITTED_AT_DEFAULT: frozenset[str] = frozenset()

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> Self:
        known = {f.name for f in fields(cls)} - {"extra"}  # type: ignore[arg-type]
        missing = [k for k in cls.REQUIRED if k not in kwargs]
        if missing:
            raise ConfigError(f"{missing[0]}: required")
        return cls(**{k: v for k, v in kwargs.items() if k in known},  # type: ignore[call-arg]
                   extra={k: v for k, v in kwargs.items() if k not in known})

    def to_kwargs(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)  # type: ignore[arg-type]
               if f.name != "extra"
               and not (f.name in self.OMITTED_AT_DEFAULT and getattr(self, f.name) == f.default)}
        out.update(self.extra)  # type: ignore[attr-defined]
        return out


@dataclass(frozen=True)
class FilesystemTierConfig(_TierKwargs):
    """Keyword arguments of kvtier's filesystem tier, as rendered into a vLLM ``secondary_tiers`` entry."""

    MEDIUM = "filesystem"
    REQUIRED = ("root_dir", "capacity_bytes")
    OMITTED_AT_DEFAULT = frozenset({"mac_key_file", "io_timeout_s"})

    root_dir: str
    capacity_bytes: int
    codec: str = "none"
    eviction_policy: str = RECOMMENDED_EVICTION_POLICY
    admission: str = "none"
    # With admission "threshold": a block is stored on its Nth offer.
    admission_threshold: int = DEFAULT_ADMISSION_THRESHOLD
    n_read_threads: int = 16
    n_write_threads: int = 16
    # Blocks whose measured codec error exceeds the codec's budget are stored with a wider codec.
    codec_fallback: bool = True
    # Path of a file holding the key of a keyed MAC over every block (format 3: GMAC under a key per block, see
    # fs/format.py), e.g. a Secret mounted read-only: blocks are then served only if their MAC verifies, so a writer
    # without the key cannot forge one. None: CRC32 only (accidental corruption is still caught). The file is read
    # by the runtime when the tier starts.
    mac_key_file: str | None = None
    # Longest a transfer may take before its keys fail as "timeout" and the caller moves on: a hung disk or NFS
    # server then slows the engine, never stops it.
    io_timeout_s: float = 30.0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.root_dir, str) or not self.root_dir.startswith("/"):
            raise ConfigError(f"root_dir: {self.root_dir!r} must be an absolute path")
        _positive_int("capacity_bytes", self.capacity_bytes)
        _positive_int("admission_threshold", self.admission_threshold)
        _positive_int("n_read_threads", self.n_read_threads)
        _positive_int("n_write_threads", self.n_write_threads)
        _one_of("codec", self.codec, CODECS)
        _one_of("eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        _one_of("admission", self.admission, ADMISSION_POLICIES)
        if self.mac_key_file is not None and (
            not isinstance(self.mac_key_file, str) or not self.mac_key_file.startswith("/")
        ):
            raise ConfigError(f"mac_key_file: {self.mac_key_file!r} must be an absolute path")
        if (isinstance(self.io_timeout_s, bool) or not isinstance(self.io_timeout_s, (int, float))
                or not 0 < self.io_timeout_s <= MAX_IO_TIMEOUT_S):
            raise ConfigError(f"io_timeout_s: {self.io_timeout_s!r} must be a number in (0, {MAX_IO_TIMEOUT_S:g}]")

    @property
    def address(self) -> str:
        """Where the tier's data lives: its directory (how metrics and the control file named it before tiers had
        names, and still answer to)."""
        return self.root_dir

    @property
    def runtime_name(self) -> str:
        """The tier's label in the runtime's process-wide metrics (``kvtier_runtime_*{tier}``)."""
        return f"kvtier:{self.root_dir}"


REMOTE_URL_SCHEMES: tuple[str, ...] = ("redis", "rediss")
# A remote store slower than this is a miss (vLLM recomputes): a shared tier may cost a little, never an incident.
DEFAULT_REMOTE_IO_TIMEOUT_S = 0.5
MAX_REMOTE_URL_CHARS = 512


@dataclass(frozen=True)
class RemoteTierConfig(_TierKwargs):
    """Keyword arguments of kvtier's remote tier: a Valkey/Redis store (standalone or cluster mode) shared by every
    replica of one model, behind the host and filesystem tiers (the newest tier, so the first rolled back).

    ``url`` names the store only (``redis://host:port[/db]`` or ``rediss://``): credentials never travel in it. The
    password is read from ``password_file`` (a Secret mounted read-only) when the tier starts, and sent as the ACL
    user ``username`` when set (else the store's default user). With ``rediss://``, ``ca_file`` (a PEM bundle, a
    Secret mounted read-only) is the only CA the store's certificate is verified against (a private CA, e.g.
    cert-manager's); without it, the system CA bundle. ``capacity_bytes`` is kvtier's budget in the store for this
    scope and model; the fleet-wide bound is the store's own (maxmemory and its eviction policy).

    Tenancy: ``scope`` (the policy's namespace, rendered by the operator) is the first part of every key
    (``kvtier:<scope>:<model identity>:...``), so each scope has its own chunks, index and budget, and a store ACL
    user per tenant can be confined to ``~kvtier:<scope>:*``. ``mac_key_file`` (the tenant's key, at least 32 bytes,
    from ``remote.macKeySecret``) is required: every value is encrypted and authenticated (AES-256-GCM) under a key
    derived from it, the scope and the model identity, so a client of the store without it can neither read nor
    forge a value. The store password is never that key.
    """

    MEDIUM = "remote"
    REQUIRED = ("url", "capacity_bytes")
    OMITTED_AT_DEFAULT = frozenset({"codec", "password_file", "mac_key_file", "previous_mac_key_file", "io_timeout_s",
                                    "ca_file", "username"})

    url: str
    capacity_bytes: int
    codec: str = "none"
    password_file: str | None = None
    mac_key_file: str | None = None
    # The previous tenant key during a rotation: values written under it are still read (and counted), new ones are
    # written under ``mac_key_file``. The file may be absent (no rotation under way); both files are read again when
    # they change on disk, so a rotated Secret takes effect without a restart.
    previous_mac_key_file: str | None = None
    io_timeout_s: float = DEFAULT_REMOTE_IO_TIMEOUT_S
    # rediss:// only: the PEM CA bundle the store's certificate must chain to (host name checked too).
    ca_file: str | None = None
    # The tenant scope: the first part of every store key (a DNS label: the policy's namespace). Required; a
    # default would put every tenant in one scope.
    scope: str | None = None
    # The store's ACL user the password belongs to (None: the default user).
    username: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # A lossy codec verifies every chunk and falls back to a wider one over its error budget, as a filesystem
    # tier's does by default (not a setting of a remote tier).
    codec_fallback: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_remote_url("url", self.url)
        _positive_int("capacity_bytes", self.capacity_bytes)
        _one_of("codec", self.codec, CODECS)
        check_remote_scope("scope", self.scope)
        for key in ("password_file", "mac_key_file", "previous_mac_key_file", "ca_file"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value.startswith("/")):
                raise ConfigError(f"{key}: {value!r} must be an absolute path")
        if self.mac_key_file is None:
            raise ConfigError(f"mac_key_file: required: {REMOTE_KEY_RULE}")
        if self.mac_key_file == self.password_file:
            raise ConfigError(f"mac_key_file: is the password_file: {REMOTE_KEY_RULE}")
        if self.previous_mac_key_file is not None and self.previous_mac_key_file in (self.mac_key_file,
                                                                                    self.password_file):
            raise ConfigError(f"previous_mac_key_file: is the mac_key_file or the password_file: {REMOTE_KEY_RULE}")
        if self.username is not None and (not isinstance(self.username, str)
                                          or not _REMOTE_USERNAME.fullmatch(self.username)):
            raise ConfigError(f"username: {self.username!r} must be 1..{MAX_REMOTE_USERNAME_CHARS} characters of "
                              "letters, digits, '.', '_' and '-'")
        if self.ca_file is not None and not self.url.startswith("rediss://"):
            raise ConfigError(f"ca_file: {REMOTE_CA_TLS_RULE}")
        if (isinstance(self.io_timeout_s, bool) or not isinstance(self.io_timeout_s, (int, float))
                or not 0 < self.io_timeout_s <= MAX_IO_TIMEOUT_S):
            raise ConfigError(f"io_timeout_s: {self.io_timeout_s!r} must be a number in (0, {MAX_IO_TIMEOUT_S:g}]")

    @property
    def address(self) -> str:
        """Where the tier's data lives: its store's url (how metrics and the control file named it before tiers had
        names, and still answer to)."""
        return self.url

    @property
    def runtime_name(self) -> str:
        """The tier's label in the runtime's process-wide metrics (``kvtier_runtime_*{tier}``)."""
        return f"kvtier-remote:{self.url}"


TierConfig = Union[FilesystemTierConfig, RemoteTierConfig]
# A tier's medium -> the class of its config (each a frozen dataclass of the tier class's keyword arguments).
TIER_CONFIGS: dict[str, type[FilesystemTierConfig] | type[RemoteTierConfig]] = {
    FilesystemTierConfig.MEDIUM: FilesystemTierConfig, RemoteTierConfig.MEDIUM: RemoteTierConfig}
MAX_TIER_NAME_CHARS = 253
# Tiers behind the host tier in one config: a bound on the input, far above any policy (the CRD allows 4 in all).
MAX_TIERS = 16


@dataclass(frozen=True)
class TierEntry:
    """One tier behind the host tier, as the policy names and orders it: its ``name`` (the KVCachePolicy's, which
    the control file, the breakers and the metrics speak), its ``medium`` and that medium's ``config``."""

    name: str
    medium: str
    config: TierConfig

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not 0 < len(self.name) <= MAX_TIER_NAME_CHARS:
            raise ConfigError(f"name: {self.name!r} must be a non-empty name of at most {MAX_TIER_NAME_CHARS} "
                              "characters")
        expected = TIER_CONFIGS.get(self.medium) if isinstance(self.medium, str) else None
        if expected is None:
            raise ConfigError(f"medium: {self.medium!r} is not one of {', '.join(TIER_CONFIGS)}")
        if not isinstance(self.config, expected):
            raise ConfigError(f"config: a {type(self.config).__name__} for a tier of medium {self.medium!r}")

    @classmethod
    def parse(cls, raw: Any) -> TierEntry:
        """``{name, medium, config}`` as rendered; ConfigError names the key (``config.codec: ...``)."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{raw!r} must be a mapping with keys name, medium and config")
        unknown = sorted(set(raw) - {"name", "medium", "config"})
        if unknown:
            raise ConfigError(f"{unknown[0]}: not a tier key (name, medium, config)")
        for key in ("name", "medium", "config"):
            if key not in raw:
                raise ConfigError(f"{key}: required")
        medium = raw["medium"]
        config_cls = TIER_CONFIGS.get(medium) if isinstance(medium, str) else None
        if config_cls is None:
            raise ConfigError(f"medium: {medium!r} is not one of {', '.join(TIER_CONFIGS)}")
        if not isinstance(raw["config"], Mapping):
            raise ConfigError(f"config: {raw['config']!r} must be a mapping of the tier's settings")
        try:
            config = config_cls.from_kwargs(raw["config"])
        except ConfigError as err:
            raise ConfigError(f"config.{err}") from None
        return cls(raw["name"], medium, config)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "medium": self.medium, "config": self.config.to_kwargs()}


# The keys a config rendered before the ordered tier list held its tiers in: two lists by medium (filesystem
# tiers first, then remote tiers) and their names, the host tier's first.
LEGACY_TIER_KEYS = ("fs_tiers", "remote_tiers", "tier_names")


def _ordered_tiers(extra: Mapping[str, Any], prefix: str) -> tuple[str, list[TierEntry]]:
    """The host tier's name and ``tiers``, each entry parsed; errors name the entry (``tiers[1].config.url: ...``)."""
    host = extra.get("host_tier_name", "host")
    raw = extra.get("tiers") or []
    if not isinstance(raw, (list, tuple)):
        raise ConfigError(f"{prefix}tiers: {raw!r} must be a list of tiers (name, medium, config)")
    if len(raw) > MAX_TIERS:
        raise ConfigError(f"{prefix}tiers: {len(raw)} tiers, at most {MAX_TIERS}")
    out = []
    for i, entry in enumerate(raw):
        try:
            out.append(TierEntry.parse(entry))
        except ConfigError as err:
            raise ConfigError(f"{prefix}tiers[{i}].{err}") from None
    return host, out


def _legacy_tiers(extra: Mapping[str, Any], prefix: str) -> tuple[str, list[TierEntry]]:
    """A config rendered before the ordered list: ``fs_tiers`` then ``remote_tiers`` (the order that format
    had), named by ``tier_names`` (the host tier's first) or, without it, by their addresses (``host``, each
    root_dir, each url; a second tier on one store gets ``#<index>``)."""
    configs: list[TierConfig] = []
    for key, cls in (("fs_tiers", FilesystemTierConfig), ("remote_tiers", RemoteTierConfig)):
        raw = extra.get(key) or []
        if not isinstance(raw, (list, tuple)):
            raise ConfigError(f"{prefix}{key}: {raw!r} must be a list of tier mappings")
        for i, entry in enumerate(raw):
            if not isinstance(entry, Mapping):
                raise ConfigError(f"{prefix}{key}[{i}]: {entry!r} must be a mapping")
            try:
                configs.append(cls.from_kwargs(entry))
            except ConfigError as err:
                raise ConfigError(f"{prefix}{key}[{i}].{err}") from None
    given = extra.get("tier_names") or ()
    if not isinstance(given, (list, tuple)):
        raise ConfigError(f"{prefix}tier_names: {given!r} must be a list of tier names")
    names: list[str] = list(given)
    if not all(isinstance(n, str) and 0 < len(n) <= MAX_TIER_NAME_CHARS for n in names):
        raise ConfigError(f"{prefix}tier_names: {names!r} must be a list of non-empty names (at most "
                          f"{MAX_TIER_NAME_CHARS} characters)")
    if len(set(names)) != len(names):
        raise ConfigError(f"{prefix}tier_names: {names!r} must be distinct")
    if not names:
        for i, address in enumerate(["host", *(c.address for c in configs)]):
            names.append(address if address not in names else f"{address}#{i}")  # two remote tiers on one store
    if len(names) != 1 + len(configs):
        raise ConfigError(f"{prefix}tier_names: {len(names)} names for {1 + len(configs)} tiers (the host tier, then "
                          "fs_tiers, then remote_tiers)")
    return names[0], [TierEntry(name, c.MEDIUM, c) for name, c in zip(names[1:], configs)]


# The one grammar of a store address, written in the regular-expression subset RE2 (the API server's CEL), Rust
# (pydantic's patterns) and Python agree on: ASCII classes only (no \d, \s or \w, which are Unicode-aware in some
# of them), no look-around. A DNS name or IPv4 address (letters, digits, '-', '.'), or an IPv6 address in brackets
# (hex groups, at most one '::', no zone), then one port 1-65535 without a leading zero, then at most a database
# number. So a doubled port (h:1:2), a port over 65535, an unbracketed IPv6 address, any whitespace, and non-ASCII
# letters, digits or spaces are refused by every checker alike. The CRD embeds it in a CEL string literal with its
# backslashes (the escaped brackets) doubled.
_LABEL = "[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?"
_HEX = "[0-9A-Fa-f]{1,4}"
_IPV6 = "|".join((
    f"({_HEX}:){{7}}{_HEX}",
    f"({_HEX}:){{1,7}}:",
    f"({_HEX}:){{1,6}}:{_HEX}",
    f"({_HEX}:){{1,5}}(:{_HEX}){{1,2}}",
    f"({_HEX}:){{1,4}}(:{_HEX}){{1,3}}",
    f"({_HEX}:){{1,3}}(:{_HEX}){{1,4}}",
    f"({_HEX}:){{1,2}}(:{_HEX}){{1,5}}",
    f"{_HEX}:(:{_HEX}){{1,6}}",
    f":((:{_HEX}){{1,7}}|:)",
))
_PORT = "([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
REMOTE_URL_REGEX = (f"^rediss?://({_LABEL}([.]{_LABEL})*|\\[({_IPV6})\\]):{_PORT}(/[0-9]{{0,2}})?$")


def check_remote_url(key: str, url: Any) -> None:
    """The one rule for a remote store's address, shared by the operator's validation and the runtime's parser:
    ``redis://`` or ``rediss://``, a host and a port, an optional numeric db, and nothing else (no user or password,
    no query, no fragment: credentials come from a Secret, never from a URL that ends up in status and logs).
    The grammar is ``REMOTE_URL_REGEX``, the very text the CRD's CEL rule matches, so the API server, ``kvtier
    validate``, the operator and the runtime refuse the same addresses. The messages are the CRD's CEL messages
    (operator api.v1alpha1.RemoteStoreSpec), word for word."""
    import re

    if not isinstance(url, str) or not url or len(url) > MAX_REMOTE_URL_CHARS:
        raise ConfigError(f"{key}: must be a redis:// or rediss:// URL of at most {MAX_REMOTE_URL_CHARS} characters")
    if url.split("://", 1)[0] not in REMOTE_URL_SCHEMES or "://" not in url:
        raise ConfigError(f"{key}: must start with redis:// or rediss://")
    if "@" in url.split("://", 1)[1].split("/", 1)[0]:
        raise ConfigError(f"{key}: {REMOTE_URL_CREDENTIALS_RULE}")
    if "?" in url or "#" in url:
        raise ConfigError(f"{key}: {REMOTE_URL_QUERY_RULE}")
    # fullmatch: '$' alone would also match before a trailing newline.
    if re.fullmatch(REMOTE_URL_REGEX, url) is None:
        raise ConfigError(f"{key}: {REMOTE_URL_HOST_PORT_RULE}")


# The tenant scope of a remote tier's keys: a DNS label (a namespace name), so it holds no ':' (the key's
# separator: scope "a" never prefixes scope "a-b"'s keys), no glob character (an ACL pattern ~kvtier:<scope>:* means
# what it says) and no '{' (no Redis Cluster hash tag: one scope's chunks still spread over every slot).
MAX_REMOTE_SCOPE_CHARS = 63
_REMOTE_SCOPE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
MAX_REMOTE_USERNAME_CHARS = 128
_REMOTE_USERNAME = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_REMOTE_USERNAME_CHARS}}}")
# remote.macKeySecret (operator) / mac_key_file (runtime): the model validator's message and the runtime's.
REMOTE_KEY_RULE = ("a remote tier needs remote.macKeySecret: the tenant's key (a Secret key of at least 32 bytes) "
                   "encrypts and authenticates every value in the shared store; the store password is not a key")


def check_remote_scope(key: str, scope: Any) -> None:
    """The tenant scope of a remote tier's store keys: a DNS label of 1..63 characters (lowercase letters, digits,
    '-', starting and ending with a letter or digit)."""
    if scope is None:
        raise ConfigError(f"{key}: required: the tenant scope of the store's keys (the policy's namespace, rendered "
                          "by the operator)")
    if not isinstance(scope, str) or len(scope) > MAX_REMOTE_SCOPE_CHARS or not _REMOTE_SCOPE.fullmatch(scope):
        raise ConfigError(f"{key}: {scope!r} must be a DNS label: 1..{MAX_REMOTE_SCOPE_CHARS} lowercase letters, "
                          "digits and '-', starting and ending with a letter or digit")


REMOTE_URL_CREDENTIALS_RULE = "must not contain credentials (user:password@); use remote.passwordSecret"
REMOTE_URL_QUERY_RULE = "must not carry a query or a fragment"
REMOTE_URL_HOST_PORT_RULE = ("needs a host and a port, and at most a database number as its path "
                             "(redis://HOST:PORT[/DB]; HOST a DNS name, an IPv4 address or an IPv6 address in "
                             "brackets, in ASCII; PORT 1-65535)")
# remote.caSecret (operator) / ca_file (runtime): the CEL message and the runtime's, word for word.
REMOTE_CA_TLS_RULE = "allowed only with a rediss:// url: redis:// is plain TCP, with no certificate to verify"


def _positive_int(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key}: {value!r} must be a positive integer")


def _one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")


# kvtier's own vLLM offloading spec (``spec_name: KvtierOffloadingSpec``), loaded by vLLM's OffloadingSpecFactory.
VLLM_OFFLOADING_SPEC_CLASS = "KvtierOffloadingSpec"
DEFAULT_HOST_SHM_DIR = "/dev/shm"
# The traffic recorder's bounds (OffloadSpecConfig.trace_*): all trace files together, and the rotation count.
DEFAULT_TRACE_MAX_BYTES = 64 * 2**20
MAX_TRACE_BYTES = 16 * 2**30
DEFAULT_TRACE_FILES = 4
MAX_TRACE_FILES = 1000
# A trace file smaller than this would rotate every few requests.
MIN_TRACE_FILE_BYTES = 64 * 1024


@dataclass(frozen=True)
class OffloadSpecConfig:
    """The ``kv_connector_extra_config`` keys :class:`KvtierOffloadingSpec` reads.

    ``cpu_bytes_to_use`` sizes the host tier (a shared-memory region under ``host_shm_dir``, read by vLLM's worker
    and by the scheduler's disk I/O threads); ``eviction_policy``/``admission`` are its kvtier policies; ``tiers``
    are the tiers behind it, in the policy's order, which is their lookup order (``TierEntry``: name, medium and
    the medium's config). Keys vLLM itself reads (``spec_name``, ``block_size``, ``offload_prompt_only``...) are
    kept in ``extra``.

    Rendered as ``tiers: [{name, medium, config}]`` (and ``host_tier_name``). A config rendered before (the tiers
    as two lists by medium, ``fs_tiers`` then ``remote_tiers``, their names in ``tier_names``) still loads: the
    same tiers in the order that format had (filesystem first), named as it named them."""

    cpu_bytes_to_use: int
    eviction_policy: str = RECOMMENDED_EVICTION_POLICY
    admission: str = "none"
    # With admission "threshold": a block is stored on its Nth offer (spec.offload.storeThreshold).
    admission_threshold: int = DEFAULT_ADMISSION_THRESHOLD
    host_shm_dir: str = DEFAULT_HOST_SHM_DIR
    # The tiers behind the host tier, in the policy's order (each a TierEntry: name, medium, config).
    tiers: tuple[TierEntry, ...] = ()
    # The host tier's name (the policy's cpu tier).
    host_name: str = "host"
    # The live control file (docs/breaker.md): JSON naming tiers to bypass without a restart. None: not watched.
    control_file: str | None = None
    # Tokens per second the engine prefills (recomputes) at: a tier whose loads cost more than recomputing the same
    # tokens is bypassed by its breaker (docs/breaker.md). None: no tier is bypassed for being slow.
    recompute_tokens_per_s: float | None = None
    # Recording (docs/replay.md, "Record your own traffic"): a folder to write a Mooncake-format trace of the
    # requests the offloading manager sees, for ``kvtier replay``. None: not recorded.
    trace_dir: str | None = None
    # What the trace files may hold in all (the oldest file is deleted first), and how many files they rotate over.
    trace_max_bytes: int = DEFAULT_TRACE_MAX_BYTES
    trace_files: int = DEFAULT_TRACE_FILES
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _positive_int("cpu_bytes_to_use", self.cpu_bytes_to_use)
        _one_of("eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        _one_of("admission", self.admission, ADMISSION_POLICIES)
        _positive_int("admission_threshold", self.admission_threshold)
        if not isinstance(self.host_shm_dir, str) or not self.host_shm_dir.startswith("/"):
            raise ConfigError(f"host_shm_dir: {self.host_shm_dir!r} must be an absolute path")
        if self.control_file is not None and (not isinstance(self.control_file, str)
                                              or not self.control_file.startswith("/")):
            raise ConfigError(f"control_file: {self.control_file!r} must be an absolute path")
        rate = self.recompute_tokens_per_s
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                                 or not 0 < rate < float("inf")):
            raise ConfigError(f"recompute_tokens_per_s: {rate!r} must be a positive number")
        self._check_tiers()
        self._check_trace()

    def _check_trace(self) -> None:
        if self.trace_dir is not None and (not isinstance(self.trace_dir, str) or not self.trace_dir.startswith("/")):
            raise ConfigError(f"trace_dir: {self.trace_dir!r} must be an absolute path")
        files = self.trace_files
        if isinstance(files, bool) or not isinstance(files, int) or not 1 <= files <= MAX_TRACE_FILES:
            raise ConfigError(f"trace_files: {files!r} must be an integer from 1 to {MAX_TRACE_FILES}")
        size = self.trace_max_bytes
        low = MIN_TRACE_FILE_BYTES * files
        if isinstance(size, bool) or not isinstance(size, int) or not low <= size <= MAX_TRACE_BYTES:
            raise ConfigError(f"trace_max_bytes: {size!r} must be an integer from {low} ({MIN_TRACE_FILE_BYTES} per "
                              f"trace file) to {MAX_TRACE_BYTES}")

    def _check_tiers(self) -> None:
        if isinstance(self.tiers, list):
            object.__setattr__(self, "tiers", tuple(self.tiers))
        if not isinstance(self.tiers, tuple) or not all(isinstance(t, TierEntry) for t in self.tiers):
            raise ConfigError(f"tiers: {self.tiers!r} must be a list of tiers (name, medium, config)")
        if not isinstance(self.host_name, str) or not 0 < len(self.host_name) <= MAX_TIER_NAME_CHARS:
            raise ConfigError(f"host_tier_name: {self.host_name!r} must be a non-empty name of at most "
                              f"{MAX_TIER_NAME_CHARS} characters")
        names = self.names
        if len(set(names)) != len(names):
            raise ConfigError(f"tiers: names {names!r} (the host tier's first) must be distinct")
        roots = [t.config.address for t in self.tiers if t.medium == FilesystemTierConfig.MEDIUM]
        if len(set(roots)) != len(roots):
            raise ConfigError(f"tiers: filesystem tiers' root_dir values must be distinct, got {roots}")

    @property
    def names(self) -> list[str]:
        """Every tier's name, the host tier's first, then the tiers behind it in their order."""
        return [self.host_name, *(t.name for t in self.tiers)]

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> OffloadSpecConfig:
        """Parse vLLM's ``kv_connector_extra_config``; a bad value raises :class:`ConfigError` whose message starts
        with the key's full path (``kv_connector_extra_config.tiers[0].config.codec: ...``)."""
        prefix = "kv_connector_extra_config."
        if "cpu_bytes_to_use" not in extra:
            raise ConfigError(f"{prefix}cpu_bytes_to_use: required (bytes of kvtier's host tier)")
        legacy = [k for k in LEGACY_TIER_KEYS if k in extra]
        if legacy and ("tiers" in extra or "host_tier_name" in extra):
            raise ConfigError(f"{prefix}{legacy[0]}: the tiers are in 'tiers'; a config has one tier list, not both "
                              "forms")
        host, tiers = _legacy_tiers(extra, prefix) if legacy else _ordered_tiers(extra, prefix)
        known = {"cpu_bytes_to_use", "eviction_policy", "admission", "admission_threshold", "host_shm_dir",
                 "control_file", "recompute_tokens_per_s", "trace_dir", "trace_max_bytes", "trace_files"}
        try:
            return cls(
                **{k: extra[k] for k in known if k in extra},
                tiers=tuple(tiers),
                host_name=host,
                extra={k: v for k, v in extra.items()
                       if k not in known and k not in ("tiers", "host_tier_name", *LEGACY_TIER_KEYS)},
            )
        except ConfigError as err:
            raise ConfigError(f"{prefix}{err}") from None

    def to_extra_config(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cpu_bytes_to_use": self.cpu_bytes_to_use,
            "eviction_policy": self.eviction_policy,
            "admission": self.admission,
        }
        if self.admission_threshold != DEFAULT_ADMISSION_THRESHOLD:
            out["admission_threshold"] = self.admission_threshold
        if self.host_shm_dir != DEFAULT_HOST_SHM_DIR:
            out["host_shm_dir"] = self.host_shm_dir
        if self.host_name != "host":
            out["host_tier_name"] = self.host_name
        if self.tiers:
            out["tiers"] = [t.to_dict() for t in self.tiers]
        if self.control_file is not None:
            out["control_file"] = self.control_file
        if self.recompute_tokens_per_s is not None:
            out["recompute_tokens_per_s"] = self.recompute_tokens_per_s
        if self.trace_dir is not None:
            out["trace_dir"] = self.trace_dir
        if self.trace_max_bytes != DEFAULT_TRACE_MAX_BYTES:
            out["trace_max_bytes"] = self.trace_max_bytes
        if self.trace_files != DEFAULT_TRACE_FILES:
            out["trace_files"] = self.trace_files
        out.update(self.extra)
        return out


# ---- the runtime's live control file (docs/breaker.md): written by the operator, read by the runtime ----------
# ``{"disabledTiers": [names], "generation": N}``: the tiers listed are bypassed until removed from the list.
CONTROL_DISABLED_TIERS = "disabledTiers"
CONTROL_GENERATION = "generation"
# A larger file is refused (the last good state is kept).
CONTROL_FILE_MAX_BYTES = 64 * 1024


def control_file_json(disabled_tiers: Sequence[str], generation: int) -> str:
    """The control file's text for ``disabled_tiers`` (tier names as ``OffloadSpecConfig.tier_names`` spells them)
    and the writer's ``generation``: sorted, so the same state is always the same bytes."""
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        raise ConfigError(f"{CONTROL_GENERATION}: {generation!r} must be a non-negative integer")
    names = sorted(set(disabled_tiers))
    if not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{CONTROL_DISABLED_TIERS}: {names!r} must be non-empty tier names")
    text = json.dumps({CONTROL_DISABLED_TIERS: names, CONTROL_GENERATION: generation}, separators=(",", ":"))
    if len(text.encode()) > CONTROL_FILE_MAX_BYTES:
        raise ConfigError(f"{CONTROL_DISABLED_TIERS}: the file would exceed {CONTROL_FILE_MAX_BYTES} bytes")
    return text
