"""One controller's leader lease in a process of its own, for `tests/control/test_leader.py`: ticks
`LeaderLease.acquire()` every lease/5 seconds and appends `OWNER STATE UNIX_TIME` to `--log` at
every change of state (one `os.write` per line, O_APPEND).

    python -m tests.leader_proc --db URL --name LEASE --owner NAME --lease S --log FILE
"""

from __future__ import annotations

import argparse
import os
import time

from modelyard.control.leader import LeaderLease


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--db", "--name", "--owner", "--log"):
        parser.add_argument(name, required=True)
    parser.add_argument("--lease", type=float, required=True)
    args = parser.parse_args()
    fd = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    lease = LeaderLease(args.db, args.name, args.lease)
    last = None
    while True:
        state = lease.acquire()
        if state != last:
            os.write(fd, f"{args.owner} {state} {time.time():.3f}\n".encode())
            last = state
        time.sleep(args.lease / 5)


if __name__ == "__main__":
    main()
