"""The attribution matrix's cells (no Django: the benchmark reads them before any set-up)."""

WORLD = 2
LEVELS = (0, 1, 2)
FAILURES = ("sigkill", "exception", "hang", "sigkill_save", "exit137", "import")
RANKS = (0, WORLD - 1)
CELLS = [(lv, fl, rk) for lv in LEVELS for fl in FAILURES for rk in RANKS
         if not (fl == "import" and rk != 0)]  # a script that cannot import fails on every rank alike
CELL_IDS = [f"level{lv}-{fl}-r{rk}" for lv, fl, rk in CELLS]
