"""The demo: the end-to-end scenario on the local provider, narrated for a newcomer (``make demo``).

Run from a checkout: ``PYTHONPATH=e2e python -m scenario`` (``kvtier demo`` delegates here).

It starts a local control plane and a real node, Prometheus and the operator (a pod, by its chart), applies a
workload and a policy (the node's kubelet runs its pods),
makes latency rise, watches the SLO guard roll back the newest tier, lets latency recover and re-enables the
tier, printing a status table as it goes. Everything it starts stops when it ends, also on Ctrl-C. Logs stay
in the work directory it prints. The steps live in ``steps``.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

# The scenario belongs to this checkout: drive this checkout's operator, not some other installed copy.
_CHECKOUT = Path(__file__).resolve().parents[2]
for _sub in ("runtime", "operator"):
    if (_CHECKOUT / _sub).is_dir() and str(_CHECKOUT / _sub) not in sys.path:
        sys.path.insert(0, str(_CHECKOUT / _sub))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scenario", description="Run the end-to-end scenario on a local cluster (control plane and a real node), narrated.")
    p.add_argument("--repo", help="the kvtier checkout (its e2e/ folder builds the control plane and holds the "
                                  "synthetic engine); default: $KVTIER_REPO, the checkout holding this scenario, or the "
                                  "current directory")
    p.add_argument("--workdir", help="where logs and state go (default: a new /tmp/kvtier-demo-* directory)")
    p.add_argument("--kubeconfig", help="use this already running cluster instead of starting one: one whose "
                                        "directory holds a running node (e2e/node/run), and no kvtier operator "
                                        "(the demo installs its own by the chart and removes it at the end)")
    p.add_argument("--namespace", default="kvtier-demo", help="namespace the demo creates and deletes "
                                                              "(default kvtier-demo)")
    p.add_argument("--no-color", action="store_true", help="plain output even on a terminal")
    p.add_argument("--engine", choices=("vllm-cpu", "synthetic"), default="vllm-cpu",
                   help="vllm-cpu (default): real vLLM engines with kvtier's offloading spec, the filesystem tier on "
                        "a device made slow (needs root and the env .ci/vllm-cpu-env builds); synthetic: engines that "
                        "serve no model, whose latency the scenario sets (the guard's mechanics only)")
    p.add_argument("--vllm-python", help="the vllm-cpu env's python (default: $KVTIER_VLLM_CPU_PYTHON, else the "
                                         "checkout's .venv-vllm-cpu/bin/python)")
    p.add_argument("--trace", help="Mooncake-format JSONL trace the load replays (default: "
                                   "tests/data/mooncake-synthetic.jsonl)")
    return p


def _real_engine_problem(options) -> Optional[str]:
    """What the real engine lacks here, in one line (checked before anything starts), or None."""
    from .processes import ScenarioError
    from .slowdisk import probe_blkio, probe_dm, probe_loop
    from .vllm_pod import find_vllm_python

    try:
        find_vllm_python(options.repo, options.vllm_python)
    except ScenarioError as err:
        return str(err)
    trace = options.trace or options.repo / "tests" / "data" / "mooncake-synthetic.jsonl"
    if not trace.is_file():
        return f"--trace {trace}: no such file (the load replays a Mooncake-format trace)"
    loop = probe_loop()
    dm, blkio = (loop, loop) if loop else (probe_dm(), probe_blkio())
    if dm and blkio:
        return f"cannot make a device slow here (device-mapper delay: {dm}; cgroup v1 blkio throttle: {blkio})"
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    from .local import LocalOptions
    from .manifests import Names
    from .processes import terminate_as_interrupt
    from .repo import RepoNotFound, find_repo
    from .report import Reporter
    from .steps import ScenarioFailed, run_local

    try:
        repo = find_repo(args.repo)
    except RepoNotFound as err:
        print(f"kvtier demo: {err}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvtier-demo-"))
    options = LocalOptions(repo=repo, workdir=workdir.resolve(), names=Names(namespace=args.namespace),
                           kubeconfig=Path(args.kubeconfig) if args.kubeconfig else None, engine=args.engine,
                           vllm_python=args.vllm_python, trace=Path(args.trace) if args.trace else None)
    if options.real:
        problem = _real_engine_problem(options)
        if problem:
            print(f"kvtier demo: {problem}; --engine synthetic runs the demo without a real engine", file=sys.stderr)
            return 2
    reporter = Reporter(color=False if args.no_color else None, consecutive=2 if options.real else 3)
    if options.real:
        print("kvtier demo: a KVCachePolicy applied to a vLLM Deployment served by a real engine (vllm-cpu), the")
        print("newest tier's device made slow, the SLO breach it causes, the tier rolled back, TTFT recovering; on a")
        print("local cluster with a real node (containerd, kubelet). Most of its time is loading the engine image into")
        print("the node and two vLLM start-ups in pods (1.5-2 minutes each on a 2-core machine); Ctrl-C stops it cleanly.")
    else:
        print("kvtier demo (synthetic engines): a KVCachePolicy applied to a vLLM Deployment, an SLO breach, the")
        print("newest tier rolled back, recovery and re-enable, on a local cluster with a real node. About a minute\n"
              "once the control plane, node and images are built; Ctrl-C stops it cleanly.")
    print(f"Logs and state: {options.workdir}")
    started = time.monotonic()
    try:
        with terminate_as_interrupt():
            timings = run_local(options, reporter)
    except ScenarioFailed as err:
        reporter.error(f"\nkvtier demo failed: {err}")
        print(err.diagnostics, file=sys.stderr)
        print(f"\nThe same, with the operator log: {options.workdir / 'failure.txt'}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nkvtier demo: interrupted; every process it started was stopped (logs: {options.workdir})",
              file=sys.stderr)
        return 130
    print()
    if options.real:
        print(f"Done in {time.monotonic() - started:.0f}s (set-up {timings.setup:.0f}s, engine starts "
              f"{', '.join(f'{t:.0f}s' for t in timings.engine_start)}). Measured here: TTFT "
              + "; ".join(str(timings.ttft[p]) for p in ("healthy", "slowed", "rolled back"))
              + f". Slowdown -> {options.names.fs_tier} disabled {timings.breach_to_disable:.1f}s (first request over "
              f"the budget -> disabled {timings.first_breach_to_disable:.1f}s, bound {timings.breach_bound:.0f}s); "
              f"disabled -> the engine bypassing it live {timings.disable_to_rolled:.1f}s; re-enable -> serving from "
              f"it again {timings.reenable:.1f}s.")
        print(f"slowdown -> p99 under the budget again: {timings.p99_recovered:.0f} s, engine restarts: "
              f"{timings.engine_restarts}")
        print(f"Every process, the node, its pods and the slow device are gone. Operator log: {options.workdir / 'operator.log'}")
        return 0
    print(f"Done in {time.monotonic() - started:.0f}s (set-up {timings.setup:.0f}s). Measured here: "
          f"breach -> {options.names.fs_tier} disabled {timings.breach_to_disable:.1f}s, "
          f"disabled -> pods on the new config {timings.disable_to_rolled:.1f}s, "
          f"re-enable {timings.reenable:.1f}s.")
    print(f"Every process it started has stopped. Operator log: {options.workdir / 'operator.log'}")
    print("Next: examples/ for policies, docs/demo.md for what each step showed, docs/e2e.md for the kind provider.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
