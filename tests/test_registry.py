"""Run state as a registry (distlab.train.registry): a payload is what the entries save, a resume
loads each entry by name, and on another layout each by its reshard rule."""

import pytest

from distlab.train.registry import StateRegistry


class _Box:
    def __init__(self, value=None):
        self.value = value

    def state_dict(self):
        return {"v": self.value}

    def load_state_dict(self, state):
        self.value = state["v"]


def _registry(boxes, order):
    reg, inner = StateRegistry(), StateRegistry()
    for name, policy in (("same", "same"), ("mine", "mine"), ("fresh", "fresh"), ("layout", "layout")):
        reg.register(name, lambda b=boxes[name]: b.value, lambda v, b=boxes[name], n=name: (b.__setattr__("value", v),
                                                                                           order.append(n)),
                     reshard=policy)
    reg.register("all", lambda: boxes["all"].value, lambda v: (setattr(boxes["all"], "value", v), order.append("all")),
                 reshard="all")
    reg.register("written_only", lambda: "for others")
    reg.register("maybe", lambda: boxes["maybe"].value, lambda v: setattr(boxes["maybe"], "value", v), optional=True)
    inner.register_stateful("scaler", boxes["scaler"])
    inner.register("memory", lambda: boxes["memory"].value, lambda v: setattr(boxes["memory"], "value", v),
                   reshard="fresh")
    reg.register_registry("engine", inner, optional=True)
    return reg


def _boxes(rank):
    return {k: _Box(f"{k}{rank}") for k in ("same", "mine", "fresh", "layout", "all", "scaler", "memory")} | \
        {"maybe": _Box(None)}


def test_a_payload_is_every_entry_by_name_and_loads_back_in_order():
    order = []
    payload = _registry(_boxes(0), order).state_dict()
    assert list(payload) == ["same", "mine", "fresh", "layout", "all", "written_only", "engine"]  # no None optional
    assert payload["engine"] == {"scaler": {"v": "scaler0"}, "memory": "memory0"}
    target = _boxes(9)
    _registry(target, order).load_state_dict(payload)
    assert {k: b.value for k, b in target.items()} == {
        "same": "same0", "mine": "mine0", "fresh": "fresh0", "layout": "layout0", "all": ["all0"],
        "scaler": "scaler0", "memory": "memory0", "maybe": None}
    assert order[-5:] == ["same", "mine", "fresh", "layout", "all"]


def test_on_another_layout_each_entry_follows_its_rule():
    payloads = [_registry(_boxes(r), []).state_dict() for r in range(3)]  # three old ranks
    target = _boxes(9)
    _registry(target, []).load_state_dict(payloads[0], payloads, rank=4)  # new rank 4
    got = {k: b.value for k, b in target.items()}
    assert got["same"] == "same0" and got["mine"] == "mine1"  # 4 mod 3
    assert got["all"] == ["all0", "all1", "all2"]
    assert got["fresh"] == "fresh9" and got["layout"] == "layout9"  # untouched here
    assert got["scaler"] == "scaler0" and got["memory"] == "memory9"  # the nested registry's own rules


def test_a_missing_entry_is_named_and_bad_registrations_are_refused():
    reg = _registry(_boxes(0), [])
    payload = reg.state_dict()
    del payload["mine"]
    with pytest.raises(KeyError, match="'mine'"):
        _registry(_boxes(1), []).load_state_dict(payload)
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("same", lambda: 0)
    with pytest.raises(ValueError, match="reshard 'sometimes'"):
        reg.register("new", lambda: 0, reshard="sometimes")
