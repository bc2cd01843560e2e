"""host.cache_share: the last-level cache a profile records per core (Fingerprint.cache_bytes)."""

from hybridflow.runtime.controller.host import cache_share


def _level(root, index: int, level: int, size: str, shared: str) -> None:
    d = root / f"index{index}"
    d.mkdir(parents=True)
    (d / "level").write_text(f"{level}\n")
    (d / "size").write_text(f"{size}\n")
    (d / "shared_cpu_list").write_text(f"{shared}\n")


def test_the_largest_level_over_the_cores_sharing_it(tmp_path):
    _level(tmp_path, 0, 1, "32K", "0")
    _level(tmp_path, 2, 2, "512K", "0")
    _level(tmp_path, 3, 3, "16384K", "0-1,4,6-7")  # five CPUs share it
    assert cache_share(tmp_path) == 16 * 2**20 // 5


def test_a_system_that_does_not_say_gives_zero(tmp_path):
    assert cache_share(tmp_path) == 0  # no cache directories
    _level(tmp_path, 0, 1, "garbled", "0")
    assert cache_share(tmp_path) == 0
