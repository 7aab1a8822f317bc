"""The recipe a run trains with, built from config: the network (model, objective's heads, init
scheme), the optimizer and schedule, frozen modules and the mode policy, the precision, and the
probe (``build``). Measurements and signatures borrow from here (the init scheme's std, fp16
rounding, the mode policy, building a network again), so it sits below them; the loop above."""
