"""Final answers of math responses: extraction and equivalence, for verifiable rewards.

:func:`extract_answer` finds the answer a response commits to, in the order graders of GSM8K /
MATH-style data look for it: the last ``\\boxed{...}`` (or ``\\fbox{...}``, nested braces
allowed), then a GSM8K ``#### answer`` line, then "the answer is ...", then the last number in the
text. :func:`answers_equal` compares two answers as numbers when both parse as one (integers,
decimals, thousands separators, fractions ``a/b`` and ``\\frac{a}{b}``, percentages, a leading
``$`` or trailing units-free punctuation), else as normalized strings (LaTeX spacing, ``\\left``/
``\\right``, ``\\text{}``, ``\\dfrac`` and surrounding ``$`` removed, case-insensitive).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*([^\n]+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?%?|-?\.\d+%?")
_FRAC = re.compile(r"^\\[dt]?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")


def _boxed_contents(text: str) -> list[str]:
    out = []
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[m.end():i - 1])
    return out


def extract_answer(text: str) -> str | None:
    """The final answer ``text`` commits to, or None when it has none (see module docstring)."""
    if not isinstance(text, str):
        return None
    boxed = _boxed_contents(text)
    if boxed:
        return boxed[-1].strip()
    for pattern in (_HASHES, _ANSWER_IS):
        found = pattern.findall(text)
        if found:
            return found[-1].strip().rstrip(".").strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


def _strip_latex(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\(left|right|,|;|!|\s)", "", s)
    for old, new in (("\\%", "%"), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("^\\circ", "")):
        s = s.replace(old, new)
    return s.rstrip(".").strip()


def parse_number(s: str) -> Fraction | float | None:
    """``s`` as an exact number (Fraction) where possible, float for decimals with exponents;
    None when it is not a single number."""
    s = _strip_latex(s).replace(" ", "")
    m = _FRAC.match(s)
    if m:
        s = f"{m.group(1)}/{m.group(2)}"
    s = s.lstrip("$").replace(",", "") if re.fullmatch(r"-?\$?[\d,]*\.?\d+(?:/\d+)?%?", s) else s
    s = s.replace("-$", "-")
    percent = s.endswith("%")
    if percent:
        s = s[:-1]
    try:
        value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        try:
            value = float(s)
        except ValueError:
            return None
        if not math.isfinite(value):
            return None
    return value / 100 if percent else value


def normalize_answer(s: str) -> str:
    """Canonical string form of a non-numeric answer (whitespace and LaTeX spacing removed)."""
    return re.sub(r"\s+", "", _strip_latex(s)).lower()


def answers_equal(predicted: str | None, reference, rel_tol: float = 1e-6) -> bool:
    """True when ``predicted`` and ``reference`` are the same number (exactly for rationals,
    within ``rel_tol`` when either is a float) or the same normalized string."""
    if predicted is None or reference is None:
        return False
    reference = str(reference)
    a, b = parse_number(predicted), parse_number(reference)
    if a is not None and b is not None:
        if isinstance(a, Fraction) and isinstance(b, Fraction):
            return a == b
        return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=1e-12)
    return normalize_answer(predicted) == normalize_answer(reference)


__all__ = ["extract_answer", "answers_equal", "parse_number", "normalize_answer"]
