"""``python -m gradrepro.compare PATH... [--table T] [--format F] [--out F] [--plot F.png]``:
the comparison tables of run and sweep folders (gradrepro/analysis/compare.py)."""

import sys

from gradrepro.analysis.compare import main

if __name__ == "__main__":
    sys.exit(main())
