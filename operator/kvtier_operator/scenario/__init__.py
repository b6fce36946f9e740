"""The end-to-end scenario, shared by ``kvtier demo`` and the e2e test (``tests/e2e``).

install -> apply a workload and a policy -> the workload carries its rendered configuration -> latency rises ->
the SLO guard disables the newest tier (status, Event and rendered config agree) -> latency recovers -> the tier
is re-enabled. ``local`` runs it on a local control plane (``e2e/controlplane``), a real Prometheus process and
synthetic engine processes standing in for the pods a kubelet would run; ``e2e/scenario/kind`` holds the same
scenario for a kind cluster.

Modules: ``repo`` (finding the checkout), ``processes`` (every process started, stopped on exit or Ctrl-C),
``prometheus``, ``kubelet`` (the pod stand-in), ``manifests``, ``observe`` (snapshots and the status table),
``local`` (the environment), ``steps`` (the scenario itself).
"""
