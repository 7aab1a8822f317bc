"""``python -m gradrepro.report``: every experiment over seeds, into results/README.md
(gradrepro/analysis/report.py)."""

import sys

from gradrepro.analysis.report import main

if __name__ == "__main__":
    sys.exit(main())
