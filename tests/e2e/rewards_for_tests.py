"""A reward with spread on random tiny models (their outputs never solve arithmetic)."""


def token_parity_reward(response: str, answer: str, **extra) -> float:
    """1.0 when the response has an even number of characters, else 0.0."""
    return float(len(response) % 2 == 0)
