"""Rewards for the reuse benchmarks' generation-dominated regimes.

The length reward shortens completions as it learns, so generation's share of a step falls during the run
and reuse loses its reason mid-run. These are length-neutral, shares of a completion's characters (vowels,
spaces, anything but an e): completions stay as long as the random model makes them, so the generation share
stays put.
"""
from __future__ import annotations


def vowel_share(prompts, completions, **_) -> list[float]:
    """Fraction of the completion's characters in 'aeiou' (0.0 for an empty completion)."""
    return [sum(ch in "aeiou" for ch in c) / len(c) if c else 0.0 for c in completions]


def space_share(prompts, completions, **_) -> list[float]:
    """Fraction of the completion's characters that are spaces (shorter words), 0.0 for an empty completion: a
    second length-neutral reward, on word boundaries rather than letters (a regime the default was not designed on)."""
    return [c.count(" ") / len(c) if c else 0.0 for c in completions]


def no_e_share(prompts, completions, **_) -> list[float]:
    """Fraction of the completion's characters that are not an e (a lipogram), 0.0 for an empty completion: a third
    length-neutral reward, one whose ceiling needs no collapse. Most tokens hold no e, so the policy reaches 0.99
    while its entropy is still high (5.7 nats of 6.2 in a probe), where the vowel share's ceiling needs the few
    all-vowel tokens and the policy can collapse short of it (the 2/3 trap, bench/README.md)."""
    return [1.0 - c.lower().count("e") / len(c) if c else 0.0 for c in completions]
