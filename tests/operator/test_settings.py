"""Operator settings: flags win over KVTIER_* environment variables, which win over defaults."""
from __future__ import annotations

import pytest
from kvtier_operator.settings import Settings, from_args


def test_defaults():
    s = from_args([], env={})
    assert s == Settings()
    assert s.namespaces == () and not s.standalone and s.metrics_port == 9090


def test_environment():
    s = from_args([], env={"KVTIER_NAMESPACES": "a, b", "KVTIER_STANDALONE": "true", "KVTIER_METRICS_PORT": "-1",
                           "KVTIER_LIVENESS": "off", "KVTIER_RESYNC": "12.5", "KVTIER_READ_NODES": "false"})
    assert s.namespaces == ("a", "b") and s.standalone and s.metrics_port is None
    assert s.liveness_endpoint is None and s.resync_seconds == 12.5 and not s.read_nodes


def test_flags_win_over_environment():
    s = from_args(["-n", "x", "--metrics-port", "0", "--peering", "p", "--cleanup-image", "img:1"],
                  env={"KVTIER_NAMESPACES": "a", "KVTIER_METRICS_PORT": "9999"})
    assert s.namespaces == ("x",) and s.metrics_port == 0 and s.peering_name == "p" and s.cleanup_image == "img:1"


def test_bad_environment_value_names_the_variable():
    with pytest.raises(SystemExit, match="KVTIER_RESYNC"):
        from_args([], env={"KVTIER_RESYNC": "soon"})
    with pytest.raises(SystemExit, match="KVTIER_STANDALONE"):
        from_args([], env={"KVTIER_STANDALONE": "maybe"})


def test_standalone_and_peering_are_exclusive():
    with pytest.raises(SystemExit):
        from_args(["--standalone", "--peering", "p"], env={})


def test_remote_secret_namespaces_and_the_recheck_from_flags_and_environment():
    s = from_args(["--remote-secret-namespace", "team-a", "--remote-secret-namespace", "team-b",
                   "--secret-recheck", "5"], env={})
    assert s.remote_secret_namespaces == ("team-a", "team-b") and s.secret_recheck_seconds == 5
    s = from_args([], env={"KVTIER_REMOTE_SECRET_NAMESPACES": "x, y", "KVTIER_SECRET_RECHECK": "2.5"})
    assert s.remote_secret_namespaces == ("x", "y") and s.secret_recheck_seconds == 2.5
    with pytest.raises(SystemExit, match=r"--remote-secret-namespace \(KVTIER_REMOTE_SECRET_NAMESPACES\): 'Team_A': "
                                         "must be a namespace name"):
        from_args(["--remote-secret-namespace", "Team_A"], env={})


@pytest.mark.parametrize("argv, env, message", [
    (["--resync", "0"], {}, r"--resync \(KVTIER_RESYNC\): 0 must be greater than zero"),
    (["--secret-recheck", "0"], {}, r"--secret-recheck \(KVTIER_SECRET_RECHECK\): 0 must be greater than zero"),
    ([], {"KVTIER_BACKOFF_MAX": "-1"}, r"--backoff-max \(KVTIER_BACKOFF_MAX\): -1 must be greater than zero"),
])
def test_non_positive_intervals_are_refused_naming_the_setting(argv, env, message):
    with pytest.raises(SystemExit, match=message):
        from_args(argv, env=env)


def test_release_retries_back_off_exponentially_up_to_the_cap():
    from kvtier_operator.handlers import backoff_delay

    s = Settings(backoff_initial=0.5, backoff_max=30.0)
    assert [backoff_delay(s, n) for n in range(8)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert backoff_delay(s, 10_000) == 30  # no float overflow on a long-stuck finalizer
