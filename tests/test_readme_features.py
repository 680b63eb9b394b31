"""The README's feature table is what scripts/readme_features.py renders now, and each of its "not with" clauses, from
the registry of refusals (engine.refusals.REFUSALS), is a refusal the config checks make: every config the registry
gives for a claim is refused naming its key, and each part of it is accepted alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.refusals import REFUSALS, Ask, Refusal, refused
from scripts.readme_features import ROWS, FeatureTableError, Row, current, render

REPO = Path(__file__).resolve().parent.parent

ASKS = [(refusal, ask) for refusal in REFUSALS for ask in refusal.asks]


def test_the_readme_feature_table_is_current():
    text, fresh = current(REPO / "README.md")
    assert text == fresh, "run: python scripts/readme_features.py --write README.md"


@pytest.mark.parametrize("refusal,ask", ASKS, ids=[f"{r.row}-{i}" for i, (r, _) in enumerate(ASKS)])
def test_each_claimed_refusal_is_made_by_the_checks_and_each_part_is_accepted_alone(refusal: Refusal, ask: Ask):
    error = ask.error()
    assert error is not None, f"README says {refusal.claim!r}, and initialize accepts {ask}"
    assert ask.names in error, error
    feature_alone, other_alone = ask.errors_alone()
    assert feature_alone is None, f"{refusal.claim!r}: the feature is refused by itself: {feature_alone}"
    assert other_alone is None, f"{refusal.claim!r}: the other part is refused by itself: {other_alone}"


def test_a_plain_config_and_the_parts_of_a_refusal_are_accepted():
    assert refused({}) is None
    assert refused({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                          "step_in_backward": True}},
                    "bf16": {"enabled": True}}) is None


def test_the_claims_follow_their_row_and_a_claim_without_a_row_fails_the_rendering():
    rows = (Row("a", "feature A", "done"), Row("b", "feature B", "done"))
    claims = (Refusal("a", "not with X", ()), Refusal("a", "not with Y", ()))
    assert render(rows, claims).splitlines()[2:] == ["| feature A | done; not with X; not with Y |",
                                                     "| feature B | done |"]
    with pytest.raises(FeatureTableError, match="'c'"):
        render(rows, (Refusal("c", "not with Z", ()),))
    assert len({row.id for row in ROWS}) == len(ROWS)
