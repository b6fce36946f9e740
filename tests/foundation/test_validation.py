"""Every rule rejects with the field path and the rule; valid policies pass. Offline, like the API server."""
import pytest
from foundation.policies import INVALID, INVALID_METADATA, VALID, cpu, disk, policy
from kvtier_operator.api.validation import PolicyInvalid, parse_policy, validate_text


def problems(doc):
    with pytest.raises(PolicyInvalid) as err:
        parse_policy(doc)
    return [str(p) for p in err.value.problems]


@pytest.mark.parametrize("doc", VALID)
def test_valid_policies_pass(doc):
    parse_policy(doc)


@pytest.mark.parametrize("doc, expected", INVALID)
def test_each_rule_rejects_with_field_path_and_rule(doc, expected):
    found = problems(doc)
    assert any(p.startswith(expected) for p in found), found


def test_all_problems_are_reported_at_once():
    found = problems(policy(offload={"chunkTokens": 100}, tiers=[cpu(), disk("host")]))
    assert len(found) == 2


def test_validate_text_reports_file_document_and_name():
    text = "kind: KVCachePolicy\napiVersion: kvtier.io/v1alpha1\nmetadata: {name: a}\nspec: {}\n---\n" \
           "kind: ConfigMap\napiVersion: v1\n"
    assert validate_text(text, "p.yaml") == ["p.yaml[0] (a): spec.selector: required"]
    assert validate_text("kind: ConfigMap\n", "c.yaml") == ["c.yaml: no KVCachePolicy (kind: KVCachePolicy) "
                                                            "in this file"]
    assert validate_text("a: [", "broken.yaml")[0].startswith("broken.yaml:1:5: not valid YAML")


@pytest.mark.parametrize("metadata, expected", INVALID_METADATA)
def test_metadata_is_checked_like_the_api_server(metadata, expected):
    found = problems({**policy(), "metadata": metadata})
    assert any(p.startswith(expected) for p in found), found
