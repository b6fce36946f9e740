"""The tenant boundary as the operator deploys it, not only as ``kvtier render`` prints it.

Every namespace is its own scope in the store: the operator renders the policy's namespace as the remote tier's
``scope``, whatever other namespace holds a policy of the same name and spec. The parse cache once dropped the
namespace from its key, so the operator rendered ``default`` for every namespace: two tenants then shared one index
and budget in the store (B's writes replaced A's chunks, B's one-chunk ``size`` trimmed A's), and the per-tenant ACL
recipe of docs/remote.md (``~kvtier:<namespace>:*``) refused every tier the operator rendered. The tests before
checked the scope in the runtime and in ``render``; these check what the operator writes into the pods' config,
and, on a real API server and a real redis-server with one ACL user per namespace, that the tiers built from that
config work for both tenants and confine each to its own keys.
"""
from __future__ import annotations

import base64
import dataclasses
import pathlib
import time
import uuid

import pytest
import yaml
from kvtier_operator import reconcile as rc
from kvtier_operator.kube import config_map_path, policy_path
from kvtier_operator.labels import REMOTE_STORES_ANNOTATION
from kvtier_runtime.config import OffloadSpecConfig, RemoteTierConfig
from plugins.operator import deployment, observed, policy

NOW = "2026-12-06T08:00:00Z"
CPU = {"name": "cpu", "medium": "cpu", "size": "16Gi"}


def remote_tier(url: str, username: str | None = None) -> dict:
    remote = {"url": url, "passwordSecret": {"name": "store-login", "key": "password"},
              "macKeySecret": {"name": "tenant-key", "key": "key"}}
    if username:
        remote["username"] = username
    return {"name": "shared", "medium": "remote", "size": "64Mi", "remote": remote}


def rendered_remote_tiers(config_map: dict) -> list[RemoteTierConfig]:
    """The remote tiers of the engine config a ConfigMap carries, parsed by the runtime's own parser."""
    engine = yaml.safe_load(config_map["data"]["engine.yaml"])
    extra = engine["kv-transfer-config"]["kv_connector_extra_config"]
    return [t.config for t in OffloadSpecConfig.from_extra_config(extra).tiers if isinstance(t.config, RemoteTierConfig)]


def test_the_operator_renders_each_namespace_as_its_own_scope_for_one_name_and_spec():
    store = "redis://valkey.kv:6379"
    plans = {}
    # The same name and spec in three namespaces, planned in turn through the one parse cache the operator uses.
    for ns in ("team-a", "team-b", "team-a", "default"):
        pol = policy(tiers=[CPU, remote_tier(store)], backend="kvtier", engine="vllm")
        pol["metadata"]["namespace"] = ns
        w = observed(deployment())
        w["metadata"]["namespace"] = ns
        plans[ns] = rc.plan(pol, [w], [], now=NOW, remote_stores_allowed=(store,))
    for ns, p in plans.items():
        assert not p.invalid
        [tier] = rendered_remote_tiers(p.config_map)
        assert tier.scope == ns, f"namespace {ns} rendered scope {tier.scope}"


# ---------------------------------------------------------------------------------------------- real API server


def _secret(name: str, data: dict[str, bytes], store: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "annotations": {
        REMOTE_STORES_ANNOTATION: store}}, "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}


def _as_mounted(tier: RemoteTierConfig, secrets: dict[str, bytes], root: pathlib.Path) -> RemoteTierConfig:
    """The tier as the kubelet would hand it to the engine: each rendered file path holds the Secret key's bytes
    (under ``root`` here instead of /etc/kvtier-remote)."""
    paths = {}
    for field, value in (("password_file", secrets["password"]), ("mac_key_file", secrets["key"])):
        path = root / pathlib.Path(getattr(tier, field)).name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(value)
        paths[field] = str(path)
    return dataclasses.replace(tier, previous_mac_key_file=None, **paths)


@pytest.mark.controlplane
@pytest.mark.slow
def test_two_namespaces_through_the_operator_each_use_their_own_acl_user_and_keys(kube, namespace, run_operator,
                                                                                  tmp_path):
    """docs/remote.md's recipe on a real store: one ACL user per namespace, confined to ``~kvtier:<namespace>:*``.
    Two namespaces hold a policy of the same name and spec; the operator renders each its own scope, and the tiers
    built from the rendered config (what each engine runs) store and load through their own user, never see each
    other's chunks, and are refused by the store if they reach for the other scope's keys."""
    import redis
    import torch
    from kvtier_runtime.remote.identity import acl_rule, model_identity, scope_pattern
    from kvtier_runtime.remote.tier import RemoteTier
    from plugins.operator import user_apply, wait_applied
    from plugins.redis_server import RedisServer
    from plugins.runtime import key_of
    from plugins.tier_sync import connected, load_blocks, store_blocks

    other = f"op-{uuid.uuid4().hex[:8]}"
    kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": other}})
    server = RedisServer(tmp_path / "store", password="admin-password").start()
    tiers: list[RemoteTier] = []
    try:
        store = f"redis://127.0.0.1:{server.port}"
        admin = server.client()
        secrets: dict[str, dict[str, bytes]] = {}
        for i, ns in enumerate((namespace, other)):
            secrets[ns] = {"password": f"{ns}-password".encode(), "key": bytes([i + 1]) * 32}
            admin.execute_command("ACL", "SETUSER", ns, "reset", "on", f">{ns}-password", *acl_rule(ns))
            for name, key in (("store-login", "password"), ("tenant-key", "key")):
                kube.create(f"/api/v1/namespaces/{ns}/secrets", _secret(name, {key: secrets[ns][key]}, store))
            user_apply(kube, deployment("llm", ns))
        run_operator(namespaces=(namespace, other), remote_stores_allowed=(store,),
                     remote_secret_namespaces=(namespace, other))
        for ns in (namespace, other):
            kube.create(policy_path(ns), {**policy(tiers=[CPU, remote_tier(store, username=ns)], backend="kvtier",
                                                   engine="vllm"), "metadata": {"name": "llm"}})
        configs = {}
        for ns in (namespace, other):
            wait_applied(kube, ns, "llm", "llm")
            [rendered] = rendered_remote_tiers(kube.get(config_map_path(ns, "kvtier-llm")))
            assert rendered.scope == ns and rendered.username == ns
            configs[ns] = _as_mounted(rendered, secrets[ns], tmp_path / ns)

        identity = model_identity({"model": "served-in-two-namespaces"})
        row = 2048

        def block(key: bytes, ns: str) -> torch.Tensor:
            g = torch.Generator().manual_seed(int.from_bytes(key[:4], "big") + len(ns))
            return torch.randn(row, generator=g).to(torch.float16)

        for ns in (namespace, other):
            tiers.append(RemoteTier(configs[ns], (row,), torch.float16, identity=identity,
                                    name=f"{ns}-{time.monotonic_ns()}", backoff_base_s=0.2))
        a, b = tiers
        assert connected(a) and connected(b)
        keys = [key_of(700 + i) for i in range(4)]
        for tier, ns in ((a, namespace), (b, other)):
            assert store_blocks(tier, keys, [block(k, ns) for k in keys]).success, f"{ns} could not store"
        for tier, ns in ((a, namespace), (b, other)):
            outs = [torch.zeros(row, dtype=torch.float16) for _ in keys]
            assert load_blocks(tier, keys, outs).success
            assert all(torch.equal(o, block(k, ns)) for o, k in zip(outs, keys)), f"{ns} read another's chunk"
            assert not tier.store_failures and not tier.misses
        # Each namespace's chunks and index live under its own prefix, which its ACL user alone may touch.
        for ns in (namespace, other):
            assert len(admin.keys(scope_pattern(ns))) == len(keys) + 1  # the chunks and the scope's index
        as_a = redis.Redis(host="127.0.0.1", port=server.port, username=namespace,
                           password=f"{namespace}-password", socket_timeout=5)
        with pytest.raises(redis.exceptions.NoPermissionError):
            as_a.keys(scope_pattern(other))
        as_a.close()
        # A tier rendered for one namespace with the other's login is refused by the store, not served.
        crossed = RemoteTier(dataclasses.replace(configs[namespace], username=other,
                                                 password_file=configs[other].password_file),
                             (row,), torch.float16, identity=identity, name=f"crossed-{time.monotonic_ns()}",
                             backoff_base_s=0.2)
        tiers.append(crossed)
        assert connected(crossed)
        result = store_blocks(crossed, [key_of(799)], [block(key_of(799), namespace)])
        assert not result.ok[0] and result.errors[0] == "auth"
        assert not admin.exists(a.store_key(key_of(799)))
    finally:
        for tier in tiers:
            tier.close()
        server.kill()
        kube.delete(policy_path(other, "llm"))
        try:
            from plugins.operator import wait_for as _wait

            _wait(lambda: not kube.list(policy_path(other)), 20, what="the other namespace's policy released")
        finally:
            kube.delete(f"/api/v1/namespaces/{other}")
