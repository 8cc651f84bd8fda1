"""The Examples sections of the public docstrings run, and show what they print (doctest).

Every public function, class and method of the modules below that the API reference renders is collected;
a docstring without `>>>` lines gives no test. Examples print shapes, booleans and rounded numbers, never a
float's last digits."""

import doctest
import importlib
import inspect

import pytest

MODULES = ("cacheattn.ppl", "cacheattn.onnx", "cacheattn.ft", "cacheattn.trtllm", "cacheattn.examples",
           "cacheattn.testing", "cacheattn.testing.strategies", "cacheattn.testing.pytest_plugin",
           "cacheattn.traceability", "cacheattn.onnx_conformance", "cacheattn.kernel_choice")
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _owned(module, obj) -> bool:
    """Defined in `module` (wrappers such as accepts_torch keep the operator's __module__)."""
    return getattr(obj, "__module__", None) == module.__name__


def collect() -> list:
    """[(id, doctest)] of every public docstring with examples."""
    parser, found = doctest.DocTestParser(), []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        objects = [(module_name, module)]
        for name, obj in vars(module).items():
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)) or \
                    not _owned(module, obj):
                continue
            objects.append((f"{module_name}.{name}", obj))
            if inspect.isclass(obj):
                objects += [(f"{module_name}.{name}.{m}", f) for m, f in vars(obj).items()
                            if not m.startswith("_") and inspect.isfunction(f)]
        for qualname, obj in objects:
            text = inspect.getdoc(obj) or ""
            if ">>>" in text:
                found.append((qualname, parser.get_doctest(text, {}, qualname, module_name, 0)))
    return found


EXAMPLES = collect()


def test_every_operator_has_an_example():
    names = {name.rsplit(".", 1)[-1] for name, _ in EXAMPLES}
    assert {"key_value_cache", "dynamic_key_value_cache", "dynamic_multi_head_attention",
            "multi_head_cache_attention", "onnx_attention", "cross_attention"} <= names


@pytest.mark.parametrize("example", [t for _, t in EXAMPLES], ids=[name for name, _ in EXAMPLES])
def test_docstring_example_runs(example):
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    out = []
    runner.run(example, out=out.append)
    assert runner.failures == 0, "".join(out)
