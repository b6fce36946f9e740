"""``kvtier replay``: replay a Mooncake-format trace through the runtime's policies before deploying tiering.

Wiring: ``add_arguments(parser)`` fills an argparse parser (the ``kvtier`` console script adds it as the
``replay`` subcommand) and ``run(args)`` executes it; ``main(argv)`` does both and is what
``python -m kvtier_runtime.replay`` calls. Bad input is a one-line message and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any, TypeVar

from .. import config
from ..policies import ADMISSIONS, POLICIES
from .args import DEFAULT_BLOCK_TOKENS, PROG, number_arg, one_line_error
from .cost import tier_cost
from .engine import PolicySpec, ReplayError, ReplayResult, capacity_blocks, replay, replay_recorded
from .lru_curve import LRUCurve, equivalence
from .metrics import flatten
from .recommend import main as recommend
from .trace import RecordedModel, Trace, TraceError, load_meta, load_traces, recording_files, trace_warnings

PLOT_FORMATS = (".png", ".svg", ".pdf")
T = TypeVar("T")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # One line on stderr, not argparse's usage block (setattr: mypy refuses assigning to a method).
    setattr(parser, "error", one_line_error(parser))  # noqa: B010
    parser.description = ("Replay a Mooncake-format JSONL trace through kvtier's eviction/admission policies and "
                          "compare with the Belady-optimal bound. 'analyze' describes the trace's reuse instead; "
                          "'recommend' sizes a KVCachePolicy's tiers from it (kvtier replay recommend --help).")
    parser.add_argument("action", nargs="?", choices=["analyze"],
                        help="'analyze': reuse distances/times, most reused prefixes, never-reused blocks, "
                             "recommended chunk size and capacity")
    parser.add_argument("--trace", metavar="FILE", help="Mooncake-format JSONL trace (timestamp, input_length, "
                                                       "output_length, hash_ids); or a recording of kvtier's own "
                                                       "traffic: its folder or its first trace-NNN.jsonl")
    parser.add_argument("--meta", metavar="FILE",
                        help="a recording's trace-meta.json (default: the one next to --trace, if any): replay "
                             "models the recorded engine's tiers, policies and tokens per block unless --capacity, "
                             "--policy or --block-tokens say otherwise")
    parser.add_argument("--no-meta", action="store_true",
                        help="ignore a trace-meta.json next to --trace (capacities then default to 10%%)")
    parser.add_argument("--skip-bad", action="store_true", help="skip malformed lines (counted) instead of failing")
    parser.add_argument("--block-tokens", type=number_arg("--block-tokens", int), default=None, metavar="N",
                        help=f"tokens per hash id (default: the recording's, else {DEFAULT_BLOCK_TOKENS}, as in "
                             "Mooncake traces)")
    parser.add_argument("--policy", action="append", metavar="NAME[+ADMISSION]",
                        help=f"eviction policy, optionally with an admission filter, e.g. s3fifo+doorkeeper; once "
                             f"for all tiers or once per tier (default {config.RECOMMENDED_EVICTION_POLICY})")
    parser.add_argument("--capacity", action="append", metavar="N[%]",
                        help="a tier's capacity in blocks, or N%% of the trace's distinct blocks; repeat for "
                             "several tiers, fastest first (default 10%%)")
    parser.add_argument("--replicas", type=number_arg("--replicas", int), default=1, metavar="N",
                        help="spread the requests over N replicas in turn (a router without prefix affinity); each "
                             "replica has its own tiers, of the given capacities (default 1)")
    parser.add_argument("--shared", action="store_true",
                        help="with --replicas: the last --capacity is one tier shared by every replica (a remote "
                             "tier on Valkey/Redis), and the result is compared with private last tiers holding the "
                             "same bytes in all (capacity / N each)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--list-policies", action="store_true",
                        help="name every policy and admission filter (with --json: as a JSON object)")
    parser.add_argument("--sweep", metavar="PNG", help="replay several capacities and policies and plot prefix hit "
                                                       "ratio against capacity into PNG (one line per policy + OPT)")
    parser.add_argument("--sweep-capacities", metavar="LIST",
                        help="comma-separated capacities for --sweep (default 1%%,2%%,5%%,10%%,20%%,30%%,50%%)")
    parser.add_argument("--no-opt", action="store_true", help="skip the OPT bound (faster on huge traces)")
    parser.add_argument("--model-kv-bytes-per-token", type=number_arg("--model-kv-bytes-per-token", int),
                        metavar="BYTES", help="KV cache bytes per token of the model (all layers, K and V)")
    parser.add_argument("--bandwidth", action="append", type=number_arg("--bandwidth"), metavar="GB/S",
                        help="link bandwidth of a tier in GB/s; once for all tiers or once per tier")
    parser.add_argument("--prefill-tokens-per-s", type=number_arg("--prefill-tokens-per-s"), metavar="TOKENS",
                        help="prefill throughput, to turn hits into prefill time saved")
    parser.add_argument("--transfer-latency-us", type=number_arg("--transfer-latency-us", allow_zero=True),
                        default=50.0, metavar="US",
                        help="fixed cost per transfer for 'analyze' chunk sizing (default 50)")
    parser.add_argument("--budget-gib", type=number_arg("--budget-gib"), metavar="GIB",
                        help="'analyze': largest tier capacity to recommend, in GiB (needs --model-kv-bytes-per-token)")


def _per_tier(values: list[T] | None, n: int, option: str, default: T) -> list[T]:
    if not values:
        return [default] * n
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise ReplayError(f"{option}: give it once, or once per --capacity ({n}), not {len(values)} times")
    return values


def _first_doc_line(obj: Any) -> str:
    return (obj.__doc__ or sys.modules[obj.__module__].__doc__ or "").strip().splitlines()[0]


def policies_dict() -> dict[str, Any]:
    return {
        "default": config.RECOMMENDED_EVICTION_POLICY,
        "eviction_policies": [{"name": name, "default": name == config.RECOMMENDED_EVICTION_POLICY,
                               "description": _first_doc_line(cls)} for name, cls in POLICIES.items()],
        "admission_filters": [{"name": name, "description": "admit every offer" if f is None else _first_doc_line(f)}
                              for name, f in ADMISSIONS.items()],
    }


def list_policies() -> str:
    lines = ["eviction policies:"]
    for name, cls in POLICIES.items():
        doc = (cls.__doc__ or sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]
        mark = " (default)" if name == config.RECOMMENDED_EVICTION_POLICY else ""
        lines.append(f"  {name}{mark}: {doc}")
    lines.append("admission filters (append as NAME+FILTER):")
    for name, factory in ADMISSIONS.items():
        doc = "admit every offer" if factory is None else (factory.__doc__ or "").strip().splitlines()[0]
        lines.append(f"  {name}: {doc}")
    return "\n".join(lines)


def result_dict(res: ReplayResult, args: argparse.Namespace, bandwidths: list[float | None]) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = []
    for st, bw in zip(res.tiers, bandwidths):
        t = {
            "name": st.name, "policy": st.policy, "capacity_blocks": st.capacity_blocks,
            "block_hit_ratio": res.ratio(st.hits), "prefix_hit_ratio": res.ratio(st.prefix_hits),
            "opt_block_hit_ratio": res.ratio(st.opt_hits),
            # OPT at the combined capacity of this tier and the ones above: what tiers 1..i could load at best.
            "opt_prefix_hit_ratio": res.ratio(st.opt_prefix_hits_through),
            "opt_marginal_prefix_hit_ratio": res.ratio(st.opt_prefix_hits),
            "promotions": st.promotions, "loaded_blocks": st.prefix_hits, "stored_blocks": st.stored_blocks,
            "bytes_moved": None,
        }
        if args.model_kv_bytes_per_token and not st.device:  # the device tier (vLLM's prefix cache) moves nothing
            block_bytes = args.model_kv_bytes_per_token * args.block_tokens
            t["bytes_moved"] = (st.prefix_hits + st.stored_blocks) * block_bytes
            t.update(tier_cost(args.block_tokens, args.model_kv_bytes_per_token, st.prefix_hits, bw,
                               args.prefill_tokens_per_s).as_dict())
        tiers.append(t)
    total: dict[str, Any] = {
        "capacity_blocks": sum(st.capacity_blocks for st in res.tiers),
        "block_hit_ratio": res.ratio(res.total_hits), "prefix_hit_ratio": res.ratio(res.total_prefix_hits),
        "opt_block_hit_ratio": res.ratio(sum(st.opt_hits for st in res.tiers)),
        "opt_prefix_hit_ratio": res.ratio(res.total_opt_prefix_hits),
        "bytes_moved": (sum(t["bytes_moved"] or 0 for t in tiers) if args.model_kv_bytes_per_token else None),
    }
    # What offloading saves: vLLM's own prefix cache serves its share without kvtier.
    saved = [t.get("estimated_prefill_seconds_saved") for t, st in zip(tiers, res.tiers) if not st.device]
    total["estimated_prefill_seconds_saved"] = sum(saved) if saved and all(s is not None for s in saved) else None
    return {"requests": res.n_requests, "block_accesses": res.n_accesses, "distinct_blocks": res.n_distinct,
            "block_tokens": args.block_tokens, "tiers": tiers, "total": total,
            "replay_accesses_per_second": res.accesses_per_second}


def format_result(d: dict[str, Any], trace_name: str, skipped: int, no_opt: bool) -> str:
    head = (f"trace {trace_name}: {d['requests']} requests, {d['block_accesses']} block accesses, "
            f"{d['distinct_blocks']} distinct blocks, {d['block_tokens']} tokens/block")
    if skipped:
        head += f" ({skipped} malformed lines skipped)"
    cols = ["tier", "policy", "capacity", "block hit", "prefix hit", "OPT thru tier", "of OPT", "promotions",
            "loaded", "stored", "bytes moved"]
    rows = []
    for t in d["tiers"] + [dict(d["total"], name="total", policy="", promotions="", loaded_blocks="",
                                stored_blocks="")]:
        opt = t["opt_prefix_hit_ratio"]
        rows.append([
            t["name"], t["policy"], str(t["capacity_blocks"]), f"{t['block_hit_ratio']:.4f}",
            f"{t['prefix_hit_ratio']:.4f}", "-" if no_opt else f"{opt:.4f}",
            # A tier's OPT share is a marginal figure, not a bound, so "of OPT" is shown for the total only.
            "-" if no_opt or not opt or (len(d["tiers"]) > 1 and t["name"] != "total")
            else f"{t['prefix_hit_ratio'] / opt:.1%}", str(t["promotions"]),
            str(t["loaded_blocks"]), str(t["stored_blocks"]),
            "-" if t["bytes_moved"] is None else _human_bytes(t["bytes_moved"]),
        ])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines = [head, "  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    for t in d["tiers"]:
        if t.get("transfer_seconds_per_block") is None and t.get("recompute_seconds_per_block") is None:
            continue
        parts = [f"{t['name']}:"]
        if t.get("transfer_seconds_per_block") is not None:
            parts.append(f"transfer {t['transfer_seconds_per_block'] * 1e3:.3f} ms/block")
        if t.get("recompute_seconds_per_block") is not None:
            parts.append(f"recompute {t['recompute_seconds_per_block'] * 1e3:.3f} ms/block")
        if t.get("estimated_prefill_seconds_saved") is not None:
            parts.append(f"estimated prefill time saved {t['estimated_prefill_seconds_saved']:.1f} s")
        if t.get("slower_than_recompute"):
            parts.append("-- SLOWER THAN RECOMPUTE: loading from this tier costs more than it saves")
        lines.append(" ".join(parts))
    if d["total"].get("estimated_prefill_seconds_saved") is not None:
        lines.append(f"total estimated prefill time saved: {d['total']['estimated_prefill_seconds_saved']:.1f} s")
    eq = d["total"].get("lru_equivalent_capacity_blocks")
    if eq is not None:
        lines.append(f"capacity equivalence: {d['total']['capacity_blocks']} blocks of this setup load as many blocks as "
                     f"one LRU cache of {eq} blocks (worth {d['total']['memory_factor_vs_lru']:.2f}x the memory)")
    if d.get("replicas", 1) > 1:
        lines.append(f"replicas: {d['replicas']} (requests in turn); private tiers' capacity is per replica")
    alt = d.get("private_alternative")
    if alt:
        shared = d["tiers"][-1]
        lines.append(f"shared last tier: prefix hit {d['total']['prefix_hit_ratio']:.4f} (last tier "
                     f"{shared['prefix_hit_ratio']:.4f}); the same bytes as private last tiers of "
                     f"{alt['last_tier_capacity_blocks_per_replica']} blocks each: {alt['prefix_hit_ratio']:.4f} "
                     f"(last tier {alt['last_tier_prefix_hit_ratio']:.4f})")
    lines.append("OPT thru tier: Belady's OPT with the combined capacity of this tier and those above it")
    lines.append(f"replay speed: {d['replay_accesses_per_second']:,.0f} block accesses/s")
    return "\n".join(lines)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def run(args: argparse.Namespace) -> int:
    """Execute parsed arguments; returns the exit status. ReplayError/TraceError become exit 2."""
    try:
        return _run(args)
    except BrokenPipeError:  # output piped into e.g. `head`: not an error of the replay
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- keeps the interpreter's final flush quiet
        return 0
    except (ReplayError, TraceError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{PROG}: error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.list_policies:
        print(json.dumps(policies_dict(), indent=2) if args.json else list_policies())
        return 0
    if not args.trace:
        raise ReplayError("--trace: required (a Mooncake-format JSONL file)")
    if args.budget_gib and not args.model_kv_bytes_per_token:
        raise ReplayError("--budget-gib: needs --model-kv-bytes-per-token to turn bytes into blocks")
    if args.sweep:
        check_plot_path(args.sweep)
    files, meta_path = recording_files(args.trace)
    if args.meta:
        meta_path = pathlib.Path(args.meta)
    elif args.no_meta:
        meta_path = None
    model = load_meta(meta_path) if meta_path is not None else None
    if args.block_tokens is None:
        args.block_tokens = model.tokens_per_block if model is not None else DEFAULT_BLOCK_TOKENS
    trace = load_traces(files, skip_bad=args.skip_bad)
    if model is not None:
        note = _model_note(model, args)
        if args.action is not None or args.sweep:
            note += f" (tokens per block only: {'analyze' if args.action else '--sweep'} chooses its own capacities)"
        print(note, file=sys.stderr if args.json else sys.stdout)
    for warning in trace_warnings(trace, args.block_tokens):
        print(f"{PROG}: {warning}", file=sys.stderr)
    if trace.skipped_lines and not args.json:
        print(f"skipped {trace.skipped_lines} malformed lines, e.g. {trace.skipped_reasons[0]}", file=sys.stderr)
    n_distinct = trace.n_distinct
    specs = [PolicySpec.parse(p) for p in (args.policy or [config.RECOMMENDED_EVICTION_POLICY])]

    if args.action == "analyze":
        return _analyze(args, trace, specs)
    if args.sweep:
        return _sweep(args, trace, specs, n_distinct)

    if model is not None and not args.capacity:
        caps = list(model.capacities)
        if not args.policy:
            specs = [PolicySpec.parse(p) for p in model.policies]
    else:
        caps = [capacity_blocks(c, n_distinct) for c in (args.capacity or ["10%"])]
    specs = _per_tier(specs, len(caps), "--policy", PolicySpec.parse(config.RECOMMENDED_EVICTION_POLICY))
    bandwidths = _per_tier(args.bandwidth, len(caps), "--bandwidth", None)
    if args.shared and args.replicas < 2:
        raise ReplayError("--shared: needs --replicas 2 or more (one replica has nothing to share)")
    # The recorded engine as it served the traffic (vLLM's prefix cache first, its lookup and store rules):
    # what its own counters measured. Capacity flags or replicas ask what other tiers would serve instead.
    engine_model = model is not None and not args.capacity and args.replicas == 1
    if model is not None and engine_model:
        res = replay_recorded(trace, caps, specs, model.device_chunks, with_opt=not args.no_opt,
                              names=model.names, tokens_per_block=model.tokens_per_block)
        bandwidths = ([None] if model.device_chunks is not None else []) + bandwidths
    else:
        res = replay(trace, caps, specs, with_opt=not args.no_opt, replicas=args.replicas, shared_last=args.shared)
    d = result_dict(res, args, bandwidths)
    d["replicas"] = args.replicas
    if args.shared:
        # The same bytes in the store, split into private last tiers: what sharing buys at that budget.
        private = caps[:-1] + [max(1, caps[-1] // args.replicas)]
        alt = replay(trace, private, specs, with_opt=False, replicas=args.replicas)
        d["private_alternative"] = {"last_tier_capacity_blocks_per_replica": private[-1],
                                    "prefix_hit_ratio": alt.ratio(alt.total_prefix_hits),
                                    "last_tier_prefix_hit_ratio": alt.ratio(alt.tiers[-1].prefix_hits)}
    if not args.no_opt and args.replicas == 1:
        keys, lengths = flatten(trace.requests)
        d["total"].update(equivalence(LRUCurve(keys, lengths), d["total"]["capacity_blocks"], res.total_prefix_hits))
    d["trace"] = str(args.trace)
    d["trace_files"] = [str(f) for f in files]
    d["model"] = _model_dict(model, args)
    if model is not None:
        d["model"]["replay"] = "recorded engine" if engine_model else "tiers"
    d["skipped_lines"] = trace.skipped_lines
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        print(format_result(d, str(args.trace), trace.skipped_lines, args.no_opt))
    return 0


def _model_dict(model: RecordedModel | None, args: argparse.Namespace) -> dict[str, Any]:
    """Which engine the replay modelled: the recorded one (and which of its facts flags overrode) or the flags."""
    if model is None:
        return {"source": "flags"}
    return {"source": "recording", "meta": str(model.path), "tiers": [
        {"name": n, "medium": m, "capacity_blocks": c, "policy": p}
        for n, m, c, p in zip(model.names, model.media, model.capacities, model.policies)],
        "tokens_per_block": model.tokens_per_block, "device_blocks": model.device_blocks,
        "device_chunks": model.device_chunks,
        "overridden": [o for o, v in (("--capacity", args.capacity), ("--policy", args.policy),
                                      ("--block-tokens", args.block_tokens != model.tokens_per_block)) if v]}


def _model_note(model: RecordedModel, args: argparse.Namespace) -> str:
    d = _model_dict(model, args)
    tiers = ", ".join(f"{t['name']} ({t['medium']}) {t['capacity_blocks']} blocks {t['policy']}" for t in d["tiers"])
    modelled = d["device_chunks"] is not None and not args.capacity and args.replicas == 1
    device = f"device (vLLM prefix cache) {d['device_chunks']} blocks, " if modelled else ""
    note = f"model: the recorded engine ({model.path}): {device}{tiers}; {model.tokens_per_block} tokens/block"
    if d["overridden"]:
        note += f" -- overridden by {', '.join(d['overridden'])}"
    return note


def check_plot_path(path: str) -> None:
    """Fail before a long sweep, not after it: the plot's format comes from its extension and its folder must exist."""
    p = pathlib.Path(path)
    if p.suffix.lower() not in PLOT_FORMATS:
        raise ReplayError(f"--sweep: {path!r} must end in {', '.join(PLOT_FORMATS)} (the plot's format)")
    folder = p.parent if str(p.parent) else pathlib.Path(".")
    if not folder.is_dir():
        raise ReplayError(f"--sweep: folder {str(folder)!r} of {path!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise ReplayError(f"--sweep: folder {str(folder)!r} of {path!r} is not writable")
    if p.is_dir():
        raise ReplayError(f"--sweep: {path!r} is a folder, not a file")


def _sweep(args: argparse.Namespace, trace: Trace, specs: list[PolicySpec], n_distinct: int) -> int:
    from .sweep import DEFAULT_PERCENTS, format_sweep, plot, sweep

    raw = args.sweep_capacities.split(",") if args.sweep_capacities else [f"{p:g}%" for p in DEFAULT_PERCENTS]
    caps = sorted({capacity_blocks(c, n_distinct, "--sweep-capacities") for c in raw if c.strip()})
    if not caps:
        raise ReplayError("--sweep-capacities: no capacity given")
    if not args.policy:  # one line per eviction policy by default
        specs = [PolicySpec(name) for name in POLICIES]
    result = sweep(trace, caps, specs, show_progress=not args.json)
    plot(result, args.sweep, f"{args.trace} ({trace.n_accesses} block accesses)")
    result["plot"] = str(args.sweep)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_sweep(result))
        print(f"plot written to {args.sweep}")
    return 0


def _analyze(args: argparse.Namespace, trace: Trace, specs: list[PolicySpec]) -> int:
    from tqdm import tqdm

    from .analyze import Budgets, analyze, format_analysis

    budgets = Budgets(
        kv_bytes_per_token=args.model_kv_bytes_per_token,
        bandwidth_gb_s=args.bandwidth[0] if args.bandwidth else None,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        transfer_latency_s=args.transfer_latency_us * 1e-6,
        capacity_bytes=int(args.budget_gib * 2**30) if args.budget_gib else None,
    )
    # Sizing advice comes from the best policy the user could deploy: every policy unless --policy names some.
    candidates = specs if args.policy else [PolicySpec(name) for name in POLICIES]
    with tqdm(total=8 * len(candidates), desc="analyze", unit="run", disable=args.json) as bar:
        a = analyze(trace, args.block_tokens, candidates, budgets, progress=bar.update)
    if args.json:
        print(json.dumps(a, indent=2))
    else:
        print(format_analysis(a))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG)
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["recommend"]:  # its own options (its --policy is a KVCachePolicy file, not a policy name)
        return recommend(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    return run(args)
