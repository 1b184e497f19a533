"""Task outcome records: graded (label, score) beside success or failure, one rule for
what counts as a failure, read alike by older and newer monitors."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from monitor.protocol.schema import FAILURE_LABELS, SUCCESS_LABELS, TaskOutcome, label_outcome


def read(raw: str) -> TaskOutcome:
    return TaskOutcome.model_validate_json(raw)


def test_a_label_of_fixed_meaning_says_the_outcome_a_record_leaves_out():
    for label in FAILURE_LABELS:
        assert read(f'{{"request_id": "r", "label": "{label}"}}').outcome == "failure"
    for label in SUCCESS_LABELS:
        assert read(f'{{"request_id": "r", "label": "{label}", "score": 0.9}}').outcome == "success"
    graded = read('{"request_id": "r", "outcome": "failure", "label": "wrong_citation", "score": 0.25}')
    assert (graded.outcome, graded.label, graded.score) == ("failure", "wrong_citation", 0.25)


def test_the_outcome_alone_decides_and_a_score_never_does():
    assert read('{"request_id": "r", "outcome": "success", "score": 0.0}').outcome == "success"
    assert read('{"request_id": "r", "outcome": "failure", "score": 1.0}').outcome == "failure"
    assert label_outcome("thumbs_down") == "failure" and label_outcome("wrong_citation") is None


@pytest.mark.parametrize(("raw", "says"), [
    ('{"request_id": "r", "outcome": "success", "label": "thumbs_down"}', "label 'thumbs_down' means failure"),
    ('{"request_id": "r", "label": "wrong_citation"}', "label 'wrong_citation' has no fixed meaning"),
    ('{"request_id": "r"}', "no outcome: give success or failure"),
    ('{"request_id": "r", "outcome": "ok"}', "'success' or 'failure'"),
    ('{"request_id": "r", "outcome": "failure", "score": 1.5}', "less than or equal to 1"),
    ('{"request_id": "r", "outcome": "failure", "score": -0.1}', "greater than or equal to 0"),
    ('{"request_id": "r", "outcome": "failure", "score": NaN}', "finite number"),
    ('{"request_id": "r", "outcome": "failure", "label": "Thumbs Down"}', "pattern"),
    ('{"request_id": "r", "outcome": "failure", "label": ""}', "at least 1 character"),
    ('{"request_id": "bad id", "outcome": "failure"}', "pattern"),
])
def test_bad_records_are_refused_naming_why(raw, says):
    with pytest.raises(ValidationError, match=says):
        read(raw)


class _OlderTaskOutcome(BaseModel):
    """The outcome record as monitors before labels read it."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    request_id: str
    outcome: str
    timestamp: float = 0.0


def test_older_and_newer_monitors_read_each_others_records():
    old = '{"request_id": "req-1", "outcome": "failure", "timestamp": 12.5}'
    assert read(old) == TaskOutcome(request_id="req-1", outcome="failure", timestamp=12.5)
    # what the producer writes: the outcome always named, the detail beside it
    new = TaskOutcome.model_validate({"request_id": "req-1", "label": "regenerate", "score": 0.2, "timestamp": 3.0})
    raw = new.model_dump_json(exclude_none=True)
    assert _OlderTaskOutcome.model_validate_json(raw).outcome == "failure"
    assert read(raw) == new
    assert read('{"request_id": "r", "outcome": "success", "conversation": "c-9"}').outcome == "success"
