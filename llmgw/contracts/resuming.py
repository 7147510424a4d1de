"""A profile's ``resume``: whether the gateway continues its streams on another replica when
theirs breaks mid-answer (:mod:`llmgw.server.gateway.resume`), and how many times at most.

``resume: false`` turns it off; ``resume: true`` (or leaving it out) keeps the default of
:data:`DEFAULT_MAX_RESUMES`; ``resume: {max_resumes: N}`` sets the most (0: off). Stored in
the profile's dict as ``false`` or ``{max_resumes: N}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "DEFAULT_MAX_RESUMES",
    "MAX_RESUMES_LIMIT",
    "parse_resume",
    "profile_max_resumes",
    "resume_value",
]

DEFAULT_MAX_RESUMES = 2
"""How many times one stream is resumed at most when the profile does not say."""
MAX_RESUMES_LIMIT = 16
"""The most ``max_resumes`` may say: a stream broken more often is the fleet's problem."""


def parse_resume(value: object) -> int:
    """``resume`` as the most resumes of a stream (0: off); ValueError says what is wrong."""
    if value is True:
        return DEFAULT_MAX_RESUMES
    if value is False:
        return 0
    if not isinstance(value, Mapping):
        raise ValueError(
            f"must be true, false or {{max_resumes: N}}, got {type(value).__name__} {value!r}"
        )
    unknown = sorted(str(k) for k in value if k != "max_resumes")
    if unknown:
        raise ValueError(f"takes only max_resumes, got {', '.join(unknown)}")
    most = value.get("max_resumes", DEFAULT_MAX_RESUMES)
    if isinstance(most, bool) or not isinstance(most, int) or not 0 <= most <= MAX_RESUMES_LIMIT:
        raise ValueError(
            f"max_resumes must be a whole number from 0 (off) to {MAX_RESUMES_LIMIT}, got {most!r}"
        )
    return most


def resume_value(most: int) -> Any:
    """How a profile's dict stores ``most`` resumes."""
    return False if most == 0 else {"max_resumes": most}


def profile_max_resumes(profile: Mapping[str, Any] | None) -> int | None:
    """A stored profile's most resumes of a stream; None when it does not say (the default),
    or says what this llmgw cannot read (a newer instance's: the default too)."""
    value = profile.get("resume") if profile else None
    if value is None:
        return None
    try:
        return parse_resume(value)
    except ValueError:
        return None
