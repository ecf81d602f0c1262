"""`python -m meshrun ...` is the same as the `meshrun` command."""

from meshrun.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
