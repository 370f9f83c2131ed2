"""``python -m usp_dit.planner --model M --world-size N [...]``: the planner's table (``planner.plan.main``)."""
import sys

from usp_dit.planner.plan import main

sys.exit(main())
