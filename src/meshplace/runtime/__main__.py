"""``python -m meshplace.runtime``: run a sharding plan on a torchrun rank
(:mod:`meshplace.runtime.launch`)."""

import os
import sys

from meshplace.runtime.launch import main

status = main()
sys.stdout.flush()
sys.stderr.flush()
# Leave without running C++ static destructors: after DTensor's collectives on gloo, a
# background thread's destructor at interpreter exit aborts the process now and then
# ("terminate called without an active exception", SIGABRT) though the work is done.
os._exit(status)
