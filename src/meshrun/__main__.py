"""`python -m meshrun ...` is the same as the `meshrun` command."""

from meshrun.cli import run

if __name__ == "__main__":
    run()
