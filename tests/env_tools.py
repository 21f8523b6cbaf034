"""Tools and a reward the environment tests name (the tool worker process imports them by reference)."""

import os
import time
from enum import Enum
from typing import Any, Literal


class Unit(Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer
        b: The second integer

    Returns:
        Their sum
    """
    return a + b


def get_weather(city: str, unit: Literal["C", "F"] = "C", days: int | None = None) -> dict:
    """The weather in a city,
    today or over the next days.

    Args:
        city: The city's name, as
            people write it
        unit: The temperature's unit
        days: How many days ahead (choices: [1, 2, 3])
    """
    return {"city": city, "temperature": 21 if unit == "C" else 70}


def search(query: str, tags: list[str], limits: dict[str, float], pair: tuple[int, str], unit: Unit,
           anything: Any, when: str | int, where: list[int] | str | None = None) -> str:
    """Search the notes.

    Args:
        query (str): Words to look for
        tags: Tags the notes must carry (choices: ["a", "b"])
        limits: A limit per field
        pair: An id and its label
        unit: A unit
        anything: Whatever
        when: A date or a timestamp
        where: Places
    """
    return f"found {query}"


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: Ignored
    """
    raise ValueError(f"no luck with\n{x}")


def sleep_forever() -> str:
    """Never returns."""
    while True:
        time.sleep(60)


def a_set() -> set:
    """Returns what JSON cannot hold."""
    return {1, 2}


def crash() -> str:
    """The process dies."""
    os._exit(3)


def answered(messages, answer):
    """1.0 when the last assistant turn holds the record's answer."""
    return float(answer in messages[-1]["content"])


def worker_pid() -> int:
    """The process the call ran in."""
    return os.getpid()
