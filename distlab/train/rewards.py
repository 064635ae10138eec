"""Rewards a completion earns (``--reward NAME[,NAME...]``, weighted by ``--reward-weights``): the verifiable ones
built in, or the user's own function named on the command line.

Built in, each 1.0 or 0.0, reading the record's ``"answer"`` where they need one:

``exact``         the completion's answer is the record's ``"answer"``, as text (spaces around it dropped)
``number``        the last number in the completion's answer equals ``"answer"`` within ``1e-6`` (relative,
                  and absolute below 1)
``format``        the completion is ``<think>...</think>`` then ``<answer>...</answer>`` (spaces between)
``regex:PATTERN`` the completion matches ``PATTERN`` (Python's ``re.search``)

A completion's *answer* is what its ``<answer>...</answer>`` holds where it has one, else the text after its last
``####`` (GSM8K's mark), else the whole completion. The user's own: ``FILE.py:NAME`` or ``package.module:NAME``,
a function ``NAME(completion: str, record: dict) -> float`` (``record``: the prompt's line of the data file) --
their code, named on the command line, never read from a data or checkpoint file.
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Callable

from distlab.errors import ConfigError
from distlab.runtime import user_code

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.S)
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
BUILT_IN = ("exact", "number", "format", "regex:PATTERN")


def answer_of(completion: str) -> str:
    """What a completion answers (module docstring)."""
    found = ANSWER.findall(completion)
    if found:
        return found[-1].strip()
    return completion.rpartition("####")[2].strip() if "####" in completion else completion.strip()


def _expected(record: dict, name: str) -> str:
    if "answer" not in record:
        raise ConfigError(f"reward {name} compares a completion with its record's \"answer\", and a record has none: "
                          f"add \"answer\" to every line, or choose another --reward")
    return str(record["answer"]).strip()


def exact(completion: str, record: dict) -> float:
    return float(answer_of(completion) == _expected(record, "exact"))


def number(completion: str, record: dict) -> float:
    want = float(_expected(record, "number").replace(",", ""))
    found = NUMBER.findall(answer_of(completion))
    if not found:
        return 0.0
    got = float(found[-1].replace(",", ""))
    return float(math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-6))


def format_reward(completion: str, record: dict) -> float:
    return float(bool(FORMAT.match(completion)))


def _regex(pattern: str) -> Callable[[str, dict], float]:
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ConfigError(f"--reward regex:{pattern}: not a regular expression ({exc})") from None
    return lambda completion, record: float(bool(compiled.search(completion)))


def one(name: str) -> Callable[[str, dict], float]:
    """The reward ``name`` (module docstring), a user's own one loaded and its signature checked."""
    if name == "exact":
        return exact
    if name == "number":
        return number
    if name == "format":
        return format_reward
    if name.startswith("regex:"):
        return _regex(name[len("regex:"):])
    if ":" not in name:
        raise ConfigError(f"unknown --reward {name!r}; choose {', '.join(BUILT_IN)} or your own as FILE.py:NAME")
    fn = user_code.load(name, "--reward", "a reward function")
    try:
        inspect.signature(fn).bind("completion", {})
    except (TypeError, ValueError):
        raise ConfigError(f"--reward {name}: {name.rpartition(':')[2]} must take (completion, record) and return a "
                          f"number") from None
    return fn


def names_of(text: str) -> list[str]:
    """``--reward``'s names: comma-separated, a ``regex:`` pattern taking the rest of its own part."""
    return [part.strip() for part in text.split(",") if part.strip()]


class Rewards:
    """The rewards of ``text`` (``--reward``) weighed by ``weights`` (``--reward-weights``; default 1 each):
    :meth:`score` gives each completion's weighted sum and each reward's own value."""

    def __init__(self, text: str, weights: str | None = None):
        self.names = names_of(text)
        if not self.names:
            raise ConfigError(f"--reward: name at least one reward ({', '.join(BUILT_IN)}, or FILE.py:NAME)")
        self.fns = [one(n) for n in self.names]
        try:
            self.weights = [float(w) for w in weights.split(",")] if weights else [1.0] * len(self.names)
        except ValueError:
            raise ConfigError(f"--reward-weights {weights}: write one number per reward, comma-separated") from None
        if len(self.weights) != len(self.names):
            raise ConfigError(f"--reward-weights gives {len(self.weights)} weights for {len(self.names)} rewards "
                              f"({', '.join(self.names)}): give one each")

    def score(self, completion: str, record: dict) -> tuple[float, list[float]]:
        """``(weighted sum, each reward)`` of one completion; a reward that is no finite number is refused."""
        each = []
        for name, fn in zip(self.names, self.fns):
            value = fn(completion, record)
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ConfigError(f"--reward {name} returned {value!r} for a completion: a reward is a number") from None
            if not math.isfinite(value):
                raise ConfigError(f"--reward {name} returned {value} for a completion: a reward is a finite number")
            each.append(value)
        return sum(w * v for w, v in zip(self.weights, each)), each
