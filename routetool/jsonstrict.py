"""JSON objects read strictly: a key given twice in one object is an error.

:func:`json.loads` keeps the last value of a repeated key silently, and other JSON readers
keep the first; a file that relies on either is ambiguous. Every JSON file routetool reads
(dumps, counts, sharded-trace indexes, EPLB placements, model configs) goes through
:func:`unique_keys`::

    json.loads(text, object_pairs_hook=unique_keys)   # raises DuplicateKey
"""

from __future__ import annotations


class DuplicateKey(ValueError):
    """A JSON object holds ``key`` twice."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """``object_pairs_hook`` for :func:`json.loads`: the object as a dict.

    Raises:
        DuplicateKey: a key appears twice in the object.
    """
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out
