"""Synchronous torch_dist saves collect their write results in an in-process queue instead of
a spawned multiprocessing Manager's (which cost seconds at every run's first save)."""

import queue
from types import SimpleNamespace

import megatron_ext
from megatron_ext.checkpoint.sync_save import results_queue_for_sync_saves

TARGET = "megatron.core.dist_checkpointing.strategies.filesystem_async:get_write_results_queue"


def test_sync_saves_get_an_in_process_queue_async_ones_the_managers(monkeypatch):
    megatron_ext.install()
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.training import global_vars

    assert filesystem_async.get_write_results_queue.__wrapped__ is not None, "the registry's"
    managers = []
    get_queue = results_queue_for_sync_saves(lambda: managers.append("spawned") or "manager")

    assert get_queue() == "manager", "no megatron.training arguments: upstream's queue"
    monkeypatch.setattr(global_vars, "get_args", lambda: SimpleNamespace(async_save=True))
    assert get_queue() == "manager", "--async-save: the writer is another process"
    monkeypatch.setattr(global_vars, "get_args", lambda: SimpleNamespace(async_save=False))
    first, second = get_queue(), get_queue()
    assert isinstance(first, queue.Queue) and first is not second, "one per writer"
    first.put({0: ["write results"]})  # write_preloaded_data_multithread
    assert first.get_nowait() == {0: ["write results"]}  # retrieve_write_results
    assert managers == ["spawned", "spawned"]
