"""The SLO guard (``slo`` and its step in a pass, ``slo_tick``) depends on nothing of the controller: it returns
plain decisions (``reports.Cond``/``Event``, a ``GuardStep``) and the pass turns them into writes. Checked on
what importing it really loads, so an indirect import through a shared module counts too."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTROLLER = {"kvtier_operator.handlers", "kvtier_operator.controller", "kvtier_operator.kube",
              "kvtier_operator.status", "kvtier_operator.status_writer", "kvtier_operator.reconcile"}


def loaded_by(module: str) -> set[str]:
    code = (f"import sys; sys.path[:0] = [{str(ROOT / 'operator')!r}, {str(ROOT / 'runtime')!r}]; "
            f"import {module}; import json; print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return set(json.loads(out.stdout))


def test_the_guard_loads_no_controller_module():
    for module in ("kvtier_operator.slo", "kvtier_operator.slo.client", "kvtier_operator.slo_tick"):
        loaded = loaded_by(module)
        assert module in loaded  # the control: the import happened in that interpreter
        assert not loaded & CONTROLLER, (module, sorted(loaded & CONTROLLER))


def test_the_reconcile_loads_no_guard_module():
    """The reconcile renders from the guard's typed state (api.guard_state) and reads its times (api.times): it needs
    nothing of the guard itself."""
    loaded = loaded_by("kvtier_operator.reconcile")
    assert "kvtier_operator.reconcile" in loaded and "kvtier_operator.api.guard_state" in loaded
    assert not {m for m in loaded if m == "kvtier_operator.slo" or m.startswith("kvtier_operator.slo.")}


def test_the_controller_and_the_guard_share_one_condition_and_one_event_type():
    from kvtier_operator import reconcile, reports, slo_tick, status

    assert status.Cond is reports.Cond is slo_tick.Cond
    assert reconcile.Event is reports.Event is slo_tick.Event
