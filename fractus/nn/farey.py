"""Expert phases on the circle, taken from a Farey sequence."""

import math


def farey_sequence(n: int) -> list[tuple[int, int]]:
    """F_n: irreducible p/q in [0, 1] with q <= n, ascending (next-term recurrence)."""
    if n < 1:
        raise ValueError(f"Farey order must be >= 1, got {n}")
    terms = [(0, 1)]
    a, b, c, d = 0, 1, 1, n
    while c <= n:
        terms.append((c, d))
        k = (n + b) // d
        a, b, c, d = c, d, k * c - a, k * d - b
    return terms


def expert_phases(n_experts: int) -> list[float]:
    """Angle 2*pi*p/q for expert e, p/q the fraction of index min(floor(e*m/E), m-1) in F_2E."""
    fractions = farey_sequence(2 * n_experts)
    m = len(fractions)
    phases = []
    for e in range(n_experts):
        p, q = fractions[min(e * m // n_experts, m - 1)]
        phases.append(2.0 * math.pi * p / q)
    return phases
