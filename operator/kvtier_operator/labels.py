"""The ``kvtier.io`` prefix, and the label and annotation through which the owners of workloads and Secrets consent
to the operator's use of them. Both the settings and the trust checks read these, so they live apart from both."""
from __future__ import annotations

PREFIX = "kvtier.io"
# Set by a workload's owner: the policy allowed to configure it ("true": any policy in its namespace). The
# operator never writes it, so only someone who may edit the workload can grant it.
OPT_IN_LABEL = f"{PREFIX}/opt-in"
OPT_IN_ANY = "true"
# Set on a Secret by someone who may edit Secrets: the remote stores (host:port, comma separated) whose tiers may
# project it into pods. The operator never writes it, so a policy author cannot mark a Secret they cannot edit.
REMOTE_STORES_ANNOTATION = f"{PREFIX}/remote-stores"
