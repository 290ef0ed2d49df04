"""The test processes' JAX compilation cache (tests/conftest.py): shared by every
checkout of a machine, so a run gathers only the folders of processes that ended."""

import os
import subprocess
import sys

import conftest


def _entry(folder, name, text="x"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)


def test_a_run_gathers_ended_processes_folders_and_leaves_a_running_ones(tmp_path):
    machine, store = tmp_path / "m", tmp_path / "m" / "entries"
    _entry(machine / "old-layout", "a-cache")  # a folder without a lock: ended
    _entry(machine / "ended", "b-cache")
    (machine / "ended.lock").touch()
    # A process of another checkout's run, alive: it holds its folder's lock.
    code = ("import os, fcntl, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)")
    _entry(machine / "live", "c-cache")
    holder = subprocess.Popen([sys.executable, "-c", code, str(machine / "live.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        conftest._gather(store, machine)
        assert sorted(p.name for p in store.iterdir()) == ["a-cache", "b-cache"]
        assert (machine / "live" / "c-cache").read_text() == "x"  # untouched
        assert not (machine / "ended").exists() and not (machine / "old-layout").exists()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    conftest._gather(store, machine)  # its process has ended: gathered now
    assert sorted(p.name for p in store.iterdir()) == ["a-cache", "b-cache", "c-cache"]


def test_a_process_folder_links_every_entry_and_is_locked_while_it_lives(tmp_path):
    machine, store = tmp_path / "m", tmp_path / "m" / "entries"
    _entry(store, "a-cache", "A")
    own = conftest._own_folder(store, machine, "me")
    try:
        assert (own / "a-cache").read_text() == "A"
        assert os.stat(own / "a-cache").st_ino == os.stat(store / "a-cache").st_ino
        _entry(own, "new-cache")
        conftest._gather(store, machine)  # this process's own folder: held, so left alone
        assert (own / "new-cache").exists() and not (store / "new-cache").exists()
    finally:
        os.close(conftest._HELD.pop())


def test_the_store_keeps_under_its_cap_by_dropping_the_oldest(tmp_path, monkeypatch):
    machine, store = tmp_path / "m", tmp_path / "m" / "entries"
    for i in range(6):
        _entry(store, f"e{i}-cache", "x" * 100)
        os.utime(store / f"e{i}-cache", (1000 + i, 1000 + i))
    monkeypatch.setattr(conftest, "_STORE_CAP", 450)
    conftest._gather(store, machine)  # 600 bytes > 450: down to half, newest kept
    assert sorted(p.name for p in store.iterdir()) == ["e4-cache", "e5-cache"]
    conftest._gather(store, machine)  # under the cap: nothing goes
    assert len(list(store.iterdir())) == 2


def test_the_default_folder_is_the_users_cache_not_the_checkout(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert conftest._default_cache() == tmp_path / "mpfunc" / "test-jax-cache"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert str(conftest._default_cache()).startswith(os.path.expanduser("~"))
