"""A profile's ``resume``: false, true or {max_resumes: N}, stored and read back as the
gateway reads it; every refusal names the key and what it takes."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.contracts.catalog import parse_catalog, parse_profile
from llmgw.contracts.resuming import profile_max_resumes
from llmgw.errors import ConfigError

SIM = {"engine": "sim"}


def parsed(**given: Any) -> Any:
    catalog = parse_catalog({"models": {"m": {"profiles": {"p": given}}}}, source="catalog.yaml")
    return catalog.models["m"].profiles["p"]


@pytest.mark.parametrize(
    ("given", "most", "stored"),
    [
        (False, 0, False),
        (True, 2, {"max_resumes": 2}),
        ({"max_resumes": 4}, 4, {"max_resumes": 4}),
        ({"max_resumes": 0}, 0, False),
    ],
)
def test_resume_is_kept_and_read_back(given: object, most: int, stored: object) -> None:
    profile = parsed(**SIM, resume=given)
    assert profile.max_resumes == most
    kept = profile.to_dict()
    assert kept["resume"] == stored
    assert profile_max_resumes(kept) == most
    assert parse_profile(kept, model="m", profile="p", source="stored") == profile


def test_no_resume_is_not_stored_and_reads_as_the_default() -> None:
    kept = parsed(**SIM).to_dict()
    assert "resume" not in kept
    assert profile_max_resumes(kept) is None


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("no", "must be true, false or {max_resumes: N}"),
        ({"max_resumes": -1}, "from 0 (off) to 16"),
        ({"max_resumes": True}, "from 0 (off) to 16"),
        ({"max": 1}, "takes only max_resumes"),
    ],
)
def test_a_bad_resume_is_refused_naming_its_key(given: object, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parsed(**SIM, resume=given)
    assert "models.m.profiles.p.resume" in str(caught.value)
    assert message in str(caught.value)
