"""The patch registry: install is idempotent, uninstall restores every original, and an
unverified megatron-core is refused unless explicitly allowed."""

import pytest

import megatron_ext
from megatron_ext import registry


@pytest.fixture
def clean_registry():
    megatron_ext.uninstall()
    originals = {p.target: registry.current(p.target) for p in registry.patches()}
    yield originals
    megatron_ext.uninstall()


def test_every_patch_names_target_versions_and_reason():
    for patch in registry.patches():
        assert ":" in patch.target
        assert patch.verified and all(v.count(".") == 2 for v in patch.verified)
        assert len(patch.why) > 20
        assert patch.group in {"core", "cpu", "trace", "startup", "fault"}


def test_install_is_idempotent_and_uninstall_restores(clean_registry):
    megatron_ext.install()
    first = {p.target: registry.current(p.target) for p in registry.patches("core")}
    megatron_ext.install()
    assert {p.target: registry.current(p.target) for p in registry.patches("core")} == first
    assert all(first[t] is not clean_registry[t] for t in first)
    assert megatron_ext.installed()
    megatron_ext.uninstall()
    assert not megatron_ext.installed()
    for target, original in clean_registry.items():
        assert registry.current(target) is original, target


def test_cpu_runtime_is_undone_by_uninstall(clean_registry):
    from megatron_ext import runtime

    runtime.use_cpu()
    assert runtime.cpu_active()
    megatron_ext.uninstall()
    assert not runtime.cpu_active()
    for target, original in clean_registry.items():
        assert registry.current(target) is original, target


def test_unverified_megatron_core_is_refused(clean_registry, monkeypatch):
    monkeypatch.setattr(registry, "megatron_core_version", lambda: "0.99.0")
    monkeypatch.delenv(registry.ALLOW_UNVERIFIED_ENV, raising=False)
    with pytest.raises(
        registry.UnverifiedMegatronCoreError,
        match=r"megatron-core 0\.99\.0.*MEGATRON_EXT_ALLOW_UNVERIFIED=1",
    ):
        megatron_ext.install()
    assert not megatron_ext.installed()


def test_unverified_megatron_core_allowed_by_environment_with_a_warning(
    clean_registry, monkeypatch
):
    monkeypatch.setattr(registry, "megatron_core_version", lambda: "0.99.0")
    monkeypatch.setenv(registry.ALLOW_UNVERIFIED_ENV, "1")
    with pytest.warns(UserWarning, match="0.99.0"):
        megatron_ext.install()
    assert megatron_ext.installed()


def test_a_target_cannot_be_registered_twice():
    existing = registry.patches()[0]
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(registry.Patch(existing.target, "builtins:id", "a second replacement"))


def test_install_reapplies_a_patch_replaced_behind_its_back(clean_registry):
    """A test's monkeypatch can restore an original over our replacement; the next install()
    must notice and patch again instead of trusting its bookkeeping."""
    megatron_ext.install()
    patch = registry.patches("core")[0]
    owner_module, attribute = patch.target.split(":")
    import importlib

    setattr(importlib.import_module(owner_module), attribute, clean_registry[patch.target])
    megatron_ext.install()
    assert registry.current(patch.target) is not clean_registry[patch.target]


def test_suspended_puts_the_original_back_for_a_while(clean_registry):
    megatron_ext.install()
    target = registry.patches("core")[0].target
    replacement = registry.current(target)
    with registry.suspended(target):
        megatron_ext.install()  # must not re-apply inside the block
        assert registry.current(target) is clean_registry[target]
    assert registry.current(target) is replacement
