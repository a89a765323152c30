"""megatron_ext.testing.timing: a test's wall-clock bound is its idle figure times the
machine's present slowdown, and the idle figure itself in the soak tier (a harness wait is scaled
there too)."""

from megatron_ext.testing import timing


def test_a_bound_scales_with_the_larger_of_reference_slowdown_and_load(monkeypatch):
    monkeypatch.delenv(timing.SOAK_ENV, raising=False)
    monkeypatch.setattr(timing, "_measured", None)
    monkeypatch.setattr(timing, "reference_slowdown", lambda: 3.0)
    monkeypatch.setattr(timing, "load_per_core", lambda: 0.5)
    limit = timing.bound(20)
    assert (float(limit), limit.idle_s, limit.factor) == (60.0, 20, 3.0)
    assert "bound 60 s (20 s idle x slowdown 3.0" in limit.explain(7.0)
    monkeypatch.setattr(timing, "_measured", None)
    monkeypatch.setattr(timing, "load_per_core", lambda: 12.0)  # load 24 on 2 cores
    assert timing.bound(20) == 240.0


def test_the_soak_tier_keeps_the_idle_figures(monkeypatch):
    monkeypatch.setenv(timing.SOAK_ENV, "1")
    monkeypatch.setattr(timing, "reference_slowdown", lambda: 10.0)
    assert timing.bound(20) == 20.0


def test_the_reference_start_up_is_measured_and_at_least_one():
    assert timing.reference_slowdown() >= 1.0


def test_runs_started_by_tests_get_a_scaled_start_up_allowance(monkeypatch):
    from megatron_ext.launch import heartbeat

    monkeypatch.delenv(timing.SOAK_ENV, raising=False)
    monkeypatch.delenv(heartbeat.STARTUP_ENV, raising=False)
    monkeypatch.setattr(timing, "_measured", (1e18, 4.0))  # measured "now"
    assert timing.watchdog_env() == {heartbeat.STARTUP_ENV: f"{4 * heartbeat.STARTUP_S:.0f}"}
    monkeypatch.setenv(heartbeat.STARTUP_ENV, "77")
    assert timing.watchdog_env() == {}, "an allowance the user set is kept"


def test_a_harness_wait_scales_with_the_load_even_in_the_soak_tier(monkeypatch):
    monkeypatch.setenv(timing.SOAK_ENV, "1")
    monkeypatch.setattr(timing, "_measured", None)
    monkeypatch.setattr(timing, "reference_slowdown", lambda: 2.0)
    monkeypatch.setattr(timing, "load_per_core", lambda: 3.5)  # load 7 on 2 cores
    wait = timing.harness_bound(600)
    assert (float(wait), wait.idle_s, wait.factor) == (2100.0, 600, 3.5)
    assert timing.bound(600) == 600.0, "the claims' bounds keep their idle figures"
