"""``repeat`` blocks: a block of layers written once in a workload's ``model`` and repeated N times
(``{type: repeat, times: N, name: block, layers: [...]}``), expanded before validation, so every
other part of the harness sees the plain layer list it always saw.
"""
from __future__ import annotations

from typing import Any

from .layers import INPUT_NAME

REPEAT_KEYS = ("type", "times", "name", "layers")


def expand_repeats(model: list[Any]) -> list[Any]:
    """``model`` with each ``{type: repeat, times: N, name: block, layers: [...]}`` written out N
    times. Inside repetition i a layer name ``x`` becomes ``{name}{i}.x`` (and so do the ``inputs``
    and ``tied_to`` that refer to it); ``input`` names the repetition's own input: the layer before
    it, which gets the name ``{name}{i}.input`` when it has none (or the network input, for a block
    that starts the model). Raises ``ValueError`` (one line) on a malformed block."""
    out: list[Any] = []
    for k, entry in enumerate(model):
        if not (isinstance(entry, dict) and entry.get("type") == "repeat"):
            out.append(entry)
            continue
        where = f"`model[{k}]` (repeat)"
        unknown = sorted(set(entry) - set(REPEAT_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key `{unknown[0]}`; allowed: {', '.join(REPEAT_KEYS)}")
        times, prefix, body = entry.get("times"), entry.get("name", "block"), entry.get("layers")
        if not isinstance(times, int) or isinstance(times, bool) or times < 1:
            raise ValueError(f"{where}: `times` must be a whole number of at least 1; got {times!r}")
        if not isinstance(prefix, str) or not prefix.replace("_", "a").replace("-", "a").isalnum():
            raise ValueError(f"{where}: `name` must be letters, digits, _ and -; got {prefix!r}")
        if not isinstance(body, list) or not body or not all(isinstance(x, dict) for x in body):
            raise ValueError(f"{where}: `layers` must be a list of one or more layers")
        if any(x.get("type") == "repeat" for x in body):
            raise ValueError(f"{where}: a repeat inside a repeat is not supported; write the inner block out")
        local = {x["name"] for x in body if isinstance(x.get("name"), str)}
        if INPUT_NAME in local:
            raise ValueError(f"{where}: the name '{INPUT_NAME}' is the repetition's input inside a repeat")
        for i in range(times):
            name = f"{prefix}{i}."
            if out:
                if not isinstance(out[-1], dict):
                    raise ValueError(f"{where}: the layer before it must be a mapping")
                if out[-1].get("name") is None:
                    out[-1] = dict(out[-1], name=f"{name}{INPUT_NAME}")
                block_input = out[-1]["name"]
            else:
                block_input = INPUT_NAME
            rename = {n: name + n for n in local} | {INPUT_NAME: block_input}
            for layer in body:
                copy = dict(layer)
                if isinstance(copy.get("name"), str):
                    copy["name"] = name + copy["name"]
                if isinstance(copy.get("inputs"), list):
                    copy["inputs"] = [rename.get(x, x) if isinstance(x, str) else x for x in copy["inputs"]]
                if isinstance(copy.get("tied_to"), str):
                    copy["tied_to"] = rename.get(copy["tied_to"], copy["tied_to"])
                out.append(copy)
    return out
