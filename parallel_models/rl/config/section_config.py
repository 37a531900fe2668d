"""The pydantic settings every section of the PPO config shares (``SECTION_CONFIG``): unknown
keys are errors, and numbers read as strings where a field is a string (YAML reads ``1e-5`` as
a string, a user may write a name as a number). One definition for ``sections.py`` and the
nested groups kept in their own modules (``correction_fields.py``, ``multi_turn.py``)."""

from __future__ import annotations

from pydantic import ConfigDict

SECTION_CONFIG = ConfigDict(extra="forbid", coerce_numbers_to_str=True)

__all__ = ["SECTION_CONFIG"]
