"""The scenario's pure parts: following --config to a ConfigMap key as a kubelet would, picking the current
ReplicaSet, reading tiers out of a rendered config, and the agreement check that fails the scenario."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from kvtier_operator.api.validation import parse_policy
from kvtier_operator.render import render
from kvtier_runtime.config import control_file_json
from scenario import manifests, observe
from scenario.pods import PodFailed, config_source, current_replica_set
from scenario.repo import RepoNotFound, find_repo

NAMES = manifests.Names()


def template(args=None, mounts=None, volumes=None):
    c = {"name": "vllm", "args": args if args is not None else ["m", "--config", "/etc/kvtier/engine.yaml"],
         "volumeMounts": mounts if mounts is not None else [{"name": "kvtier-config", "mountPath": "/etc/kvtier"}]}
    return {"metadata": {"annotations": {"kvtier.io/config-hash": "abc"}},
            "spec": {"containers": [c], "volumes": volumes if volumes is not None else [
                {"name": "kvtier-config", "configMap": {"name": "kvtier-p"}}]}}


def test_config_path_is_followed_through_the_mount_to_the_configmap_key():
    src = config_source(template())
    assert (src.config_map, src.key, src.mount_path, src.flag) == ("kvtier-p", "engine.yaml", "/etc/kvtier", "--config")


def test_inline_flag_items_and_trtllm_flag():
    t = template(args=["--extra_llm_api_options=/etc/kvtier/x/e.yaml"],
                 volumes=[{"name": "kvtier-config", "configMap": {"name": "cm", "items": [
                     {"key": "engine.yaml", "path": "x/e.yaml"}]}}])
    src = config_source(t)
    assert (src.key, src.flag) == ("engine.yaml", "--extra_llm_api_options")


@pytest.mark.parametrize("kwargs,message", [
    ({"args": ["m"]}, "no container passes --config"),
    ({"mounts": []}, "is on no volumeMount"),
    ({"volumes": [{"name": "kvtier-config", "emptyDir": {}}]}, "not a ConfigMap volume"),
    ({"args": ["--config"]}, "has no path"),
])
def test_a_pod_that_could_not_read_its_config_fails_with_the_reason(kwargs, message):
    with pytest.raises(PodFailed, match=message):
        config_source(template(**kwargs))


def test_current_replica_set_is_the_one_of_the_deployments_revision():
    dep = {"metadata": {"uid": "u1", "annotations": {"deployment.kubernetes.io/revision": "2"}}}
    def rs(name, uid, rev):
        return {"metadata": {"name": name, "ownerReferences": [{"uid": uid}],
                             "annotations": {"deployment.kubernetes.io/revision": rev}}}
    assert current_replica_set(dep, [rs("a", "u1", "1"), rs("b", "u2", "2"), rs("c", "u1", "2")])["metadata"][
        "name"] == "c"
    assert current_replica_set({"metadata": {"uid": "u1"}}, [rs("c", "u1", "2")]) is None


def rendered_config(enabled):
    pol = parse_policy(manifests.policy(NAMES, "http://prometheus:9090"))
    return yaml.safe_load(render(pol, enabled_tiers=enabled).files["engine.yaml"])


def test_tiers_are_read_back_from_the_real_renders():
    tiers = manifests.policy(NAMES, "http://p:9090")["spec"]["tiers"]
    assert observe.tiers_in_config(rendered_config(None), tiers) == ["host", "nvme"]
    assert observe.tiers_in_config(rendered_config(["host"]), tiers) == ["host"]
    assert observe.tiers_in_config(rendered_config([]), tiers) == []


def snapshot(enabled, rendered, pods, workload_hash="h1", status_hash="h1", mounts=("/etc/kvtier", "/mnt/kvcache"),
             control=None):
    pol = manifests.policy(NAMES, "http://p:9090")
    pol["status"] = {"tiers": [{"name": t, "state": "Enabled" if t in enabled else "Disabled"}
                               for t in ("host", "nvme")],
                     "targets": [{"name": "llama-demo", "configHash": status_hash}]}
    wl = copy.deepcopy(manifests.deployment(NAMES))
    wl["spec"]["template"]["metadata"]["annotations"] = {"kvtier.io/config-hash": workload_hash}
    wl["spec"]["template"]["spec"]["containers"][0]["volumeMounts"] = [{"name": f"v{i}", "mountPath": m}
                                                                       for i, m in enumerate(mounts)]
    cm = {"data": {"engine.yaml": yaml.safe_dump(rendered_config(rendered))}}
    if control is not None:
        cm["data"]["control.json"] = control_file_json(control, 1)
    return observe.Snapshot(0.0, pol, cm, wl, {p: rendered_config(t) for p, t in pods.items()})


def test_agreement_holds_when_every_part_carries_the_same_tiers():
    assert snapshot(["host", "nvme"], None, {"pod-a": None}).agreement() == []
    assert snapshot(["host"], ["host"], {"pod-b": ["host"]}, mounts=("/etc/kvtier",)).agreement() == []


def test_a_tier_bypassed_live_keeps_its_config_and_mount_and_agrees():
    """The guard disabled nvme; the engine bypasses it through the control file: same config, same mount."""
    s = snapshot(["host"], None, {"pod-a": None}, control=["nvme"])
    assert s.agreement() == [] and s.bypassed_tiers == ["nvme"] and s.live_tiers == ["host"]
    assert "live off: nvme" in observe.row(s)
    # A control file that does not say what status says is named.
    problems = snapshot(["host"], None, {"pod-a": None}, control=[]).agreement()
    assert any("ConfigMap renders" in p for p in problems), problems


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(enabled=["host"], rendered=None, pods={"p": ["host"]}, mounts=("/etc/kvtier",)), "ConfigMap renders"),
    (dict(enabled=["host"], rendered=["host"], pods={"p": None}, mounts=("/etc/kvtier",)), "pod p loaded"),
    (dict(enabled=["host"], rendered=["host"], pods={"p": ["host"]}), "still mounted"),
    (dict(enabled=["host", "nvme"], rendered=None, pods={"p": None}, workload_hash="old"), "config-hash"),
    (dict(enabled=["host", "nvme"], rendered=None, pods={}), "no pod is running"),
])
def test_each_disagreement_is_named(kwargs, fragment):
    problems = snapshot(**kwargs).agreement()
    assert any(fragment in p for p in problems), problems


def test_the_table_marks_values_over_their_threshold():
    s = snapshot(["host", "nvme"], None, {"llama-demo-x-abcde": None})
    s.policy["status"].update({"sloState": "Breaching", "slo": {"consecutiveBreaches": 2, "last": {
        "ttftP99": 2.5, "itlP99": 0.02, "thresholds": {"ttftP99": 0.5, "itlP99": 0.1}}}})
    row = observe.row(s, 3)
    assert "2.50s/500ms !" in row and "20ms/100ms " in row and "2/3" in row and "host+nvme" in row


def test_repo_is_found_from_the_package_or_refused_with_the_way_out(tmp_path, monkeypatch):
    monkeypatch.delenv("KVTIER_REPO", raising=False)
    assert (find_repo() / "e2e" / "controlplane" / "run").is_file()
    with pytest.raises(RepoNotFound, match="--repo"):
        find_repo(str(tmp_path))


def test_waiting_for_a_process_to_answer_fails_fast_when_it_exits_and_returns_when_it_answers(tmp_path):
    import os
    import sys
    import time

    from scenario.processes import ScenarioError, Supervisor, wait_http_ok

    sup = Supervisor()
    try:
        dead = sup.start("engine", [sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"],
                         tmp_path / "dead.log")
        started = time.monotonic()
        with pytest.raises(ScenarioError, match=r"(?s)engine exited with 3:.*bad flag"):
            wait_http_ok(dead, "http://127.0.0.1:9/healthz", timeout=30)
        assert time.monotonic() - started < 10  # did not sit out the timeout
        server = sup.start("server", [sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1",
                                      "--directory", str(tmp_path)], tmp_path / "server.log",
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})  # its "port N" line, at once

        def port():
            text = (tmp_path / "server.log").read_text()
            return text.split("port ")[1].split()[0] if "port " in text else None
        deadline = time.monotonic() + 20
        while port() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        wait_http_ok(server, f"http://127.0.0.1:{port()}/", timeout=20)
        with pytest.raises(ScenarioError, match=r"server not ready within 0.5s"):
            wait_http_ok(server, f"http://127.0.0.1:{port()}/missing", timeout=0.5)
    finally:
        sup.close()
    assert server.process.poll() is not None  # the supervisor stopped what it started


def test_the_product_package_holds_no_scenario_code():
    """The scenario is test and demo code in e2e/scenario; the operator package may only delegate to it."""
    import kvtier_operator

    package = Path(kvtier_operator.__file__).parent
    assert not (package / "scenario").exists() and not (package / "demo.py").exists()
    offenders = [str(p.relative_to(package)) for p in package.rglob("*.py")
                 if any(line.lstrip().startswith(("import scenario", "from scenario"))
                        for line in p.read_text().splitlines())]
    assert offenders == []


def test_kvtier_demo_outside_a_checkout_says_where_the_demo_lives(tmp_path):
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo / "operator"), str(repo / "runtime")])}
    env.pop("KVTIER_REPO", None)
    proc = subprocess.run([sys.executable, "-m", "kvtier_operator.cli", "demo", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "needs a kvtier checkout" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "kvtier_operator.cli", "demo", "--repo", str(repo), "--help"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "python -m scenario" in proc.stdout, proc.stderr


def test_trace_replay_keeps_the_traces_prefix_sharing_and_refuses_a_bad_record(tmp_path):
    from scenario.load import BLOCK_TOKENS, PhaseStats, trace_prompts

    trace = tmp_path / "t.jsonl"
    rows = [[1, 2, 3], [9], [1, 2, 4, 5]]
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 32 * len(h), "output_length": 1,
                                         "hash_ids": h}) + "\n" for i, h in enumerate(rows)))
    corpus = list(range(100, 1100))  # stands for the model's token ids of the prose (any distinct ids do)
    prompts = trace_prompts(trace, limit=10, max_blocks=3, corpus=corpus)
    assert len(prompts) == 2  # [9] shares its first block with no one: not replayed
    a, b = prompts
    assert len(a) == len(b) == 3 * BLOCK_TOKENS
    assert a[:2 * BLOCK_TOKENS] == b[:2 * BLOCK_TOKENS] and a[2 * BLOCK_TOKENS:] != b[2 * BLOCK_TOKENS:]
    trace.write_text('{"timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": "abc"}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:1: .*hash_ids"):  # the replay's reader names line and field
        trace_prompts(trace, limit=10, max_blocks=3, corpus=corpus)
    stats = PhaseStats.of("slowed", [0.1] * 98 + [3.0, 4.0])
    assert stats.n == 100 and stats.p50 == 0.1 and stats.p99 == 3.0 and "p99 3.00s over 100" in str(stats)  # nearest rank


def test_the_real_engines_budget_is_a_bucket_bound_over_twice_the_healthy_p99():
    from scenario.manifests import real_budget

    assert real_budget(2.56) == 7.6   # 5.12 -> bucket bound 7.5
    assert real_budget(2.4) == 5.1    # 4.8 -> 5.0; a true p99 of 2.4 s reads at most 2.5 s (its bucket bound)
    assert real_budget(0.1) == 0.6    # at least 0.5 s


def test_the_slow_devices_throttle_reaches_containers_started_after_the_slowdown(tmp_path, monkeypatch):
    """On the node the throttle goes on the container cgroups, and a container the kubelet (re)starts gets a new
    one: the limit must follow it there (else the rolled-back engine would read a fast device), healing must lift
    it everywhere, and the reads served must count the groups of containers that are gone."""
    from scenario.slowdisk import IOPS, SlowDisk

    groups: list = []

    def group(name):
        g = tmp_path / "kubepods" / "pod1" / name
        g.mkdir(parents=True)
        (g / "blkio.throttle.read_iops_device").write_text("")
        (g / "blkio.throttle.io_serviced").write_text("7:0 Read 0\n7:0 Write 3\n")
        groups.append(g)
        return g

    disk = SlowDisk(tmp_path / "disk", container_cgroups=lambda: list(groups))
    disk.mechanism, disk.loop = "blkio-throttle", "/dev/loop0"
    monkeypatch.setattr(disk, "_majmin", lambda: "7:0")
    first = group("c1")
    disk.slow()
    assert (first / "blkio.throttle.read_iops_device").read_text() == f"7:0 {IOPS}\n"
    (first / "blkio.throttle.io_serviced").write_text("7:0 Read 5\n")
    assert disk.reads_served() == 5
    groups.remove(first)  # the container restarts: its cgroup goes, a new one comes
    second = group("c2")
    assert disk.enforce() == [second]
    assert (second / "blkio.throttle.read_iops_device").read_text() == f"7:0 {IOPS}\n"
    assert disk.enforce() == []  # applied once per group
    (second / "blkio.throttle.io_serviced").write_text("7:0 Read 2\n")
    assert disk.reads_served() == 7  # the gone container's reads still count
    disk.heal()
    assert (second / "blkio.throttle.read_iops_device").read_text() == "7:0 0\n"


def test_p99_back_under_the_budget_is_timed_from_the_slowdown_over_the_guards_window():
    from scenario.load import Sample, p99_back_under

    healthy = [Sample(t, "healthy", 0.2) for t in range(0, 10)]
    slow = [Sample(10 + t, "slowed", 4.0) for t in (1, 5)]  # two requests over the 1 s budget
    fast = [Sample(16 + t, "slowed", 0.2) for t in range(0, 30)]
    samples = healthy + slow + fast
    # The window of 8 s holds the last slow request (t=15) until t=23; the first completion after that is t=23.
    assert p99_back_under(samples, 10.0, 1.0, 8.0) == 13.0
    # Never over the budget after the slowdown: 0; still over at the end: None; a failed request counts as over.
    assert p99_back_under(healthy + fast, 10.0, 1.0, 8.0) == 0.0
    assert p99_back_under(healthy + slow, 10.0, 1.0, 8.0) is None
    failed = [Sample(12, "slowed", None, "connection refused")]
    assert p99_back_under(healthy + failed + fast, 10.0, 1.0, 8.0) == 10.0


def test_engine_restarts_count_replaced_pods_and_container_restarts():
    from scenario.pods import restarts_since

    before = {"a": ("u1", 0), "b": ("u2", 1)}
    assert restarts_since(before, {"a": ("u1", 0), "b": ("u2", 1)}) == 0  # the same pods, no new restart
    assert restarts_since(before, {"a": ("u1", 2), "b": ("u2", 1)}) == 2  # a's container restarted twice
    assert restarts_since(before, {"a": ("u9", 0), "b": ("u2", 1)}) == 1  # a replaced by another pod
    assert restarts_since(before, {"b": ("u2", 1), "c": ("u3", 0)}) == 1  # a gone, a new pod c in its place
