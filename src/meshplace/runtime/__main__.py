"""``python -m meshplace.runtime``: run a sharding plan on a torchrun rank
(:mod:`meshplace.runtime.launch`)."""

import sys

from meshplace.runtime.launch import main

sys.exit(main())
