"""What a CPU server's fork server imports once, before it forks the workers (multiprocessing's
forkserver, which imports this module as its preload; nothing else should import it).

A spawned worker imports torch and the engine itself: about 3 s of CPU each on a 2-core machine,
paid by every worker of every unit at the start and again at each restart. Forked from a process
that has imported them, a worker starts in a fraction of a second. Only the CPU path forks (see
server/launcher.py's worker_context): GPU workers are spawned.

The fork server is the workers' parent, and they die with their parent (die_with_parent). So it
ignores SIGTERM and SIGINT as the workers do: a stop sent to the whole process group (systemd,
Ctrl-C in a terminal) reaches the launcher, which drains the requests in flight and then stops the
workers; the fork server must not go first and take them with it. It dies with the launcher, and
the workers with it: multiprocessing's own way out for a fork server (the end of a pipe every
process it forked also holds) would wait for the workers, which wait for it.
"""

from __future__ import annotations

import signal

from scheduler import decode_worker, prefill_worker, stub_worker  # noqa: F401  (what is forked)
from scheduler.worker_setup import die_with_parent, set_process_title

die_with_parent()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
set_process_title("ppd::fork-server")
