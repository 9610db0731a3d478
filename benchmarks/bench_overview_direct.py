"""Three overviews of one frontend over 4096 fake workers asked directly (no agents), after
warming up, and the frontend's CPU per page; py-spy's raw stacks of the frontend go to
``OUT/ov_<tag>.txt``. Run it from two checkouts to compare them (each with its own root on
``PYTHONPATH``):

    PYTHONPATH=. python benchmarks/bench_overview_direct.py . after /tmp
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time


def main() -> None:
    root, tag = sys.argv[1], sys.argv[2]
    out = sys.argv[3] if len(sys.argv) > 3 else "/tmp"
    sys.path.insert(0, f"{root}/benchmarks")
    import fakefleet as ff

    fleet, urls = ff.start_fleet(4096, 2, memo=True)
    try:
        proc, port = ff.start_frontend(urls, fetch_timeout=120.0)
        base = f"http://127.0.0.1:{port}"
        try:
            ff.timed_get(f"{base}/stacks")
            ff.timed_get(f"{base}/")
            ff.timed_get(f"{base}/")
            spy = subprocess.Popen(["py-spy", "record", "-p", str(proc.pid), "-r", "100",
                                    "--format", "raw", "-o", f"{out}/ov_{tag}.txt"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1)
            c0 = ff.cpu_s(proc.pid)
            ts = [ff.timed_get(f"{base}/", "text/html")[0] for _ in range(3)]
            c1 = ff.cpu_s(proc.pid)
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
            print(tag, "overview", [round(t, 2) for t in ts], "CPU s/page",
                  round((c1 - c0) / 3, 2))
        finally:
            ff.end_process(proc)
    finally:
        ff.stop_fleet(fleet)


if __name__ == "__main__":
    main()
