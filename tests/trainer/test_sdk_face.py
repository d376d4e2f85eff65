"""The SDK's public face: one import name, one way to declare an entrypoint, what ``Context`` shows,
``should_stop`` with one meaning."""

from __future__ import annotations

import importlib
import warnings

import pytest

import unbroken


def test_the_sdk_imports_under_one_name_only():
    assert unbroken.__name__ == "unbroken"
    with pytest.raises(ImportError, match="`import unbroken`, not `import trainer.unbroken`"):
        importlib.import_module("trainer.unbroken")


def test_an_entrypoint_is_declared_one_way():
    assert "run" not in unbroken.__all__ and not hasattr(unbroken, "run")
    assert "entrypoint" in unbroken.__all__


def test_outside_the_product_the_context_shows_its_api_only():
    seen = {}

    def train(ctx: unbroken.Context) -> str:
        seen["attributes"] = sorted(n for n in vars(ctx) if not n.startswith("_"))
        seen["public"] = sorted(n for n in dir(ctx) if not n.startswith("_"))
        assert not ctx.should_stop() and ctx.iteration == 0
        ctx.step(1, loss=0.5)
        return "done"

    assert unbroken.entrypoint(train)() == "done"
    assert seen["attributes"] == ["checkpoint"]
    assert seen["public"] == ["checkpoint", "device", "init_process_group", "iteration", "rank",
                              "should_stop", "step", "world_size"]


def test_level1s_rank_local_stop_has_its_own_name_and_the_old_one_warns():
    run = unbroken.init()
    assert run.stop_requested() is False
    unbroken._should_stop_warned = False
    with pytest.warns(DeprecationWarning, match=r"run\.stop_requested\(\)"):
        assert run.should_stop() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run.should_stop() is False  # once only
