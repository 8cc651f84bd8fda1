"""pytest plugin (entry point `pytest11: cacheattn`): the conformance kit as one generated test.

    pytest --cacheattn-impl=mypkg.kernels:attention --cacheattn-op=multi_head_cache_attention \\
           [--cacheattn-features=causal,gqa,cache_layout_0,cache_mode_1] [--cacheattn-dtypes=float16]
           [--cacheattn-examples=100] [--cacheattn-seed=0]

adds the test `cacheattn-conformance[OP]` to the session. Nothing is imported until it runs (numba and
hypothesis stay out of every other pytest run, and a conftest can still choose the CUDA simulator first).
"""

from __future__ import annotations

import importlib

import pytest


def pytest_addoption(parser):
    """The options, all optional; `--cacheattn-impl` and `--cacheattn-op` come together.

    - `--cacheattn-impl MODULE:FUNCTION`: the implementation, called like `cacheattn.<op>`.
    - `--cacheattn-op NAME`: the operator, a key of `cacheattn.testing.OPERATORS`.
    - `--cacheattn-features A,B`: the features the implementation supports (default: all of the operator's).
    - `--cacheattn-dtypes A,B`: the dtypes to draw (default: all of the operator's).
    - `--cacheattn-examples N`: problems to draw (default 100).
    - `--cacheattn-seed N`: a repeatable run.
    """
    group = parser.getgroup("cacheattn", "cacheattn conformance kit")
    group.addoption("--cacheattn-impl", metavar="MODULE:FUNCTION",
                    help="the implementation to check, called like the cacheattn function of --cacheattn-op")
    group.addoption("--cacheattn-op", metavar="NAME", help="the operator, e.g. multi_head_cache_attention")
    group.addoption("--cacheattn-features", metavar="A,B", help="features the implementation supports (default all)")
    group.addoption("--cacheattn-dtypes", metavar="A,B", help="dtypes to draw (default all of the operator's)")
    group.addoption("--cacheattn-examples", type=int, default=100, metavar="N", help="examples to draw (100)")
    group.addoption("--cacheattn-seed", type=int, default=None, metavar="N", help="repeatable run with this seed")


def _split(text):
    return None if text is None else [part.strip() for part in text.split(",") if part.strip()]


def load_impl(spec: str):
    """The object `spec` ("package.module:attribute", the attribute possibly dotted) names.

    Raises
    ------
    pytest.UsageError
        `spec` is not of the form MODULE:ATTRIBUTE.
    """
    module, sep, attribute = spec.partition(":")
    if not sep or not module or not attribute:
        raise pytest.UsageError(f"--cacheattn-impl: expected MODULE:FUNCTION, got {spec!r}")
    target = importlib.import_module(module)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


class ConformanceItem(pytest.Item):
    def __init__(self, *, op, **kwargs):
        super().__init__(**kwargs)
        self.op = op

    def runtest(self):
        from cacheattn import testing

        config = self.config
        impl = load_impl(config.getoption("cacheattn_impl"))
        report = testing.check(self.op, impl, max_examples=config.getoption("cacheattn_examples"),
                               dtypes=_split(config.getoption("cacheattn_dtypes")),
                               features=_split(config.getoption("cacheattn_features")),
                               seed=config.getoption("cacheattn_seed"))
        self.user_properties.append(("cacheattn", str(report)))

    def repr_failure(self, excinfo, style=None):
        from cacheattn.testing import ConformanceError

        if isinstance(excinfo.value, (ConformanceError, ValueError, TypeError)):
            return f"{type(excinfo.value).__name__}: {excinfo.value}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"cacheattn conformance of {self.config.getoption('cacheattn_impl')} as {self.op}"


def pytest_collection_modifyitems(session, config, items):
    impl, op = config.getoption("cacheattn_impl"), config.getoption("cacheattn_op")
    if impl is None and op is None:
        return
    if impl is None or op is None:
        raise pytest.UsageError("--cacheattn-impl and --cacheattn-op come together")
    items.append(ConformanceItem.from_parent(session, name=f"cacheattn-conformance[{op}]", op=op))
