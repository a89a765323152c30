"""The start-up patch: torch.compile deferred to a function's first call while megatron is
imported, and torch.compile itself restored afterwards."""

import torch

from megatron_ext import registry
from megatron_ext.launch import startup


class _CountingCompile:
    """Stands in for torch.compile: records what it compiled, returns a marked wrapper."""

    def __init__(self):
        self.calls = []

    def __call__(self, model, **options):
        self.calls.append((model, options))

        def compiled(*args, **kwargs):
            return ("compiled", model(*args, **kwargs))

        return compiled


def _double(x):
    return 2 * x


def test_a_function_compiles_at_its_first_call_only():
    real = _CountingCompile()
    deferred = startup.compile_on_first_call(real)
    fn = deferred(_double, dynamic=False)
    assert real.calls == [] and fn.__name__ == "_double"
    assert fn(3) == ("compiled", 6) and fn(4) == ("compiled", 8)
    assert real.calls == [(_double, {"dynamic": False})]


def test_decorator_with_options_and_modules_go_through():
    real = _CountingCompile()
    deferred = startup.compile_on_first_call(real)
    fn = deferred(fullgraph=True)(_double)
    assert real.calls == [] and fn(1) == ("compiled", 2)
    assert real.calls == [(_double, {"fullgraph": True})]
    module = torch.nn.Identity()
    deferred(module)  # a module is compiled at once, as torch.compile does
    assert real.calls[-1] == (module, {})


def test_the_startup_group_restores_torch_compile_exactly(monkeypatch):
    original = torch.compile

    def refuse(_patches):
        raise AssertionError("a torch-only group must not need megatron's version check")

    monkeypatch.setattr(registry, "check_megatron_core_version", refuse)
    with startup.torch_compile_deferred():
        assert torch.compile is not original
        assert registry.is_applied("torch:compile")
    assert torch.compile is original and not registry.is_applied("torch:compile")


def test_entry_imports_pause_the_collector_and_resume_it(monkeypatch):
    import gc

    monkeypatch.setattr(registry, "check_megatron_core_version", lambda _patches: None)
    assert gc.isenabled()
    startup.begin_entry_imports()
    startup.begin_entry_imports()  # nested: only the outermost end resumes collection
    assert not gc.isenabled() and registry.is_applied("torch:compile")
    startup.end_entry_imports()
    assert not gc.isenabled()
    startup.end_entry_imports()
    assert gc.isenabled() and not registry.is_applied("torch:compile")
    gc.disable()  # a process that had switched the collector off keeps it off
    try:
        startup.begin_entry_imports()
        startup.end_entry_imports()
        assert not gc.isenabled()
    finally:
        gc.enable()
