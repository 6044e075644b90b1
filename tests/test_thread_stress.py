"""Several Python threads saving, async-saving, loading and staging at once,
each with several C threads: every checkpoint loads bit for bit
(tests/thread_stress.py; scripts/tsan.sh runs it under ThreadSanitizer)."""
import thread_stress


def test_many_threads_through_dcpx_at_once_keep_their_bytes(tmp_path):
    assert thread_stress.main(["--workers", "3", "--rounds", "3", "--dir", str(tmp_path)]) == 0
