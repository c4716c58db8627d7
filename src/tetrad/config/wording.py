"""How the commands say a count (one rule, so that no line says "1 steps"), the sizes a refusal
offers instead, and the name a misspelt one meant."""

from __future__ import annotations

import difflib
import math


def counted(n: int, noun: str, plural: str = "") -> str:
    """`n` and its noun, singular for one: '1 step', '2 steps', '1,124 windows'; `plural` where an
    added s is wrong ('processes')."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def divisors(n: int) -> list[int]:
    """n's divisors in order: what a refusal offers where a size must divide n."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def did_you_mean(word: str, choices, within: str = "") -> str:
    """' (did you mean ...?)' for the choice `word` differs from only in case, or is close to;
    `within`: the table the choices are keys of, named in the hint ('model.n_layers', as a user
    writes the key), not in the match (a shared prefix would make every key look close)."""
    choices = list(choices)
    close = [c for c in choices if c.lower() == word.lower()] or difflib.get_close_matches(word.lower(), choices, n=1)
    return f" (did you mean {within + '.' + close[0] if within else close[0]!r}?)" if close else ""
