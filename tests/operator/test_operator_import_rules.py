"""Import rules of the operator package, checked on its source with ``ast`` (nothing is imported):

* no module imports another module's underscore name, nor anything from a private module: what crosses a module
  boundary is public;
* the SLO guard (``kvtier_operator.slo``) and the reconcile (``kvtier_operator.reconcile``) import nothing of each
  other: what both need (the guard's typed state, times as status stores them, the tier derivation) lives below
  both (``api.guard_state``, ``api.times``, ``tiers``). What importing each really loads is checked too
  (test_slo_layering), so an indirect import counts."""
from __future__ import annotations

from pathlib import Path

from plugins.import_rules import apart_violations, private_import_violations

OPERATOR = Path(__file__).resolve().parents[2] / "operator" / "kvtier_operator"


def guard_reconcile_violations(root: Path) -> list[str]:
    """Imports of the guard's package in the reconcile, and the reverse."""
    return apart_violations(root, "slo", "reconcile")


def test_no_private_name_crosses_a_module() -> None:
    assert private_import_violations(OPERATOR) == []


def test_the_guard_and_the_reconcile_import_nothing_of_each_other() -> None:
    assert guard_reconcile_violations(OPERATOR) == []


def test_the_checks_catch_what_they_forbid(tmp_path) -> None:
    """Each checker flags a planted violation, so a clean run above is not a checker that sees nothing."""
    pkg = tmp_path / "kvtier_operator"
    (pkg / "slo").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "slo" / "__init__.py").write_text("")
    (pkg / "slo" / "queries.py").write_text("def _selector(): ...\n")
    (pkg / "slo" / "hit_ratios.py").write_text("from .queries import _selector\nfrom ..reconcile import plan\n")
    (pkg / "reconcile.py").write_text("from .slo.decisions import parse_time\nfrom . import slo\n")
    assert [v.split(": ", 1)[1] for v in private_import_violations(pkg)] == [
        "kvtier_operator.slo.hit_ratios imports _selector from kvtier_operator.slo.queries"]
    assert [v.split(": ", 1)[1] for v in guard_reconcile_violations(pkg)] == [
        "kvtier_operator.reconcile imports kvtier_operator.slo.decisions.parse_time",
        "kvtier_operator.reconcile imports kvtier_operator.slo",
        "kvtier_operator.slo.hit_ratios imports kvtier_operator.reconcile.plan"]
