"""``python -m gradrepro experiment=NAME [key=value ...]``: one run (or ``-m``, a sweep)."""

from gradrepro.cli import main

if __name__ == "__main__":
    main()
