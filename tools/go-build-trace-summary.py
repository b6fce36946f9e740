#!/usr/bin/env python3
"""Where a `go build -debug-trace=FILE` run spent its time: package loading, compile time summed by package
group (import-path prefix), link. One column per trace given, so two builds print side by side.

Usage: tools/go-build-trace-summary.py BEFORE.json [AFTER.json ...]

The seconds are wall-clock spans of each action, so on a busy machine they grow with the load of the moment;
compare CPU totals from /usr/bin/time for builds that ran under different load.
"""

import collections
import json
import sys

# (label, import-path prefixes); the first group whose prefix matches wins, so narrower groups come first.
GROUPS = [
    ("k8s.io/kubernetes/pkg/scheduler (+ k8s.io/kube-scheduler)", ["k8s.io/kubernetes/pkg/scheduler", "k8s.io/kube-scheduler"]),
    ("k8s.io/kubernetes/pkg/controller", ["k8s.io/kubernetes/pkg/controller"]),
    ("k8s.io/kubernetes/pkg/volume", ["k8s.io/kubernetes/pkg/volume"]),
    ("k8s.io/kubernetes/pkg/kubelet, k8s.io/kubelet", ["k8s.io/kubernetes/pkg/kubelet", "k8s.io/kubelet"]),
    ("github.com/google/cadvisor", ["github.com/google/cadvisor"]),
    ("k8s.io/cloud-provider", ["k8s.io/cloud-provider"]),
    ("rest of k8s.io/kubernetes/pkg", ["k8s.io/kubernetes/pkg"]),
    ("k8s.io/kubernetes cmd, plugin", ["k8s.io/kubernetes"]),
    ("k8s.io/apiserver, apiextensions-apiserver, kube-aggregator",
     ["k8s.io/apiserver", "k8s.io/apiextensions-apiserver", "k8s.io/kube-aggregator"]),
    ("k8s.io/client-go", ["k8s.io/client-go"]),
    ("k8s.io/kubectl", ["k8s.io/kubectl"]),
    ("other k8s.io", ["k8s.io"]),
    ("go.etcd.io", ["go.etcd.io"]),
]
OTHER, STD = "other third-party", "standard library"


def group(pkg: str) -> str:
    for label, prefixes in GROUPS:
        if any(pkg == p or pkg.startswith(p + "/") for p in prefixes):
            return label
    return STD if "." not in pkg.split("/")[0] else OTHER


def summarize(path: str) -> collections.Counter:
    with open(path, encoding="utf-8") as f:
        events = json.load(f)
    began: dict = {}
    out: collections.Counter = collections.Counter()
    for e in events:
        name, key = e["name"], (e["name"], e.get("tid"))
        if e["ph"] == "B":
            began[key] = e["ts"]
            continue
        if e["ph"] != "E" or key not in began:
            continue
        seconds = (e["ts"] - began.pop(key)) / 1e6
        if name == "load.PackagesAndErrors":
            out["load packages (and download modules)"] += seconds
        elif name.startswith("Executing action ("):
            kind, _, pkg = name[len("Executing action ("):-1].rpartition(" ")
            if kind == "build":
                out["compile " + group(pkg)] += seconds
                out["compile, all"] += seconds
                out["packages compiled"] += 1
            elif kind == "link":
                out["link"] += seconds
    stamps = [e["ts"] for e in events]
    out["trace span (wall)"] = (max(stamps) - min(stamps)) / 1e6
    return out


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    columns = [summarize(p) for p in paths]
    rows = ["load packages (and download modules)"]
    rows += ["compile " + label for label, _ in GROUPS] + ["compile " + OTHER, "compile " + STD]
    rows += ["compile, all", "packages compiled", "link", "trace span (wall)"]
    print("| seconds | " + " | ".join(paths) + " |")
    print("|---|" + "---|" * len(paths))
    for row in rows:
        print(f"| {row} | " + " | ".join(f"{c[row]:,.0f}" for c in columns) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
