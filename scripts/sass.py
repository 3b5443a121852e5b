"""The SASS reader lives in the package (localpd/measure/sass.py, which `localpd bench kernels --predict` uses);
the scripts of this folder import it from here."""

from localpd.measure.sass import *  # noqa: F401,F403
from localpd.measure.sass import budgets, compile_launch, cuobjdump, loop_stats, main_loop, print_budgets  # noqa: F401
