"""``kvtier replay recommend``: a KVCachePolicy whose tiers are sized from replayed traffic (docs/replay.md).

The policy is read as YAML and edited as text (the runtime never imports the operator): each enabled tier's
``size`` and ``evictionPolicy`` values are replaced in place, so every other field, comment and blank line the user
wrote stays as it was; the figures are added as YAML comments, at the top and above each tier's ``size``.

Sizing, tier by tier, fastest first (the tiers above fixed at their choice, the tiers below absent): the prefix hit
ratio of the hierarchy is replayed with the default policy on a fixed grid of capacities, and the tier gets the
smallest grid size reaching ``KNEE`` of what an unbounded tier would add -- capped at the budget (the largest size
within it when the knee lies beyond). The knee is measured against the unbounded tier rather than the budget's own
ratio so that a larger budget never picks a size that serves less. At that size every eviction policy of the runtime
is replayed (with the tier's admission filter) and the best prefix hit ratio wins, ties going to the default.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .. import config
from ..policies import ADMISSIONS, POLICIES
from .args import DEFAULT_BLOCK_TOKENS, number_arg, one_line_error
from .engine import PolicySpec, ReplayError, ReplayResult, replay
from .trace import RecordedModel, Trace, TraceError, load_meta, load_traces, recording_files, trace_warnings

PROG = "kvtier replay recommend"
# A tier's size is the smallest grid capacity reaching this share of what an unbounded tier would add.
KNEE = 0.95
# Prefill throughput assumed when --prefill-tokens-per-s is not given: a mid-size model (7-13B) on one current
# data-centre GPU prefills in the order of 10^4 tokens/s; give your engine's figure for a real estimate.
DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
MEDIA = ("cpu", "filesystem", "remote")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
# Capacities tried per tier: powers of 2^(1/4) blocks, so a size is chosen within ~19% of its knee.
_GRID_STEP = 2 ** 0.25


def parse_quantity(text: Any, what: str) -> int:
    """Bytes in a Kubernetes quantity (``64Gi``, ``500G``, ``1073741824``), rounded up; errors name ``what``."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    match = _QUANTITY.match(str(text).strip()) if isinstance(text, (str, int)) else None
    if not match or float(match.group(1)) <= 0:
        raise ReplayError(f"{what}: {text!r} must be a positive Kubernetes quantity, e.g. 64Gi or 500G")
    number, suffix = match.group(1), match.group(2) or ""
    scale = _BINARY.get(suffix) or _DECIMAL[suffix]
    whole, _, frac = number.partition(".")
    value = int(whole) * scale + (-(-int(frac) * scale // 10 ** len(frac)) if frac else 0)
    return value


def format_quantity(n_bytes: int) -> str:
    for suffix in ("Ti", "Gi", "Mi", "Ki"):
        if n_bytes % _BINARY[suffix] == 0:
            return f"{n_bytes // _BINARY[suffix]}{suffix}"
    return str(n_bytes)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return str(n)


# ---- the policy, as YAML data and as text ----------------------------------------------------------------------


@dataclass
class PolicyTier:
    index: int
    name: str
    medium: str
    size_bytes: int
    enabled: bool
    eviction: str | None
    admission: str
    node: yaml.MappingNode
    # Filled in by the recommendation.
    budget_bytes: int = 0
    capacity_blocks: int = 0
    size: str = ""
    policy: str = ""


@dataclass
class PolicyFile:
    path: str
    text: str
    doc: dict[str, Any]
    tiers: list[PolicyTier]
    backend: str


def load_policy(path: str) -> PolicyFile:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ReplayError(f"--policy: {path}: cannot read the policy ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ReplayError(f"--policy: {path}: not UTF-8 text") from None
    try:
        nodes = [n for n in yaml.compose_all(text, Loader=yaml.SafeLoader) if n is not None]
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ReplayError(f"--policy: {path}: not YAML ({' '.join(str(exc).split())})") from None
    if len(docs) != 1:
        raise ReplayError(f"--policy: {path}: {len(docs)} YAML documents; give a file holding one KVCachePolicy")
    doc, node = docs[0], nodes[0]
    if not isinstance(doc, dict) or doc.get("kind") != "KVCachePolicy" or doc.get("apiVersion") != "kvtier.io/v1alpha1":
        kind = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
        raise ReplayError(f"--policy: {path}: kind: {kind!r}, not a KVCachePolicy (apiVersion kvtier.io/v1alpha1)")
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        raise ReplayError(f"--policy: {path}: spec: must be a mapping")
    raw_tiers = spec.get("tiers")
    if not isinstance(raw_tiers, list) or not raw_tiers:
        raise ReplayError(f"--policy: {path}: spec.tiers: the policy has no tier below the GPU to size")
    tier_nodes = _child(_child(node, "spec"), "tiers")
    tiers = []
    for i, (t, tnode) in enumerate(zip(raw_tiers, tier_nodes.value)):
        where = f"--policy: {path}: spec.tiers[{i}]"
        if not isinstance(t, dict) or not isinstance(tnode, yaml.MappingNode):
            raise ReplayError(f"{where}: must be a mapping")
        name, medium = t.get("name"), t.get("medium")
        if not isinstance(name, str) or not name:
            raise ReplayError(f"{where}.name: required")
        if medium not in MEDIA:
            raise ReplayError(f"{where}.medium: {medium!r} is not one of {', '.join(MEDIA)}")
        if "size" not in t:
            raise ReplayError(f"{where}.size: required")
        eviction = t.get("evictionPolicy")
        if eviction is not None and eviction not in POLICIES:
            raise ReplayError(f"{where}.evictionPolicy: {eviction!r} is not one of {', '.join(POLICIES)}")
        admission = t.get("admission", "none")
        if admission not in ADMISSIONS:
            raise ReplayError(f"{where}.admission: {admission!r} is not an admission filter")
        tiers.append(PolicyTier(i, name, medium, parse_quantity(t["size"], f"{where}.size"),
                                t.get("enabled", True) is not False, eviction, admission, tnode))
    backend = spec.get("backend", "native")
    return PolicyFile(path, text, doc, tiers, backend if isinstance(backend, str) else "native")


def _child(node: Any, key: str) -> Any:
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode) and k.value == key:
                return v
    raise ReplayError(f"--policy: {key}: not found where expected")


def parse_budget(text: str | None, policy: PolicyFile) -> dict[str, int]:
    """``cpu=64Gi,filesystem=1Ti`` or tier names (``nvme=400Gi``): bytes per enabled tier name."""
    out: dict[str, int] = {}
    if not text:
        return out
    enabled = [t for t in policy.tiers if t.enabled]
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep:
            raise ReplayError(f"--budget: {part!r} must be KEY=QUANTITY, e.g. cpu=64Gi")
        size = parse_quantity(value.strip(), f"--budget {key}")
        named = [t for t in enabled if t.name == key]
        by_medium = [t for t in enabled if t.medium == key]
        if named:
            targets = named
        elif key in MEDIA:
            if not by_medium:
                raise ReplayError(f"--budget: {key}: the policy has no enabled {key} tier")
            if len(by_medium) > 1:
                raise ReplayError(f"--budget: {key}: {len(by_medium)} enabled {key} tiers "
                                  f"({', '.join(t.name for t in by_medium)}); budget each by its tier name")
            targets = by_medium
        else:
            raise ReplayError(f"--budget: {key!r} is neither a medium ({', '.join(MEDIA)}) nor an enabled tier of "
                              f"the policy ({', '.join(t.name for t in enabled)})")
        for t in targets:
            if t.name in out:
                raise ReplayError(f"--budget: tier {t.name} is budgeted twice")
            out[t.name] = size
    return out


# ---- block bytes, block tokens --------------------------------------------------------------------------------


def block_bytes_of(args: argparse.Namespace, model: RecordedModel | None, policy: PolicyFile) -> tuple[int, str]:
    """Bytes of one block (all tensor-parallel ranks), and where the figure came from."""
    if args.block_bytes:
        return args.block_bytes, "--block-bytes"
    if model is not None and model.block_bytes:
        return model.block_bytes, f"the recording's sidecar ({model.path.name}: block_bytes)"
    if model is not None:
        # The recorded engine sized its host tier as the policy's cpu size // block bytes.
        cpu = next((t for t in policy.tiers if t.medium == "cpu"), None)
        rec = next((i for i, m in enumerate(model.media) if m == "cpu"), None)
        if cpu is not None and rec is not None:
            derived = cpu.size_bytes // model.capacities[rec]
            return derived, (f"derived: the policy's cpu tier ({format_quantity(cpu.size_bytes)}) / the recorded "
                             f"host tier's {model.capacities[rec]} blocks, assuming the recording ran this policy")
    raise ReplayError("--block-bytes: required: this trace has no sidecar with block_bytes and the policy names no "
                      "model to derive it from (KV bytes per token x tokens per block, all tensor-parallel ranks)")


# ---- replay ----------------------------------------------------------------------------------------------------


def _grid(max_blocks: int, n_distinct: int) -> list[int]:
    """Capacities on a fixed geometric grid (independent of the budget) up to ``max_blocks``, plus that."""
    top = min(max_blocks, n_distinct)
    out, c = [], 1.0
    while int(c) < top:
        out.append(int(c))
        c *= _GRID_STEP
    out.append(top)
    return sorted(set(out))


def _ratio(trace: Trace, caps: list[int], specs: list[PolicySpec]) -> float:
    res = replay(trace, caps, specs, with_opt=False)
    return res.ratio(res.total_prefix_hits)


@dataclass
class Choice:
    capacity_blocks: int
    policy: PolicySpec
    reason: str
    by_policy: dict[str, float] = field(default_factory=dict)


def choose(trace: Trace, tiers: list[PolicyTier], block_bytes: int,
           progress: Callable[[], object] | None = None) -> list[Choice]:
    """Each tier's capacity and policy, fastest first (see the module's doc)."""
    n_distinct = trace.n_distinct
    chosen_caps: list[int] = []
    chosen_specs: list[PolicySpec] = []
    out = []
    default = config.RECOMMENDED_EVICTION_POLICY
    for tier in tiers:
        budget_blocks = tier.budget_bytes // block_bytes
        if budget_blocks < 1:
            raise ReplayError(f"--budget {tier.name}: {format_quantity(tier.budget_bytes)} holds no block of "
                              f"{block_bytes} bytes")
        base = PolicySpec(default, tier.admission)
        before = _ratio(trace, chosen_caps, chosen_specs) if chosen_caps else 0.0
        unbounded = _ratio(trace, chosen_caps + [n_distinct], chosen_specs + [base])
        goal = before + KNEE * (unbounded - before)
        # Binary search on a grid fixed by the trace alone (hit ratios rise with capacity), then the budget caps
        # it: a larger budget never picks a smaller size.
        grid = _grid(n_distinct, n_distinct)
        lo, hi = 0, len(grid) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if _ratio(trace, chosen_caps + [grid[mid]], chosen_specs + [base]) >= goal - 1e-12:
                hi = mid
            else:
                lo = mid + 1
            if progress:
                progress()
        knee = grid[lo]
        if knee <= budget_blocks:
            pick = knee
            reason = f"smallest size reaching {KNEE:.0%} of what an unbounded {tier.name} tier would add"
        else:
            pick = budget_blocks
            reason = (f"all of the budget: the knee ({KNEE:.0%} of what an unbounded tier would add) lies at "
                      f"{knee} blocks")
        by_policy = {}
        for name in POLICIES:
            spec = PolicySpec(name, tier.admission)
            by_policy[name] = _ratio(trace, chosen_caps + [pick], chosen_specs + [spec])
        best = max(by_policy, key=lambda n: (by_policy[n], n == default))
        spec = PolicySpec(best, tier.admission)
        chosen_caps.append(pick)
        chosen_specs.append(spec)
        out.append(Choice(pick, spec, reason, by_policy))
    return out


def round_capacity(blocks: int, block_bytes: int, budget_bytes: int) -> int:
    """``blocks`` moved up to the next count whose bytes are a whole MiB (a tidy quantity), unless that leaves
    the budget; then down to the largest such count within it; else ``blocks`` as they are."""
    step = (2**20) // math.gcd(2**20, block_bytes)
    up = -(-blocks // step) * step
    if up * block_bytes <= budget_bytes:
        return up
    down = (budget_bytes // block_bytes) // step * step
    return down if down >= 1 else blocks


# ---- output ----------------------------------------------------------------------------------------------------


def figures(res: ReplayResult, trace: Trace, tiers: list[PolicyTier], block_tokens: int, block_bytes: int,
            prefill_tokens_per_s: float) -> dict[str, Any]:
    span_s = (max(trace.timestamps_ms) - min(trace.timestamps_ms)) / 1000.0
    out: dict[str, Any] = {"trace_seconds": span_s, "tiers": {}, "total": {}}
    for tier, st in zip(tiers, res.tiers):
        moved = (st.prefix_hits + st.stored_blocks) * block_bytes
        out["tiers"][tier.name] = {
            "prefix_hit_ratio": res.ratio(st.prefix_hits),
            "loaded_blocks": st.prefix_hits, "stored_blocks": st.stored_blocks,
            "prefill_seconds_saved": st.prefix_hits * block_tokens / prefill_tokens_per_s,
            "bytes_moved_per_s": moved / span_s if span_s > 0 else None,
        }
    loaded = res.total_prefix_hits
    moved = sum((st.prefix_hits + st.stored_blocks) * block_bytes for st in res.tiers)
    out["total"] = {
        "prefix_hit_ratio": res.ratio(loaded), "loaded_blocks": loaded,
        "prefill_seconds_saved": loaded * block_tokens / prefill_tokens_per_s,
        "bytes_moved_per_s": moved / span_s if span_s > 0 else None,
    }
    return out


def _rate(v: float | None) -> str:
    return "n/a (the trace spans no time)" if v is None else f"{_human(v)}/s"


def render(policy: PolicyFile, tiers: list[PolicyTier], choices: list[Choice], figs: dict[str, Any],
           header: list[str]) -> str:
    """The policy's text with each sized tier's size and evictionPolicy replaced in place and the figures added
    as comments."""
    edits: list[tuple[int, int, str]] = []  # (start, end, replacement) on the original text
    text = policy.text
    for tier, choice in zip(tiers, choices):
        size_node = _child(tier.node, "size")
        size_key = next(k for k, v in tier.node.value if v is size_node)
        f = figs["tiers"][tier.name]
        indent = " " * size_key.start_mark.column
        line_start = text.rfind("\n", 0, size_key.start_mark.index) + 1
        note = [f"kvtier replay recommend: {tier.size} ({tier.capacity_blocks} blocks), {tier.policy} -- "
                f"{choice.reason} (budget {format_quantity(tier.budget_bytes)})",
                f"predicted prefix hit ratio {f['prefix_hit_ratio']:.4f} from this tier; prefill saved "
                f"{f['prefill_seconds_saved']:.1f} s over the trace; bytes moved {_rate(f['bytes_moved_per_s'])}",
                "prefix hit ratio of all tiers by this tier's policy at this size: "
                + ", ".join(f"{n} {r:.4f}" for n, r in choice.by_policy.items())]
        comment = "".join(f"{indent}# {line}\n" for line in note)
        edits.append((line_start, line_start, comment))
        edits.append((size_node.start_mark.index, size_node.end_mark.index, tier.size))
        ev_node = next((v for k, v in tier.node.value if k.value == "evictionPolicy"), None)
        if ev_node is not None:
            edits.append((ev_node.start_mark.index, ev_node.end_mark.index, tier.policy))
        else:
            line_end = text.find("\n", size_node.end_mark.index)
            line_end = len(text) if line_end < 0 else line_end
            edits.append((line_end, line_end, f"\n{indent}evictionPolicy: {tier.policy}"))
    out = text
    for start, end, new in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        out = out[:start] + new + out[end:]
    head = "".join(f"# {line}\n" if line else "#\n" for line in header)
    if not out.endswith("\n"):
        out += "\n"
    return head + out


def _flow(policy: PolicyFile) -> bool:
    """A tier written in flow style ({...}) cannot take comment lines: such a policy is re-dumped instead."""
    return any(t.node.flow_style for t in policy.tiers) or \
        any(_child(t.node, "size").style not in (None, "", "'", '"') for t in policy.tiers)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # One line on stderr, not argparse's usage block (setattr: mypy refuses assigning to a method).
    setattr(parser, "error", one_line_error(parser))  # noqa: B010
    parser.description = ("Print the KVCachePolicy --policy with each enabled tier's size and evictionPolicy "
                          "chosen from the replayed trace, within --budget (default: the tiers' current sizes), "
                          "and the predicted figures as comments.")
    parser.add_argument("--trace", required=True, metavar="FILE|DIR",
                        help="Mooncake-format JSONL trace, or a recording of kvtier's own traffic (its folder)")
    parser.add_argument("--policy", required=True, metavar="FILE", help="the KVCachePolicy to size (YAML)")
    parser.add_argument("--budget", metavar="KEY=QUANTITY,...",
                        help="largest size per medium (cpu, filesystem, remote) or per tier name, e.g. "
                             "cpu=64Gi,filesystem=1Ti; a tier not named keeps its current size as its budget")
    parser.add_argument("--block-bytes", type=number_arg("--block-bytes", int), metavar="N",
                        help="KV bytes of one block of the trace, all tensor-parallel ranks (default: the "
                             "recording's sidecar, or derived from the policy's cpu size and the recorded "
                             "host tier's blocks)")
    parser.add_argument("--block-tokens", type=number_arg("--block-tokens", int), metavar="N",
                        help=f"tokens per hash id (default: the recording's, else {DEFAULT_BLOCK_TOKENS})")
    parser.add_argument("--prefill-tokens-per-s", type=number_arg("--prefill-tokens-per-s"),
                        default=DEFAULT_PREFILL_TOKENS_PER_S, metavar="T",
                        help=f"prefill throughput, turning tokens served into prefill time saved (default "
                             f"{DEFAULT_PREFILL_TOKENS_PER_S:.0f}: a mid-size model on one GPU)")
    parser.add_argument("--skip-bad", action="store_true", help="skip malformed trace lines instead of failing")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the policy here instead of stdout")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (ReplayError, TraceError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{PROG}: error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    policy = load_policy(args.policy)
    files, meta_path = recording_files(args.trace)
    model = load_meta(meta_path) if meta_path is not None else None
    block_tokens = args.block_tokens or (model.tokens_per_block if model is not None else DEFAULT_BLOCK_TOKENS)
    trace = load_traces(files, skip_bad=args.skip_bad)
    for warning in trace_warnings(trace, block_tokens):
        print(f"{PROG}: {warning}", file=sys.stderr)
    budget = parse_budget(args.budget, policy)
    block_bytes, bytes_source = block_bytes_of(args, model, policy)
    tiers = [t for t in policy.tiers if t.enabled]
    if not tiers:
        raise ReplayError(f"--policy: {policy.path}: spec.tiers: no enabled tier to size")
    for t in tiers:
        t.budget_bytes = budget.get(t.name, t.size_bytes)
    choices = choose(trace, tiers, block_bytes)
    for t, c in zip(tiers, choices):
        t.capacity_blocks = round_capacity(c.capacity_blocks, block_bytes, t.budget_bytes)
        t.size = format_quantity(t.capacity_blocks * block_bytes)
        t.policy = c.policy.eviction
    specs = [c.policy for c in choices]
    res = replay(trace, [t.capacity_blocks for t in tiers], specs, with_opt=False)
    figs = figures(res, trace, tiers, block_tokens, block_bytes, args.prefill_tokens_per_s)
    total = figs["total"]
    header = [
        f"kvtier replay recommend: sized from {args.trace} ({len(trace.requests)} requests, {trace.n_accesses} "
        f"block accesses, {trace.n_distinct} distinct blocks, {block_tokens} tokens/block, "
        f"{figs['trace_seconds']:.0f} s of traffic)",
        f"block bytes: {block_bytes} ({bytes_source})",
        f"predicted prompt-token prefix hit ratio: {total['prefix_hit_ratio']:.4f} in all ("
        + ", ".join(f"{n} {f['prefix_hit_ratio']:.4f}" for n, f in figs["tiers"].items()) + ")",
        f"prefill time saved: {total['prefill_seconds_saved']:.1f} s over the trace at "
        f"{args.prefill_tokens_per_s:.0f} prefill tokens/s"
        + (" (assumed: --prefill-tokens-per-s not given)" if args.prefill_tokens_per_s == DEFAULT_PREFILL_TOKENS_PER_S
           else ""),
        f"bytes moved (loads + stores): {_rate(total['bytes_moved_per_s'])}",
        "assumed: the GPU's own prefix cache is not modelled; compressed tiers hold blocks at full size; "
        "a remote tier is modelled as private to one replica",
        f"replay: kvtier replay --trace {args.trace} --block-tokens {block_tokens} "
        + " ".join(f"--capacity {t.capacity_blocks}" for t in tiers) + " "
        + " ".join(f"--policy {s}" for s in specs),
        "",
    ]
    if _flow(policy):
        # Flow-style tiers cannot carry comment lines: dump the document (the file's comments are dropped).
        doc = policy.doc
        for t in tiers:
            doc["spec"]["tiers"][t.index]["size"] = t.size
            doc["spec"]["tiers"][t.index]["evictionPolicy"] = t.policy
        header.insert(-1, "the policy was re-written from its data (flow-style YAML): its comments are dropped")
        text = "".join(f"# {line}\n" if line else "#\n" for line in header) + yaml.safe_dump(doc, sort_keys=False)
    else:
        text = render(policy, tiers, choices, figs, header)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG)
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
