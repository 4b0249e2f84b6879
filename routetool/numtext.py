"""Numbers written as text (trace metadata, layer names, dump cells, option lists), read strictly.

Python's ``int()`` and ``float()`` accept more than a plain decimal number: underscores
(``"2_5"`` is 25), digits of any script (Arabic-Indic ``"٣"``, fullwidth ``"３"``), surrounding
whitespace. A file or an option that relies on that is almost always wrong, and two spellings of
one number (``layers.0`` and ``layers.00``) would silently become one. What routetool reads as a
number from a file, and the items of the command line's lists and mini-languages (``--layers``,
``--ep-size``, ``--skew``), go through this module: ASCII digits ``0-9``, an optional sign, for
floats a decimal point and an exponent, nothing else. (An option of one number is click's own
type, read as click reads it.)
"""

from __future__ import annotations

import re

from routetool_kernels.spec import PLAIN_FLOAT as _FLOAT
from routetool_kernels.spec import PLAIN_INT as _INT
from routetool_kernels.spec import SPECIAL_FLOAT as _SPECIAL
from routetool.errors import RouteToolError

_INDEX = re.compile(r"0|[1-9][0-9]*")


def parse_int(text: str) -> int | None:
    """``text`` as an int when it is a plain decimal integer (``-12``, ``+3``, ``007``), else None.

    No whitespace, no underscores, ASCII digits only; more digits than Python converts
    (4,300) is None too.
    """
    if not isinstance(text, str) or not _INT.fullmatch(text):
        return None
    try:
        return int(text)
    except ValueError:  # over Python's integer digit limit
        return None


def parse_float(text: str, *, special: bool = False) -> float | None:
    """``text`` as a float when it is a plain decimal number (``2.5``, ``-1e-20``, ``.5``), else None.

    ``special``: also accept ``nan``, ``inf``, ``infinity`` (any case, optional sign), as
    ``repr(float)`` writes them, so that the caller can say they are not finite.
    """
    if not isinstance(text, str):
        return None
    if _FLOAT.fullmatch(text) or (special and _SPECIAL.fullmatch(text)):
        return float(text)
    return None


def number_problem(text: str, *, integer: bool = False) -> str:
    """Why ``text`` is refused although Python's ``int()`` (``integer``) or ``float()`` reads it:
    digits of another script (``"١"``), underscores (``"1_0"``), surrounding whitespace
    (``" 1"``). The message names the plain spelling (``"'1_0' is not a plain decimal integer
    ...; write 10"``). Empty when ``text`` is a plain decimal number (:func:`parse_int`,
    :func:`parse_float` with ``special``) or no number at all (the caller says what it expected).
    """
    if not isinstance(text, str):
        return ""
    if (parse_int(text) if integer else parse_float(text, special=True)) is not None:
        return ""
    try:
        loose = int(text) if integer else float(text)
    except (ValueError, OverflowError):
        return ""
    return (f"{text!r} is not a plain decimal {'integer' if integer else 'number'}: ASCII digits 0-9 only, without "
            f"spaces, underscores or other scripts' digits; write {loose!r}")


def is_index(text: str) -> bool:
    """True when ``text`` is the one canonical spelling of a non-negative integer index:
    ASCII digits without leading zeros (``0``, ``7``, ``12``; never ``00``, ``07``, ``+1``, ``٣``)."""
    return isinstance(text, str) and _INDEX.fullmatch(text) is not None


def index_problem(text: str) -> str:
    """Why ``text`` is not a canonical index (see :func:`is_index`); empty when it is one."""
    if is_index(text):
        return ""
    if re.fullmatch(r"[0-9]+", text):
        return f"{text!r} has a leading zero (index {int(text)} is written {int(text)})"
    if text.isdecimal() or any(ch.isdigit() for ch in text):
        return f"{text!r} is not a plain decimal index (ASCII digits 0-9 only: no signs, spaces, underscores or " \
               "other scripts' digits)"
    return f"{text!r} is not a non-negative integer"


def split_items(text: str) -> list[str] | None:
    """The comma-separated items of ``text``, as written; None when an item is empty or blank
    (``"8,,16"``, ``"8,"``, ``",8"``, ``"8, ,16"``): a list with a hole is a typo, never dropped silently."""
    items = text.split(",")
    return None if any(not x.strip() for x in items) else items


def list_items(option: str, text: str, example: str, *, noun: str = "values") -> list[str]:
    """The comma-separated items of the list option ``option`` (``--ep-size``), checked as every
    list option checks them: no empty item (:func:`split_items`) and, as for a single number
    (:func:`number_problem`), no spaces around an item (``"0, 1"``, ``" 4"``): ``int()`` would
    read them, and a list is written without them. ``example`` is a correct list for the fix.

    Raises:
        RouteToolError: an empty item, or an item with whitespace around it (the message names
            the option and the item, and the list written without the spaces).
    """
    items = split_items(text)
    if items is None:
        raise RouteToolError(f"{option} {text!r} has an empty item",
                             fix=f"separate the {noun} with single commas, e.g. {example}")
    spaced = next((x for x in items if x != x.strip()), None)
    if spaced is not None:
        plain = ",".join(x.strip() for x in items)
        raise RouteToolError(f"{option} {text!r}: the item {spaced!r} has spaces around it",
                             fix=f"write the list without spaces: {option} {plain}")
    return items


def refuse_repeats(option: str, text: str, values: list) -> list:
    """``values`` (the items of the list option ``option``, as read from ``text``), refused when
    one is named twice: bench would time the same points twice and balance report the same EP
    size twice, and a repeat is more likely a typo (``64,64`` for ``64,640``) than meant.

    Raises:
        RouteToolError: naming the option, the list and the repeated value.
    """
    repeated = next((v for i, v in enumerate(values) if v in values[:i]), None)
    if repeated is not None:
        raise RouteToolError(f"{option} {text!r} names {repeated} twice", fix="name each value once")
    return values
