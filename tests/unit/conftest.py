"""Fixtures shared by the unit tests."""
import itertools

import numpy as np
import pytest


@pytest.fixture
def store(monkeypatch):
    """Ray's object store as a dict: ``ray.put`` files the array under a counter and answers the
    key; ``ray.get`` of a list gives each key's array back read-only, as from the object store,
    and anything else in the list (an actor call's answer) as it is."""
    import ray

    held, keys = {}, itertools.count()

    def put(a):
        key = next(keys)
        held[key] = np.array(a)
        held[key].setflags(write=False)
        return key

    monkeypatch.setattr(ray, "put", put)
    monkeypatch.setattr(ray, "get", lambda refs: [held[r] if isinstance(r, int) else r for r in refs])
    return held
