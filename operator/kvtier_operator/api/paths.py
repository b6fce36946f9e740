"""The one path normaliser: CEL (as far as CEL can say it), ``kvtier validate``, the operator and the renderers
all judge a path by :func:`normal_path`'s output, so no rule can see one path and the node another.

A path must already be in normal form: nothing is normalised silently. ``/mnt//a``, ``/mnt/a/`` and
``/var//run/secrets`` are refused with the form to write instead, because a check on the raw text and a mount
at the normalised path disagree (``/var//run`` passed the system-path rule and was mounted over /var/run).
"""
from __future__ import annotations

import re
from typing import Optional

# Mount paths that would shadow what the container (or the operator's own mounts: /etc/kvtier, /dev/shm) needs.
# A tier path equal to, below, or above one of these is refused: `/var` would hide /var/run/secrets (the
# service-account token). Evaluated on the normal form only (CEL first refuses every other form).
SYSTEM_PATH_RULE = (r"^/((bin|boot|dev|etc|lib|lib32|lib64|proc|root|run|sbin|sys|usr|var/run|var/lib/kubelet)"
                    r"(/|$)|(var)?$)")
# CEL: a path in normal form has no "." or ".." segment, no empty segment and no trailing "/" (except "/").
# `[.]` rather than `\.`: the pattern is embedded in a CEL string literal, where `\.` is not a valid escape.
DOT_SEGMENT_RULE = r"(^|/)[.][.]?(/|$)"
DOT_SEGMENT_MESSAGE = "must not contain '.' or '..' segments"
NOT_NORMAL_RULE = r"//|./$"
NOT_NORMAL_MESSAGE = "must be in normal form: no '//' and no trailing '/' (nothing is normalised for you)"
SYSTEM_PATH_MESSAGE = ("must not be or contain a system path (/, /bin, /dev, /etc, /lib, /proc, /run, /sys, /usr, "
                       "/var/run, ...), nor the operator's own mounts /etc/kvtier and /dev/shm")
_SYSTEM = re.compile(SYSTEM_PATH_RULE)


class RuleError(ValueError):
    """A rule checked in Python on top of the schema; the message is word for word the CEL rule's message."""


class PathError(RuleError):
    """A path rule broken."""


def segments(path: str) -> list[str]:
    return [p for p in path.split("/") if p]


def normal_path(path: str) -> str:
    """The normal form of an absolute path: single slashes, no trailing slash. '.' and '..' segments are never
    resolved (that would need the node's file system): they raise :class:`PathError`."""
    if not path.startswith("/"):
        raise PathError("must be an absolute path")
    parts = segments(path)
    if any(p in (".", "..") for p in parts):
        raise PathError(DOT_SEGMENT_MESSAGE)
    return "/" + "/".join(parts)


def form_problem(path: str) -> Optional[str]:
    """Why ``path`` is not an absolute path in normal form, or None (the message says what to write)."""
    try:
        normal = normal_path(path)
    except PathError as err:
        return str(err)
    if normal != path:
        return NOT_NORMAL_MESSAGE
    return None


def is_system_path(path: str) -> bool:
    """Whether a mount at ``path`` would shadow, or sit inside, a path the container or the operator needs.
    Judged on the normal form: ``/var//run/secrets`` is ``/var/run/secrets``."""
    try:
        normal = normal_path(path)
    except PathError:
        return True  # not a mount point anyone can reason about
    return bool(_SYSTEM.match(normal))


def mount_path_problem(path: str) -> Optional[str]:
    """Every rule a tier's mount path must meet, on the normal form: the form itself, then system paths."""
    return form_problem(path) or (SYSTEM_PATH_MESSAGE if is_system_path(path) else None)
