"""One rule set for a remote store's URL and for Secret keys: whatever the API server refuses (the schema's pattern
and bounds, then the CEL rules of the checked-in CRD, evaluated with RE2 as on the server), `kvtier validate` (the
pydantic models) and the runtime (check_remote_url) refuse too, and the other way round. Before, the API server
stored policies with a doubled port, a port over 65535, an unbracketed IPv6 address, Unicode spaces or digits, or an
empty Secret key, which the others refused (or read differently)."""
from __future__ import annotations

import ipaddress
import pathlib
import re

import celpy
import pytest
import re2
import yaml
from kvtier_operator.api import v1alpha1 as api
from kvtier_operator.api.validation import _program
from kvtier_runtime.config import ConfigError, check_remote_url
from pydantic import ValidationError

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "kvtier.io_kvcachepolicies.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
REMOTE = SCHEMA["properties"]["spec"]["properties"]["tiers"]["items"]["properties"]["remote"]
URL_NODE = REMOTE["properties"]["url"]
KEY_NODE = REMOTE["properties"]["passwordSecret"]["properties"]["key"]
MAC = {"name": "kv-mac", "key": "mac"}

GOOD_URLS = [
    "redis://valkey.kv:6379", "rediss://valkey.kv.svc.cluster.local:6380/0", "redis://10.0.0.1:6379/15",
    "redis://h:1", "redis://h:65535/", "redis://[fd00::1]:6379", "rediss://[::1]:6379/2", "redis://[::]:1",
    "redis://[2001:db8:0:0:0:0:0:1]:6379", "redis://[fe80::1:2]:6379", "redis://a-b.c-d:99",
    "redis://" + "a" * 63 + ".kv:6379",
]
BAD_URLS = [
    "redis://h:1:2",                      # a doubled port: Python read host 'h:1', port 2
    "redis://h:65536", "redis://h:99999", "redis://h:0", "redis://h:06379", "redis://h:",
    "redis://h", "redis://:6379", "redis://fd00::1:6379",  # unbracketed IPv6
    "redis://[fd00::1::2]:6379", "redis://[fd00::g]:6379", "redis://[fe80::1%eth0]:6379", "redis://[]:6379",
    "redis://[1.2.3.4]:6379", "redis://[fd00::1]", "redis://[fd00::1]:6379]",
    "redis://h\u00a0:6379",               # no-break space
    "redis://h\u2003x:6379",              # em space
    "redis://h:\u0661\u0662",             # Arabic-Indic digits
    "redis://h:\uff16\uff13\uff17\uff19",  # fullwidth digits
    "redis://h\u3000:6379", "redis://h:6379\u2028", "redis://h :6379", "redis://h:6379 ", "redis://h:6379\n",
    "redis://h:6379\t", "redis://h\u202e:6379", "redis://h\x1b:6379", "redis://\u0430pple.kv:6379",  # Cyrillic a
    "redis://h_x:6379", "redis://-h:6379", "redis://h-:6379", "redis://a..b:6379", "redis://.h:6379",
    "redis://h.:6379", "redis://" + "a" * 64 + ".kv:6379",
    "redis://h:6379/100", "redis://h:6379/x", "redis://h:6379//1", "redis://h:6379/1/2", "redis://h:6379/\u0661",
    "redis://user:pw@h:6379", "redis://h:6379?db=1", "redis://h:6379#x", "http://h:6379", "redis:/h:6379",
    "REDIS://h:6379", "", "redis://" + "a" * 600 + ":1",
]


def _api_server_url(url: str) -> bool:
    """What the API server admits for remote.url: maxLength, the pattern (RE2), then every CEL rule."""
    if len(url) > URL_NODE["maxLength"] or re2.search(URL_NODE["pattern"], url) is None:
        return False
    activation = {"self": celpy.json_to_cel(url)}
    return all(bool(_program(rule["rule"]).evaluate(activation)) for rule in URL_NODE["x-kubernetes-validations"])


def _pydantic_url(url: str) -> bool:
    try:
        api.RemoteStoreSpec.model_validate({"url": url, "macKeySecret": MAC})
    except ValidationError:
        return False
    return True


def _runtime_url(url: str) -> bool:
    try:
        check_remote_url("url", url)
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("url", GOOD_URLS + BAD_URLS, ids=ascii)
def test_the_api_server_validate_and_the_runtime_agree_on_every_url(url):
    verdicts = {"api server (CRD)": _api_server_url(url), "pydantic": _pydantic_url(url),
                "runtime": _runtime_url(url)}
    assert set(verdicts.values()) == {url in GOOD_URLS}, verdicts


def test_bracketed_hosts_the_rule_admits_are_ipv6_addresses():
    # The oracle for the IPv6 part of the grammar: Python's own parser.
    for url in GOOD_URLS + BAD_URLS:
        host = re.fullmatch(r"rediss?://\[([^\]]*)\]:.*", url, re.S)
        if host and _runtime_url(url):
            ipaddress.IPv6Address(host.group(1))


GOOD_KEYS = ["password", "mac-key", "mac_key", "tls.crt", ".dockerconfigjson", "K" * 253]
BAD_KEYS = ["", " ", "a b", "a/b", "../x", "pass\u00a0word", "\u0661", "k\n", "k\x1b", "K" * 254, "é"]


def _api_server_key(key: str) -> bool:
    return (KEY_NODE.get("minLength", 0) <= len(key) <= KEY_NODE["maxLength"]
            and re2.search(KEY_NODE["pattern"], key) is not None)


def _pydantic_key(key: str) -> bool:
    try:
        api.SecretKeyRef.model_validate({"name": "kv", "key": key})
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize("key", GOOD_KEYS + BAD_KEYS, ids=ascii)
def test_the_api_server_and_validate_agree_on_every_secret_key(key):
    assert _api_server_key(key) == _pydantic_key(key) == (key in GOOD_KEYS)


@pytest.mark.controlplane
def test_the_real_api_server_agrees_with_validate_on_every_url_and_key(kube, namespace):
    """The checked-in CRD on a real API server (RE2, its own CEL cost checks): it stores exactly the policies the
    pydantic models accept."""
    from kvtier_operator.kube import ApiError, policy_path
    from plugins.operator import make_policy

    def policy(i: int, url: str, key: str) -> dict:
        tier = {"name": "shared", "medium": "remote", "size": "1Gi",
                "remote": {"url": url, "macKeySecret": {"name": "kv-mac", "key": key}}}
        return make_policy(f"p{i}", namespace, backend="kvtier",
                           tiers=[{"name": "cpu", "medium": "cpu", "size": "1Gi"}, tier])

    def stored(body: dict) -> bool:
        try:
            kube.create(policy_path(namespace), body)
        except ApiError as err:
            assert err.status == 422, err
            return False
        return True

    def validated(body: dict) -> bool:
        # The whole policy through the models: a tenant key's name is shorter than a Secret key's by the length
        # of the suffix its previous key takes, and only the field's own model knows that.
        try:
            api.KVCachePolicySpec.model_validate(body["spec"])
        except ValidationError:
            return False
        return True

    cases = [(u, "mac") for u in GOOD_URLS + BAD_URLS if len(u) <= 2000] + \
            [("redis://valkey.kv:6379", k) for k in GOOD_KEYS + BAD_KEYS]
    disagree = {}
    for i, (url, key) in enumerate(cases):
        body = policy(i, url, key)
        server, local = stored(body), validated(body)
        if server != local:
            disagree[ascii((url, key))] = {"api server": server, "validate": local}
    assert disagree == {}
