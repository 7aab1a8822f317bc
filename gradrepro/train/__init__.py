"""Training: one build of every part (``build``), the one loop (``loop.run``), and the parts
an experiment turns through config: precision, init, optimizer, mode policy."""
