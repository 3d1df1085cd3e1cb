"""Value checks for the config sections: each names the key, the value and what is allowed.

Types are strict and the same everywhere: a bool must be a YAML bool (``true``/``false``), never ``1``,
``0`` or a string, so ``data.shuffle=1`` and ``engine.async_mode=maybe`` are refused alike.
"""

from __future__ import annotations

import math
import re
from typing import Any

BOOL = "true or false (a YAML bool: 1, 0 and strings are not accepted)"
OPT_BOOL = "true, false or null (a YAML bool: 1, 0 and strings are not accepted)"
DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def fail(key: str, value: object, allowed: str) -> None:
    raise ValueError(f"{key}={value!r} is invalid: must be {allowed}")


def check_int(key: str, value: object, lo: int | None = None, hi: int | None = None, allowed: str = "") -> None:
    ok = isinstance(value, int) and not isinstance(value, bool)
    ok = ok and (lo is None or value >= lo) and (hi is None or value <= hi)  # type: ignore[operator]
    if not ok:
        fail(key, value, allowed or (f"an int >= {lo}" if lo is not None else "an int"))


def check_num(
    key: str, value: object, lo: float, hi: float | None = None, lo_open: bool = False, allowed: str = ""
) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if lo_open else value >= lo) and (hi is None or value <= hi)  # type: ignore[operator]
    if not ok:
        fail(key, value, allowed or f"a finite number >= {lo}")


def check_bool(key: str, value: object, optional: bool = False) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        fail(key, value, OPT_BOOL if optional else BOOL)


def check_str(key: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        fail(key, value, "a non-empty string")


def check_opt_str(key: str, value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        fail(key, value, "a non-empty string or null")


def check_choice(key: str, value: object, choices: tuple[Any, ...], allowed: str | None = None) -> None:
    if not isinstance(value, str) or value not in choices:
        fail(key, value, allowed or f"one of {list(choices)}")


def check_device(key: str, value: object) -> None:
    """Only devices the engine runs on; torch.device('tpu') would otherwise raise a RuntimeError."""
    if value is not None and not (isinstance(value, str) and DEVICE.match(value)):
        fail(key, value, "null (cuda if available, else cpu), 'cpu', 'cuda' or 'cuda:N'")


def check_typed_fields(prefix: str, cls: type, values: dict[str, Any]) -> None:
    """Type-check values against a dataclass's annotations (bool, int, float, str; optionally None).

    Used for EngineConfig, whose own checks are for Python callers; here every value comes from YAML
    or the command line, where ``maybe`` for a bool must not slip through.
    """
    import dataclasses

    hints = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    for key, value in values.items():
        hint = hints.get(key, "")
        optional = "None" in hint
        if value is None and optional:
            continue
        name = f"{prefix}.{key}"
        if hint.startswith("bool"):
            check_bool(name, value, optional)
        elif hint.startswith("float"):
            check_num(name, value, lo=-math.inf, allowed="a finite number" + (" or null" if optional else ""))
        elif hint.startswith("int"):
            check_int(name, value, allowed="an int" + (" or null" if optional else ""))
        elif hint.startswith("str"):
            check_str(name, value)
