"""Storage tiers from Python under faults and misuse: files removed or unremovable under the disk tier, spec
parameters past their ranges, a generous get() bound. Each case failed before its fix."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest

import kvtier

KEY = "%032x" % 2


def object_files(root: str) -> list:
    return [f for f in glob.glob(os.path.join(root, "*-*", "[0-9a-f][0-9a-f]", "*")) if os.path.isfile(f)]


class Frozen:
    """Makes a directory's entries unremovable: mode 0555 where that binds (not root), else the immutable
    attribute (root, on file systems that have it); skips the test where neither does."""

    def __init__(self, path: str):
        self.path, self.probe, self.thaw = path, os.path.join(path, ".probe"), None

    def _try(self, freeze, thaw) -> bool:
        with open(self.probe, "w"):
            pass
        if not freeze():
            os.unlink(self.probe)
            return False
        try:
            os.unlink(self.probe)
        except OSError:
            self.thaw = thaw
            return True
        thaw()
        return False

    def __enter__(self):
        def chattr(flag):
            return shutil.which("chattr") is not None and \
                subprocess.run(["chattr", flag, self.path], capture_output=True).returncode == 0
        if self._try(lambda: os.chmod(self.path, 0o555) or True, lambda: os.chmod(self.path, 0o755)):
            return self
        if self._try(lambda: chattr("+i"), lambda: chattr("-i")):
            return self
        pytest.skip("cannot make a directory's entries unremovable here")

    def __exit__(self, *exc):
        self.thaw()
        os.unlink(self.probe)


def disk(root, params: str = ""):
    return kvtier.StorageBackend.open(f"disk:{root}{params}")


def test_a_delete_that_cannot_remove_the_file_fails_and_keeps_the_object(tmp_path):
    """delete() said True while the file stayed, and the 'deleted' object was served again after a reopen."""
    root = str(tmp_path / "d")
    b = disk(root)
    b.put(KEY, b"old" * 1000)
    (path,) = object_files(root)
    with Frozen(os.path.dirname(path)):
        with pytest.raises(kvtier.KvtierError, match="delete .*unlink"):
            b.delete(KEY)
        assert b.get(KEY, 4000) == b"old" * 1000, "still stored, still served"
    assert b.delete(KEY) is True
    del b
    assert disk(root).get(KEY, 4000) is None


def test_an_eviction_that_cannot_remove_the_file_fails_the_put_and_keeps_the_object(tmp_path):
    root = str(tmp_path / "d")
    b = disk(root, "?capacity=64K")
    b.put(KEY, b"a" * 40_000)
    (path,) = object_files(root)
    other = "%032x" % 3
    with Frozen(os.path.dirname(path)):
        with pytest.raises(kvtier.KvtierError, match="evicting .*unlink"):
            b.put(other, b"b" * 40_000)
        assert b.get(KEY, 40_000) == b"a" * 40_000
    b.put(other, b"b" * 40_000)  # evicts it now
    assert b.get(KEY, 40_000) is None
    assert b.get(other, 40_000) == b"b" * 40_000


def test_a_file_removed_under_the_disk_tier_is_forgotten_and_can_be_stored_again(tmp_path):
    """exists() kept answering yes for a file removed under the tier, so an engine that asks before it stores
    (SGLang's HiCache) never stored the block again."""
    root = str(tmp_path / "d")
    b = disk(root)
    b.put(KEY, b"x" * 100)
    (path,) = object_files(root)
    os.unlink(path)
    assert b.exists(KEY) is False
    b.put(KEY, b"y" * 100)
    assert b.get(KEY, 100) == b"y" * 100
    os.unlink(object_files(root)[0])
    assert b.get(KEY, 100) is None
    assert b.exists(KEY) is False


def test_a_namespace_directory_removed_under_the_tier_is_named(tmp_path):
    """With its directory removed (and made again) every put failed 'mkdir .../ec: No such file or directory',
    naming a path that exists: the error says the directory was removed and the tier must be reopened."""
    import shutil

    root = str(tmp_path / "d")
    b = disk(root)
    b.put(KEY, b"x" * 100)
    shutil.rmtree(root)
    os.makedirs(root)
    with pytest.raises(kvtier.UnavailableError, match="removed while the tier was open"):
        for i in range(64):  # keys of shards whose directory does not exist yet
            b.put("%032x" % (1000 + i), b"y" * 100)
    assert b.get(KEY, 100) is None
    del b
    b = disk(root)  # reopened: it stores again
    b.put(KEY, b"z" * 100)
    assert b.get(KEY, 100) == b"z" * 100


def test_get_sizes_its_buffer_by_the_object_not_by_max_bytes(tmp_path):
    """get(key, 2**63) raised 'basic_string::_M_create' (and a large but possible bound allocated that much)."""
    b = disk(str(tmp_path / "d"))
    b.put(KEY, b"abc")
    assert b.get(KEY, 2**63) == b"abc"
    assert b.get(KEY, 2**64 - 1) == b"abc"
    with pytest.raises(kvtier.InvalidArgumentError, match="3 bytes, more than max_bytes = 2"):
        b.get(KEY, 2)
    assert b.get("%032x" % 9, 2**63) is None


@pytest.mark.parametrize("param,value", [("item_deadline_ms", "11300000000000000"),
                                         ("batch_deadline_ms", "86400001"), ("timeout_ms", "2**40"),
                                         ("workers", "4294967297"), ("ttl", "9999999999999")])
def test_redis_parameters_past_their_range_are_refused_by_name(param, value):
    """A deadline past a day overflowed the clock (every operation then failed as 'timed out'); workers and
    queue depths wrapped to 32 bits ('0', or silently 1); a ttl past what Redis takes failed every put."""
    value = str(eval(value)) if "**" in value else value  # noqa: S307 - literals of this file
    with pytest.raises(kvtier.InvalidArgumentError, match=f"{param}={value}"):
        kvtier.StorageBackend.open(f"redis://127.0.0.1:1?{param}={value}")


def test_a_disk_queue_depth_past_its_range_is_refused_by_name(tmp_path):
    with pytest.raises(kvtier.InvalidArgumentError, match="qd=4294967296"):
        disk(str(tmp_path / "d"), "?qd=4294967296")


@pytest.mark.parametrize("knob,value", [("storage.disk.queue_depth", 0), ("storage.disk.queue_depth", 4097),
                                        ("storage.redis.workers", 0), ("storage.redis.workers", 257),
                                        ("storage.redis.max_batch_items", 0)])
def test_storage_knobs_past_their_range_are_refused_naming_the_knob(tmp_path, knob, value):
    """The backends refused these with their field's name only ('max_batch_items 0'); the knob is named now, and
    its variable when the variable set it."""
    spec = f"disk:{tmp_path}/d" if knob.startswith("storage.disk") else "redis://127.0.0.1:1"
    with pytest.raises(kvtier.InvalidArgumentError, match=knob.replace(".", r"\.")):
        kvtier.StorageBackend.open(spec, config={knob: value})
    var = "KVTIER_" + knob.upper().replace(".", "_")
    code = f"import kvtier\ntry:\n kvtier.StorageBackend.open({spec!r})\nexcept kvtier.InvalidArgumentError as e:\n print(e)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, var: str(value)}, capture_output=True,
                         text=True, timeout=60)
    assert var in out.stdout, (out.stdout, out.stderr)


@pytest.mark.parametrize("mode", ["0400", "0200", "0000"])
def test_a_file_mode_without_the_owners_read_and_write_is_refused(tmp_path, mode):
    """Accepted before: puts were acknowledged, and for a non-root user every get and the next open failed."""
    with pytest.raises(kvtier.InvalidArgumentError, match="storage.disk.file_mode"):
        kvtier.StorageBackend.open(f"disk:{tmp_path}/d", config={"storage.disk.file_mode": mode})


def test_a_password_in_a_spec_is_never_shown():
    """The error of a spec with a bad parameter echoed it whole, the Redis password with it."""
    with pytest.raises(kvtier.InvalidArgumentError) as e:
        kvtier.StorageBackend.open("redis://tenant-a:S3CRET@127.0.0.1:1?timeot_ms=5")
    assert "S3CRET" not in str(e.value) and "tenant-a:***@127.0.0.1:1" in str(e.value)
    assert kvtier.StorageBackend.redacted_spec("redis://:S3CRET@h:1?prefix=p") == "redis://:***@h:1?prefix=p"
    assert kvtier.StorageBackend.redacted_spec("disk:/var/kv") == "disk:/var/kv"
