"""The end-to-end scenario, shared by the demo (``python -m scenario``, what ``make demo`` runs) and the e2e tests
(``tests/e2e``). It is test and demo code, kept out of the product package (``kvtier_operator``), which it drives
from outside as a user would: through the API server, Prometheus and the pods' endpoints.

install -> apply a workload and a policy -> the workload carries its rendered configuration -> latency rises ->
the SLO guard disables the newest tier (status, Event and rendered config agree) -> latency recovers -> the tier
is re-enabled. ``local`` runs it on a local control plane (``e2e/controlplane``) with a real node
(``e2e/node``: containerd, a kubelet) that runs the pods, the operator installed by its chart as a pod, and a real
Prometheus process; ``kind/`` holds the same scenario for a kind cluster.

Import it with ``e2e/`` on ``sys.path`` (pytest's ``pythonpath`` has it; ``PYTHONPATH=e2e`` elsewhere).

Modules: ``repo`` (finding the checkout), ``processes`` (every process started, stopped on exit or Ctrl-C),
``prometheus``, ``pods`` (the node's pods as the scenario sees them), ``slowdisk``, ``manifests``, ``observe`` (snapshots and the status table),
``local`` (the environment), ``steps`` (the scenario itself), ``__main__`` (the narrated demo).
"""
